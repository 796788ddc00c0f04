"""Offline checks of k8s/: every kustomize build validates, and says what the roles need.

`kubectl kustomize` builds each overlay (and the base); `kubernetes-validate` checks the
core kinds against the bundled Kubernetes schemas (strict: unknown fields fail). It has no
schema for the CRDs (KEDA ScaledObject/TriggerAuthentication, the Prometheus Operator's
PodMonitor), so the tests below check their required fields and that they point at objects
the same build contains. NetworkPolicies are checked by evaluating the flows the roles need
(and some they must not get) against them. Two runs rendered from k8s/README.md's run
parameters must not refer to each other; the trainer pods' start scripts and the model
wait script run for real under /bin/sh.
"""

from __future__ import annotations

import copy
import importlib.util
import ipaddress
import math
import os
import re
import signal
import subprocess
import sys
import threading
import tomllib
import urllib.parse
from pathlib import Path

import pytest
import yaml

from opsd.auth import OPEN_PATHS
from opsd.config import RunConfig
from opsd.queue import StreamNames
from tests.deploy_tools import BAD_REDIS_PASSWORDS, GOOD_REDIS_PASSWORD, ROOT, check, run_redis_start_script, run_tool, tool

K8S = ROOT / "k8s"
BUILDS = ("base", "overlays/cpu-demo", "overlays/gpu")
OVERLAYS = ("overlays/cpu-demo", "overlays/gpu")
K8S_VERSION = "1.34.0"  # a recent release that kubernetes-validate 1.37 bundles
CRD_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "TriggerAuthentication": "keda.sh/v1alpha1",
             "PodMonitor": "monitoring.coreos.com/v1"}
NAMESPACE = "opsd"
ROLES = ("embedder", "rollout", "teacher", "trainer")
GPU_ROLES = ("rollout", "teacher", "trainer", "trainer-workers")  # the embedder computes on CPU in the gpu overlay
TRAINER_JOBS = ("trainer", "trainer-workers")  # node rank 0 (run volume, Services), node ranks 1.. (none)
SCALED = {"rollout": "tasks", "teacher": "rollouts"}  # role -> the StreamNames attribute of its input
REDIS_USERS = ("rollout", "teacher", "trainer")  # the embedder never talks to Redis
TOKEN_USERS = ("embedder", "teacher", "rollout")  # the embedder requires it; /correspond and Search's /retrieve send it
EMBEDDER_CLIENTS = ("teacher", "rollout")
WORKERS = ("rollout", "teacher", "trainer")  # a SIGTERM lets them finish a job: long grace period
SECRET = "opsd-secrets"  # created by the user (k8s/README.md), never in the repo
SECRET_KEYS = {"redis-password", "api-token", "hf-token"}  # hf-token: optional, Job model-fetch only
GPU = "nvidia.com/gpu"
CLUSTER_SCOPED = {"Namespace"}
# The components that need CRDs: an overlay without them must still build (k8s/README.md).
CRD_COMPONENTS = ("../../components/keda", "../../components/monitoring")
# Switched on by a line in an overlay (k8s/README.md, "Scheduling" and "Models in").
OPTIONS = ("runtime-class", "gpu-model", "priority", "model-fetch")
# The sysctls the restricted Pod Security level allows (baseline's safe set); the trainer pins its ports with one.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports"}

_built: dict[str, str] = {}


def kustomize(path: str) -> str:
    if path not in _built:
        _built[path] = run_tool([tool("kubectl"), "kustomize", path]).stdout
    return _built[path]


class Build:
    """The objects of one `kubectl kustomize` output."""

    def __init__(self, text: str, path: str = ""):
        self.text, self.path = text, path
        self.docs = [d for d in yaml.safe_load_all(text) if d]

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def names(self, kind: str) -> set[str]:
        return {d["metadata"]["name"] for d in self.of(kind)}

    def get(self, kind: str, name: str) -> dict | None:
        return next((d for d in self.of(kind) if d["metadata"]["name"] == name), None)

    def generated(self, name: str) -> dict:
        """The ConfigMap generated as `name` (kustomize appends a content hash)."""
        found = [d for d in self.of("ConfigMap") if re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?", d["metadata"]["name"])]
        assert len(found) == 1, f"ConfigMap {name}: found {[d['metadata']['name'] for d in found]}"
        return found[0]

    def workloads(self) -> list[dict]:
        return self.of("Deployment") + self.of("StatefulSet") + self.of("Job")

    def role(self, role: str) -> dict:
        """The workload of `role`: a Deployment, or Job trainer / trainer-workers (the trainer's node ranks)."""
        kind = "Job" if role in TRAINER_JOBS else "Deployment"
        w = self.get(kind, role)
        assert w is not None, f"no {kind} {role}"
        return w

    def env(self, container: dict) -> dict[str, str]:
        """A container's environment as Kubernetes would set it (Secret values as <secret:NAME/KEY>, downward API
        resource values as <resource:NAME>)."""
        env: dict[str, str] = {}
        for src in container.get("envFrom", []):  # in order: a later source wins
            if "configMapRef" in src:  # a Secret's keys (secretRef) are the user's, unknown here
                env.update(self.get("ConfigMap", src["configMapRef"]["name"])["data"])
        for e in container.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                env[e["name"]] = f"<secret:{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}>"
            elif "configMapKeyRef" in ref:
                env[e["name"]] = self.get("ConfigMap", ref["configMapKeyRef"]["name"])["data"][ref["configMapKeyRef"]["key"]]
            elif "resourceFieldRef" in ref:
                env[e["name"]] = f"<resource:{ref['resourceFieldRef']['resource']}>"
            else:
                env[e["name"]] = e["value"]
        return env

    def args(self, container: dict) -> list[str]:
        """A container's args with $(VAR) expanded from its environment, as the kubelet does."""
        env = self.env(container)
        return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container.get("args", [])]


@pytest.fixture(scope="module", params=BUILDS)
def build(request) -> Build:
    return Build(kustomize(f"k8s/{request.param}"), request.param)


def pod_spec(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def container(w: dict) -> dict:
    return pod_spec(w)["containers"][0]


def pod_labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) applied to `labels`."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def sysctl(w: dict, name: str) -> str:
    """The value the workload's pods set for sysctl `name`."""
    (value,) = [s["value"] for s in pod_spec(w)["securityContext"].get("sysctls", []) if s["name"] == name]
    return value


def mount(w: dict, path: str) -> dict:
    """The volume mounted at `path` in the workload's container."""
    m = next((m for m in container(w).get("volumeMounts", []) if m["mountPath"] == path), None)
    assert m is not None, f"{w['metadata']['name']}: nothing mounted at {path}"
    return next(v for v in pod_spec(w)["volumes"] if v["name"] == m["name"])


# --- schemas -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", BUILDS)
def test_every_build_validates_against_the_kubernetes_schemas(path):
    text = kustomize(f"k8s/{path}")
    docs = Build(text).docs
    # --quiet: only failures and warnings are printed (a failing run's tail then shows the errors).
    out = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"], stdin=text).stdout
    assert not [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL"))], out
    # A document without a schema is only warned about: that must be exactly the CRD documents
    # (a typo in a core kind or its apiVersion would land here too).
    unchecked = re.findall(r"Couldn't find schema for kind (\S+) with api version (\S+)", out)
    assert sorted(unchecked) == sorted((d["kind"], d["apiVersion"]) for d in docs if d["kind"] in CRD_KINDS), out
    assert set(unchecked) <= set(CRD_KINDS.items()) and len(docs) > len(unchecked)


def test_the_validator_rejects_an_unknown_field():
    """The check above can fail: a misspelled container field is an error in strict mode."""
    b = Build(kustomize("k8s/overlays/gpu"))
    w = b.role("rollout")
    container(w)["securityContex"] = {"runAsNonRoot": True}
    p = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, "-"], input=yaml.safe_dump(w),
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "securityContex" in p.stdout, p.stdout


def test_yamllint():
    run_tool([tool("yamllint"), "-s", "-d", "{extends: relaxed, rules: {line-length: disable}}", "k8s"])


# --- run config and streams --------------------------------------------------------------------


def test_the_base_run_config_is_the_quickstart_without_a_stream_prefix():
    """The roles derive the prefix from their run directory, which OPSD_RUN_NAME names (one parameter)."""
    ours = yaml.safe_load((K8S / "base" / "run.yaml").read_text())
    quickstart = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    assert ours == quickstart
    assert RunConfig.load(K8S / "base" / "run.yaml").redis.stream_prefix is None


def run_config(build: Build, tmp_path: Path) -> RunConfig:
    """The run config the build mounts into every role (ConfigMap opsd-config)."""
    config = tmp_path / "run.yaml"
    config.write_text(build.generated("opsd-config")["data"]["run.yaml"])
    return RunConfig.load(config)


# A role's own start (opsd/service.py RoleProcess.start) with the build's config and a run directory.
DERIVE_PREFIX = """
import sys
from opsd.service import RoleProcess
print(RoleProcess.start("rollout", sys.argv[1], sys.argv[2]).cfg.redis.stream_prefix)
"""


def derived_prefix(build: Build, tmp_path: Path, run_dir: str) -> str:
    """The stream prefix a role started with the build's run config and `run_dir` uses (a real start, in a subprocess)."""
    config = tmp_path / "derive.yaml"
    config.write_text(build.generated("opsd-config")["data"]["run.yaml"])
    env = {k: v for k, v in os.environ.items() if k not in ("OPSD_PORT", "OPSD_PARENT_PID")}
    p = subprocess.run([sys.executable, "-c", DERIVE_PREFIX, str(config), run_dir], capture_output=True, text=True,
                       cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def run_dir_of(build: Build, role: str) -> str:
    """The --run-dir a role's pod gets (its args with $(VAR) expanded); the trainer's: its script's, the same string."""
    c = container(build.role(role))
    if role in TRAINER_JOBS:
        script = c["args"][0]
        quoted = re.search(r'--run-dir "([^"]+)"', script).group(1)
        return quoted.replace("$OPSD_RUN_NAME", build.env(c)["OPSD_RUN_NAME"])
    args = build.args(c)
    return args[args.index("--run-dir") + 1]


def triggers(scaled_object: dict) -> dict[str, dict]:
    """A ScaledObject's triggers by type (one of each)."""
    found = {t["type"]: t for t in scaled_object["spec"]["triggers"]}
    assert len(found) == len(scaled_object["spec"]["triggers"]), scaled_object["metadata"]["name"]
    return found


def test_keda_scales_on_the_streams_and_the_marker_of_the_run(build, tmp_path):
    cfg = run_config(build, tmp_path)
    run_dirs = {run_dir_of(build, role) for role in ROLES + ("trainer-workers",)}
    assert len(run_dirs) == 1, f"every role must get the same run directory: {run_dirs}"
    (run_dir,) = run_dirs
    run_name = build.generated("opsd-run")["data"]["OPSD_RUN_NAME"]
    assert run_dir == f"/data/runs/{run_name}"
    names = StreamNames(derived_prefix(build, tmp_path, run_dir))
    assert names.prefix == f"opsd:{run_name}"
    scaled = build.of("ScaledObject")
    # The base holds core kinds only; the overlays add k8s/components/keda.
    assert sorted(s["spec"]["scaleTargetRef"]["name"] for s in scaled) == ([] if build.path == "base" else sorted(SCALED))
    for s in scaled:
        assert s["apiVersion"] == CRD_KINDS["ScaledObject"]
        spec = s["spec"]
        role = spec["scaleTargetRef"]["name"]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        target = build.get("Deployment", role)
        assert target is not None, f"ScaledObject {s['metadata']['name']} targets a missing Deployment {role}"
        assert "replicas" not in target["spec"], f"{role}: KEDA owns the replica count"
        # Zero after DONE; the marker's trigger keeps one pod during the run.
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1 and spec["cooldownPeriod"] > 0
        by_type = triggers(s)
        assert set(by_type) == {"redis-streams", "redis"}, s["metadata"]["name"]
        backlog = by_type["redis-streams"]["metadata"]
        assert backlog["stream"] == getattr(names, SCALED[role])
        # No consumerGroup: KEDA reads XLEN, the backlog (waiting + in flight) whatever the ack order
        # (tests/test_keda_backlog.py); one pod's share is the groups it holds at once.
        assert "consumerGroup" not in backlog and "lagCount" not in backlog
        assert backlog["streamLength"] == str(cfg.groups_in_flight(role))
        # Activation decides 0 <-> 1 pods; "0" or "1" (kedacore/keda#6478).
        assert backlog["activationLagCount"] in ("0", "1")
        # KEDA's redis scaler: LLEN of the list (0 for a missing key), one pod per listLength, active above
        # activationListLength (default 0): the trainer's marker of length 1 = one pod until DONE deletes it.
        marker = by_type["redis"]["metadata"]
        assert marker["listName"] == f"{names.prefix}:active"
        assert marker["listLength"] == "1" and marker.get("activationListLength", "0") == "0"
        for trigger in by_type.values():
            meta = trigger["metadata"]
            assert re.fullmatch(r"[\w.-]+:\d+", meta["address"]), meta["address"]
            auth = build.get("TriggerAuthentication", trigger["authenticationRef"]["name"])
            assert auth is not None and auth["apiVersion"] == CRD_KINDS["TriggerAuthentication"]
            refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
            assert refs["password"] == (SECRET, "redis-password")
    # The roles read that same config file.
    for role in ROLES + ("trainer-workers",):
        w = build.role(role)
        script = " ".join(container(w)["args"])
        config_path = Path(re.search(r'--config\s+"?([^\s"]+)', script).group(1))
        volume = mount(w, str(config_path.parent))
        assert volume["configMap"]["name"] == build.generated("opsd-config")["metadata"]["name"]
        assert config_path.name in build.generated("opsd-config")["data"]


def test_keda_scale_out_is_reachable(build, tmp_path):
    """KEDA wants ceil(XLEN / streamLength) pods; the backlog never exceeds what the trainer issues at once.

    The trainer keeps the tasks of steps [n, n + max_staleness] issued, env.num_games groups a step
    (services/trainer/controller.py), and each task becomes one rollout group: that is the most
    entries either stream can hold undelivered. Below 2 pods' worth, KEDA could never scale out.
    """
    cfg = run_config(build, tmp_path)
    max_lag = cfg.env.num_games * (cfg.run.max_staleness + 1)
    for s in build.of("ScaledObject"):
        per_pod = int(triggers(s)["redis-streams"]["metadata"]["streamLength"])
        wanted = math.ceil(max_lag / per_pod)
        assert wanted >= 2, (f"{s['metadata']['name']}: at most {max_lag} entries / streamLength {per_pod} "
                             f"= {wanted} pod: raise env.num_games or run.max_staleness")
        assert s["spec"]["maxReplicaCount"] >= 2


def test_keda_and_the_roles_use_one_redis_address(build):
    redis_cm = build.generated("opsd-redis")
    data = redis_cm["data"]
    assert data["scheme"] in ("redis", "rediss")
    assert data["tls"] == ("true" if data["scheme"] == "rediss" else "false")
    for s in build.of("ScaledObject"):
        for trigger in s["spec"]["triggers"]:
            assert trigger["metadata"]["address"] == data["address"], s["metadata"]["name"]
            assert trigger["metadata"]["enableTLS"] == data["tls"], s["metadata"]["name"]
    service = build.get("Service", "redis")
    if service is not None:  # in-cluster Redis: a name the KEDA operator (another namespace) resolves too
        port = service["spec"]["ports"][0]["port"]
        assert data["address"] == f"redis.{service['metadata']['namespace']}.svc:{port}"
    for role in REDIS_USERS:
        env = build.env(container(build.role(role)))
        assert env["REDIS_ADDRESS"] == data["address"] and env["REDIS_SCHEME"] == data["scheme"]
        assert env["REDIS_PASSWORD"] == f"<secret:{SECRET}/redis-password>"
        assert env["REDIS_URL"] == "$(REDIS_SCHEME)://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0"
    # Ranks > 0 take everything from rank 0 over the process group: no Redis.
    assert "REDIS_URL" not in build.env(container(build.role("trainer-workers")))


def readme_section(heading: str) -> str:
    """The text of the k8s/README.md section whose heading starts with `heading`, up to the next heading."""
    text = (K8S / "README.md").read_text()
    section = re.search(rf"^#+ (?:\d+\. )?{re.escape(heading)}.*?(?=^#+ |\Z)", text, re.M | re.S)
    assert section, f"k8s/README.md: no section {heading!r}"
    return section.group(0)


def readme_block(heading: str) -> dict:
    """The first ```yaml block under the k8s/README.md heading that starts with `heading`, parsed."""
    block = re.search(r"^```yaml\n(.*?)^```", readme_section(heading), re.M | re.S)
    assert block, f"k8s/README.md, {heading!r}: no yaml block"
    return yaml.safe_load(block.group(1))


def overlay_copy(tmp_path: Path, overlay: str = "gpu", drop: tuple[str, ...] = (), add: dict | None = None) -> Build:
    """Build a copy of an overlay with component lines deleted and README fragments appended (as a user would)."""
    source = K8S / "overlays" / overlay
    lines = (source / "kustomization.yaml").read_text().splitlines()
    kept = [line for line in lines if line.strip().removeprefix("- ") not in drop]
    assert len(lines) - len(kept) == len(drop), f"not every line of {drop} is in the overlay"
    k = yaml.safe_load("\n".join(kept))
    for key in ("resources", "components", "transformers"):
        k[key] = [os.path.relpath((source / r).resolve(), tmp_path) for r in k.get(key, [])]
    for key, value in (add or {}).items():
        k[key] = k.get(key, []) + value  # the README's entries go after the overlay's own
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return Build(run_tool([tool("kubectl"), "kustomize", str(tmp_path)]).stdout, f"copy of overlays/{overlay}")


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_switching_to_an_external_redis_is_one_file(overlay, tmp_path):
    """What k8s/README.md says (External managed Redis): drop the component line, add its fragment to the overlay; KEDA follows."""
    fragment = readme_block("External managed Redis")
    assert set(fragment) == {"configMapGenerator", "patches"}
    b = overlay_copy(tmp_path, overlay, drop=("../../components/redis",), add=fragment)
    literals = dict(x.split("=", 1) for x in fragment["configMapGenerator"][0]["literals"])
    address = literals["address"]
    assert b.get("Deployment", "redis") is None and b.get("Service", "redis") is None
    assert b.get("NetworkPolicy", "redis-ingress") is None
    # The address is the one given, on every trigger: the run's namespace does not rewrite it.
    assert [t["metadata"]["address"] for s in b.of("ScaledObject") for t in s["spec"]["triggers"]] == [address] * 2 * len(SCALED)
    assert {t["metadata"]["enableTLS"] for s in b.of("ScaledObject") for t in s["spec"]["triggers"]} == {literals["tls"]}
    env = b.env(container(b.role("trainer")))
    assert (env["REDIS_SCHEME"], env["REDIS_ADDRESS"]) == (literals["scheme"], address)
    # The patch lets exactly the Redis users reach the endpoint, on its port, and nothing else outside.
    policies = b.of("NetworkPolicy")
    (rule,) = [r for p in policies for r in p["spec"].get("egress", []) if any("ipBlock" in x for x in r["to"])]
    net = ipaddress.ip_network(rule["to"][0]["ipBlock"]["cidr"])
    assert net.num_addresses <= 256, f"{net}: allow your Redis endpoint, not a whole network"
    endpoint = Pod(None, {}, ip=str(net[0]))
    port = int(address.rsplit(":", 1)[1])
    for role in ROLES:
        src = Pod(NAMESPACE, pod_labels(b.role(role)))
        assert flow_allowed(policies, src, endpoint, port) == (role in REDIS_USERS), role
        assert not flow_allowed(policies, src, endpoint, 22), role
        for host in INTERNET:
            assert not flow_allowed(policies, src, host, 443), (role, host.ip)


def test_the_readme_dns_rules_work_as_patches(tmp_path):
    """NodeLocal DNSCache and OpenShift DNS: the README's extra egress rule, added by an overlay patch."""
    fragment = readme_block("NetworkPolicy and DNS")
    b = overlay_copy(tmp_path, "gpu", add=fragment)
    policies = b.of("NetworkPolicy")
    nodelocal = Pod(None, {}, ip="169.254.20.10")
    openshift = Pod("openshift-dns", {"dns.operator.openshift.io/daemonset-dns": "default"})
    for role in ROLES:
        src = Pod(NAMESPACE, pod_labels(b.role(role)))
        assert flow_allowed(policies, src, nodelocal, 53, "UDP") and flow_allowed(policies, src, nodelocal, 53, "TCP")
        assert flow_allowed(policies, src, openshift, 5353, "UDP") and flow_allowed(policies, src, openshift, 5353, "TCP")
        assert not flow_allowed(policies, src, nodelocal, 443)
        for host in INTERNET:
            assert not flow_allowed(policies, src, host, 53, "UDP"), (role, host.ip)


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_an_overlay_builds_without_the_crd_components(overlay, tmp_path):
    """No KEDA or Prometheus Operator: deleting the two component lines leaves core kinds only."""
    b = overlay_copy(tmp_path, overlay, drop=CRD_COMPONENTS)
    assert not [d["kind"] for d in b.docs if d["kind"] in CRD_KINDS]
    for role in ROLES:
        b.role(role)
    out = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"], stdin=b.text).stdout
    assert not [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL", "WARN"))], out


def test_the_overlays_include_the_components_and_pin_the_images():
    for overlay, tag in (("cpu-demo", "0.1.0"), ("gpu", "0.1.0-cuda")):
        k = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        assert k["components"] == ["../../components/redis", *CRD_COMPONENTS], overlay
        assert k["transformers"] == ["../../run"] and "replacements" not in k, overlay  # k8s/run, after the patches
        images = {i["name"]: i for i in k["images"]}
        assert set(images) == {f"ghcr.io/opsd-project/opsd-{role}" for role in ROLES}, overlay
        assert {i.get("newTag") for i in images.values()} == {tag}, overlay
        b = Build(kustomize(f"k8s/overlays/{overlay}"))
        for role in ROLES:
            assert container(b.role(role))["image"] == f"ghcr.io/opsd-project/opsd-{role}:{tag}"


# --- monitoring --------------------------------------------------------------------------------


def test_the_podmonitor_scrapes_every_role(build):
    if build.path == "base":  # the overlays add k8s/components/monitoring
        assert not build.of("PodMonitor")
        return
    assert build.names("PodMonitor") == {"opsd", "opsd-redis"}
    pm = build.get("PodMonitor", "opsd")
    assert pm["apiVersion"] == CRD_KINDS["PodMonitor"]
    selector = pm["spec"]["selector"]
    assert selector["matchLabels"]["app.kubernetes.io/part-of"] == "opsd"
    for role in ROLES:
        w = build.role(role)
        assert selects(selector, pod_labels(w)), f"the PodMonitor misses {role}"
        ports = {p["name"] for p in container(w)["ports"]}
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
    redis = build.get("Deployment", "redis")
    assert redis is None or not selects(selector, pod_labels(redis))  # no /metrics there
    # Redis's own: its exporter sidecar's port (with an external Redis, no pod: it selects nothing).
    redis_pm = build.get("PodMonitor", "opsd-redis")
    if redis is not None:
        assert selects(redis_pm["spec"]["selector"], pod_labels(redis))
        ports = {p["name"] for c in pod_spec(redis)["containers"] for p in c.get("ports", [])}
        assert [(ep["port"], ep["path"]) for ep in redis_pm["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")]
        assert "metrics" in ports
    for role in ROLES:
        assert not selects(redis_pm["spec"]["selector"], pod_labels(build.role(role)))


# --- workloads ---------------------------------------------------------------------------------


def test_every_workload_is_hardened_and_references_what_exists(build):
    assert build.workloads()
    claims, configmaps = build.names("PersistentVolumeClaim"), build.names("ConfigMap")
    assert not build.of("Secret"), "secrets are created by the user, never committed"
    for w in build.workloads():
        name, spec = w["metadata"]["name"], pod_spec(w)
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == sc["runAsGroup"] == sc["fsGroup"] == 10001, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for host in ("hostNetwork", "hostPID", "hostIPC"):  # the node's namespaces
            assert spec.get(host, False) is False, f"{name}: {host}"
        volumes = {v["name"]: v for v in spec["volumes"]}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            assert set(v) - {"name"} <= {"persistentVolumeClaim", "configMap", "emptyDir"}, (name, v)
        for sysctl in sc.get("sysctls", []):
            assert sysctl["name"] in SAFE_SYSCTLS, f"{name}: {sysctl['name']} needs more than the restricted level"
        if w["kind"] == "Job":  # podFailurePolicy needs Never: every retry is a new pod the Job counts
            assert spec["restartPolicy"] == "Never", name
        assert spec["containers"]
        for c in spec["containers"] + spec.get("initContainers", []) + spec.get("ephemeralContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"], name
            assert not csc["capabilities"].get("add"), f"{name}: adds capabilities"
            assert csc["readOnlyRootFilesystem"] is True, name
            # A container's own settings override the pod's: no way back to root or the host from here.
            assert csc.get("privileged", False) is False, f"{name}: privileged"
            assert csc.get("runAsNonRoot", True) is True, name
            assert csc.get("runAsUser", sc["runAsUser"]) == csc.get("runAsGroup", sc["runAsGroup"]) == 10001, name
            assert csc.get("procMount", "Default") == "Default" and "seLinuxOptions" not in csc, name
            assert csc.get("seccompProfile", sc["seccompProfile"])["type"] == "RuntimeDefault", name
            assert not [port for port in c.get("ports", []) if "hostPort" in port], f"{name}: hostPort"
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert set(mounts.values()) <= set(volumes), name
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{name}: a read-only root needs a writable /tmp"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
            image = c["image"]
            tag = re.fullmatch(r"[^:@]+(?::[^:@/]+)?:([\w][\w.-]*)", image)
            assert tag and tag.group(1) != "latest", f"{name}: image {image} is not pinned"
            defined = set()
            for src in c.get("envFrom", []):
                assert set(src) == {"configMapRef"} and src["configMapRef"]["name"] in configmaps, (name, src)
                defined |= set(build.get("ConfigMap", src["configMapRef"]["name"])["data"])
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    s = ref["secretKeyRef"]
                    assert s["name"] == SECRET and s["key"] in SECRET_KEYS, (name, e)
                elif "configMapKeyRef" in ref:
                    cm = build.get("ConfigMap", ref["configMapKeyRef"]["name"])
                    assert cm is not None and ref["configMapKeyRef"]["key"] in cm["data"], (name, e)
                elif "resourceFieldRef" in ref:  # the downward API: this container's own resources
                    assert ref["resourceFieldRef"]["containerName"] == c["name"], (name, e)
                else:
                    # $(VAR) expands only from variables defined before it.
                    for var in re.findall(r"\$\((\w+)\)", e["value"]):
                        assert var in defined, f"{name}: {e['name']} uses $({var}) before it is defined"
                defined.add(e["name"])
            for arg in c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in defined, f"{name}: argument uses undefined $({var})"
            if c.get("command", [])[:2] == ["sh", "-c"]:  # the shell's own $VAR and $((VAR + 1)) expansions
                script = " ".join(c["command"][2:] + c.get("args", []))
                used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", script)) | set(re.findall(r"\$\(\((\w+)", script))
                indexed = w["kind"] == "Job" and w["spec"].get("completionMode") == "Indexed"
                injected = {"JOB_COMPLETION_INDEX"} if indexed else set()  # set by the Job controller
                assert used <= defined | injected, f"{name}: the script uses undefined {sorted(used - defined - injected)}"


@pytest.mark.parametrize("role", ROLES)
def test_each_role_runs_its_module_with_probes_env_and_service(build, role):
    w = build.role(role)
    labels = {"app.kubernetes.io/name": role, "app.kubernetes.io/component": role, "app.kubernetes.io/part-of": "opsd"}
    assert w["metadata"]["labels"] == labels and pod_labels(w) == labels
    c = container(w)
    if role in TRAINER_JOBS:  # a Job's selector is its own; torchrun starts the module (test_the_trainer_pods_...)
        assert "selector" not in w["spec"]
        assert c["command"] == ["sh", "-c"] and " -m services.trainer " in c["args"][0]
    else:
        assert selects(w["spec"]["selector"], pod_labels(w))
        assert c["command"] == ["python", "-m", f"services.{role}"]
    assert importlib.util.find_spec(f"services.{role}.__main__") is not None
    assert {"name": "http", "containerPort": 8000} in c["ports"]
    # Ready = the model loaded and answered a probe request (startup and readiness); live = the loop progresses.
    # /health answers as soon as the HTTP thread is up: no probe may use it (opsd/service.py, opsd/probes.py).
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
        assert path in OPEN_PATHS, f"{path} needs a token: the kubelet sends none"
    startup = c["startupProbe"]
    # Sized to model load (k8s/README.md, Probes): a 7B model and vLLM's start; the trainer also reads its checkpoint.
    least = {"embedder": 600, "rollout": 900, "teacher": 900, "trainer": 1200}[role]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= least, "model loading takes minutes"
    live = c["livenessProbe"]
    assert live["timeoutSeconds"] >= 5 and live["failureThreshold"] >= 2, "a busy worker answers late, not never"
    env = build.env(c)
    assert (env["OPSD_PORT"], env["OPSD_BIND_HOST"], env["OPSD_CACHE"]) == ("8000", "0.0.0.0", "/cache")
    assert "emptyDir" in mount(w, "/cache"), "a per-pod cache, not flock over a network filesystem"
    assert mount(w, "/data")["persistentVolumeClaim"]["claimName"] == "opsd-data"
    assert ("REDIS_URL" in env) == (role in REDIS_USERS)
    assert env.get("OPSD_API_TOKEN") == (f"<secret:{SECRET}/api-token>" if role in TOKEN_USERS else None)
    assert env.get("OPSD_EMBEDDER_URL") == ("http://embedder:8000" if role in EMBEDDER_CLIENTS else None)
    if role in WORKERS:
        assert pod_spec(w)["terminationGracePeriodSeconds"] >= 120
    service = build.get("Service", role)
    assert service is not None and selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
    assert {"name": "http", "port": 8000, "targetPort": "http"} in service["spec"]["ports"]
    if role == "trainer":  # rank 0's pod; the ranks find each other through trainer-peers (test_the_trainer_jobs)
        assert service["spec"]["clusterIP"] == "None"


def test_the_in_cluster_redis(build):
    redis = build.get("Deployment", "redis")
    if build.path == "base":  # the overlays add k8s/components/redis (or point at an external one)
        assert redis is None and build.get("NetworkPolicy", "redis-ingress") is None
        return
    assert redis is not None and build.get("NetworkPolicy", "redis-ingress") is not None
    c = container(redis)
    major = re.fullmatch(r"redis:(\d+)\.\d+\.\d+(-alpine)?", c["image"])
    assert major and int(major.group(1)) >= 7, "opsd's streams need Redis 7 (XAUTOCLAIM's deleted-entry list)"
    script = c["command"][-1]
    assert c["command"][:2] == ["sh", "-c"] and "args" not in c
    # maxmemory/noeviction and the append-only file: tests/test_redis_memory.py runs the script and its config.
    assert "maxmemory-policy noeviction" in script and "appendfsync always" in script
    # The password reaches redis-server through a private config file, never its command line.
    assert "umask 077" in script and 'requirepass "%s"' in script
    assert re.search(r'^\' "\$REDIS_PASSWORD" .*> /tmp/redis\.conf$', script, re.M), "printf's argument, not its format"
    assert "--requirepass" not in script and "$(REDIS_PASSWORD)" not in script
    assert "exec redis-server /tmp/redis.conf" in script
    assert build.env(c)["REDIS_PASSWORD"] == f"<secret:{SECRET}/redis-password>"
    assert build.env(c)["REDISCLI_AUTH"] == f"<secret:{SECRET}/redis-password>"  # the probe's redis-cli
    assert mount(redis, "/data")["persistentVolumeClaim"]["claimName"] == "redis-data"
    assert redis["spec"]["strategy"]["type"] == "Recreate"
    assert build.get("Service", "redis")["spec"]["ports"][0]["port"] == 6379
    # The exporter sidecar: pinned, the password from the Secret, Redis over the pod's loopback, no /scrape.
    (exporter,) = [x for x in pod_spec(redis)["containers"] if x["name"] == "exporter"]
    assert exporter["image"] == "oliver006/redis_exporter:v1.88.0"
    env = build.env(exporter)
    assert env["REDIS_PASSWORD"] == f"<secret:{SECRET}/redis-password>"
    assert env["REDIS_ADDR"] == "redis://localhost:6379" and env["REDIS_EXPORTER_DISABLE_SCRAPE_ENDPOINT"] == "true"
    assert [(p["name"], p["containerPort"]) for p in exporter["ports"]] == [("metrics", 9121)]
    assert exporter["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    tmp = {x["name"]: next(m["name"] for m in x["volumeMounts"] if m["mountPath"] == "/tmp") for x in (c, exporter)}
    assert tmp["redis"] != tmp["exporter"], "redis.conf in redis's /tmp holds the password"


def test_the_shared_volume(build):
    pvc = build.get("PersistentVolumeClaim", "opsd-data")
    modes = pvc["spec"]["accessModes"]
    # Pods of every role on any node: RWX. Only the single-node demo uses RWO.
    assert modes == (["ReadWriteOnce"] if build.path == "overlays/cpu-demo" else ["ReadWriteMany"])
    for role in ROLES:
        assert mount(build.role(role), "/data")["persistentVolumeClaim"]["claimName"] == "opsd-data"


@pytest.mark.parametrize("path", BUILDS)
def test_gpu_requests_by_overlay(path):
    b = Build(kustomize(f"k8s/{path}"))
    max_replicas = {s["spec"]["maxReplicaCount"] for s in b.of("ScaledObject")}
    if path == "overlays/cpu-demo":
        for w in b.workloads():
            for c in pod_spec(w)["containers"]:
                for kind in ("requests", "limits"):
                    assert GPU not in c["resources"].get(kind, {}), (w["metadata"]["name"], kind)
        assert max_replicas == {2}
        return
    toleration = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
    for role in ROLES + ("trainer-workers",):
        w = b.role(role)
        gpus = int(container(w)["resources"]["limits"].get(GPU, 0))
        # The gpu overlay runs the embedder (MiniLM, FAISS on CPU) without a GPU, off the tainted GPU nodes.
        assert gpus == (0 if (role, path) == ("embedder", "overlays/gpu") else 1), role
        if path == "overlays/gpu":
            image = "opsd-trainer" if role in TRAINER_JOBS else f"opsd-{role}"
            assert container(w)["image"] == f"ghcr.io/opsd-project/{image}:0.1.0-cuda"
            assert (toleration in pod_spec(w).get("tolerations", [])) == (role in GPU_ROLES), role
        if role in GPU_ROLES:  # NCCL and vLLM's workers need more than the 64 MiB a container gets
            shm = mount(w, "/dev/shm")["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"] == "8Gi", role
    if path == "overlays/gpu":
        # The component's own values (a Component does not build alone).
        shipped = yaml.safe_load_all((K8S / "components" / "keda" / "keda.yaml").read_text())
        base = {s["spec"]["maxReplicaCount"] for s in shipped if s["kind"] == "ScaledObject"}
        assert min(max_replicas) > max(base)
        for role in ("rollout", "teacher", "trainer", "trainer-workers"):
            def gib(build, role=role):
                return int(container(build.role(role))["resources"]["limits"]["memory"].removesuffix("Gi"))
            assert gib(b) > gib(Build(kustomize("k8s/base"))), f"{role}: the gpu overlay raises the limits"
    redis = b.get("Deployment", "redis")
    assert redis is None or GPU not in container(redis)["resources"]["limits"]


def test_everything_lives_in_the_namespace(build):
    assert build.get("Namespace", NAMESPACE) is not None
    for d in build.docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"].get("namespace") == NAMESPACE, (d["kind"], d["metadata"]["name"])


# --- network policies --------------------------------------------------------------------------


class Pod:
    """A pod (namespace, labels), or with ns None and an ip, a host outside the cluster."""

    def __init__(self, ns: str | None, labels: dict, ports: dict[str, int] | None = None, ip: str | None = None):
        self.ns, self.labels, self.ports, self.ip = ns, labels, ports or {}, ip


# Hosts on the internet (documentation ranges): no role may reach them, nor they a role.
INTERNET = (Pod(None, {}, ip="203.0.113.7"), Pod(None, {}, ip="2001:db8::7"), Pod(None, {}, ip="169.254.169.254"))
# Outside the cluster but not the internet: private, shared (carrier-grade NAT), link-local (cloud metadata), ULA.
PRIVATE_IPS = ("10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "fd00::1")


def _peer_matches(peer: dict, policy_ns: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        # Checked against outside hosts only (for pod IPs, ipBlock is implementation-defined).
        if pod.ip is None:
            return False
        ip, block = ipaddress.ip_address(pod.ip), peer["ipBlock"]

        def within(cidr: str) -> bool:
            net = ipaddress.ip_network(cidr, strict=False)
            return net.version == ip.version and ip in net

        return within(block["cidr"]) and not any(within(e) for e in block.get("except", []))
    if pod.ns is None:
        return False  # selectors pick pods, never an outside host
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod.ns})
    else:
        ns_ok = pod.ns == policy_ns
    return ns_ok and selects(peer.get("podSelector", {}), pod.labels)


def _port_matches(rule: dict, dst: Pod, port: int, protocol: str) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        number = dst.ports.get(p["port"]) if isinstance(p.get("port"), str) else p.get("port")
        last = p.get("endPort", number)  # a range number..endPort (numbers only)
        if p.get("protocol", "TCP") == protocol and (p.get("port") is None or (number is not None and number <= port <= last)):
            return True
    return False


def _side_allows(policies: list[dict], pod: Pod, other: Pod, direction: str, dst: Pod, port: int, protocol: str) -> bool:
    """Does `pod` let this flow through on its side (`direction` Ingress: other -> pod; Egress: pod -> other)?"""
    mine = [p for p in policies if p["metadata"]["namespace"] == pod.ns and selects(p["spec"]["podSelector"], pod.labels)
            and direction in p["spec"]["policyTypes"]]
    if not mine:
        return True  # not isolated in that direction
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in mine:
        for rule in p["spec"].get(key, []):
            peer_ok = not rule.get(peers) or any(_peer_matches(x, p["metadata"]["namespace"], other) for x in rule[peers])
            if peer_ok and _port_matches(rule, dst, port, protocol):
                return True
    return False


def flow_allowed(policies: list[dict], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    return (_side_allows(policies, src, dst, "Egress", dst, port, protocol)
            and _side_allows(policies, dst, src, "Ingress", dst, port, protocol))


def test_network_policies_allow_the_flows_and_nothing_more(build):
    policies = build.of("NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert deny, "no default-deny policy"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            assert peers, f"{p['metadata']['name']} admits every source"
            for peer in peers:
                everyone = ({}, {"namespaceSelector": {}}, {"podSelector": {}, "namespaceSelector": {}})
                assert peer not in everyone, p["metadata"]["name"]
                assert peer.get("ipBlock", {}).get("cidr") != "0.0.0.0/0", p["metadata"]["name"]

    def pod(w):
        return Pod(NAMESPACE, pod_labels(w), {p["name"]: p["containerPort"] for c in pod_spec(w)["containers"]
                                              for p in c.get("ports", [])})

    roles = {r: pod(build.role(r)) for r in ROLES}
    redis_w = build.get("Deployment", "redis")
    # The base has no Redis yet: the pod the component adds stands in for it.
    redis = pod(redis_w) if redis_w else Pod(NAMESPACE, {"app.kubernetes.io/name": "redis"}, {"redis": 6379})
    dns = Pod("kube-system", {"k8s-app": "kube-dns"})
    prometheus = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    keda = Pod("keda", {"app": "keda-operator"})
    stranger = Pod("default", {"app": "curious"})
    web = Pod("default", {"app": "website"}, {"https": 443})

    for name, p in roles.items():
        assert flow_allowed(policies, p, dns, 53, "UDP"), f"{name}: DNS"
        assert flow_allowed(policies, prometheus, p, 8000), f"Prometheus -> {name}"
        assert not flow_allowed(policies, stranger, p, 8000), f"another namespace -> {name}"
        assert not flow_allowed(policies, p, web, 443), f"{name} -> a pod elsewhere"
        for host in INTERNET:  # an ipBlock egress (0.0.0.0/0, ...) or a rule without `to` reaches these
            for port, protocol in ((443, "TCP"), (80, "TCP"), (6379, "TCP"), (53, "UDP")):
                assert not flow_allowed(policies, p, host, port, protocol), f"{name} -> {host.ip}:{port}/{protocol}"
            assert not flow_allowed(policies, host, p, 8000), f"{host.ip} -> {name}"
        if redis_w is not None:
            assert flow_allowed(policies, p, redis, 6379) == (name in REDIS_USERS), f"{name} -> redis"
        else:  # the base: only the roles' side (Redis' own ingress rule comes with the component)
            assert _side_allows(policies, p, redis, "Egress", redis, 6379, "TCP") == (name in REDIS_USERS), name
    for name, p in roles.items():  # the teacher's /correspond and the rollout's /retrieve (Search), no one else
        assert flow_allowed(policies, p, roles["embedder"], 8000) == (name in EMBEDDER_CLIENTS), f"{name} -> embedder"
    assert not flow_allowed(policies, roles["embedder"], roles["rollout"], 8000)
    assert not flow_allowed(policies, roles["embedder"], roles["teacher"], 8000)
    assert not flow_allowed(policies, roles["rollout"], roles["teacher"], 8000)
    # The trainer's ranks: torchrun's rendezvous at rank 0 and NCCL/gloo's listening ports (the pods' ephemeral
    # range, pinned by a sysctl), between the trainer's pods only, every way.
    workers = pod(build.role("trainer-workers"))
    ranges = {sysctl(build.role(job), "net.ipv4.ip_local_port_range") for job in TRAINER_JOBS}
    assert len(ranges) == 1, ranges
    low, high = map(int, ranges.pop().split())
    assert 1024 < low < high and high - low >= 1000
    rendezvous = int(build.env(container(build.role("trainer")))["MASTER_PORT"])
    peers = ((roles["trainer"], workers), (workers, roles["trainer"]), (workers, workers))
    for port in (rendezvous, low, high):
        assert all(flow_allowed(policies, a, b, port) for a, b in peers), port
    for port in (low - 1, high + 1, 22, 8000):
        assert not flow_allowed(policies, workers, roles["trainer"], port), port
        assert not flow_allowed(policies, roles["trainer"], workers, port), port
    for name, p in roles.items():
        if name != "trainer":
            assert not flow_allowed(policies, p, roles["trainer"], rendezvous), f"{name} -> the rendezvous"
            assert not flow_allowed(policies, p, workers, low) and not flow_allowed(policies, workers, p, 8000), name
    assert not flow_allowed(policies, stranger, roles["trainer"], rendezvous) and not flow_allowed(policies, stranger, workers, low)
    assert flow_allowed(policies, workers, dns, 53, "UDP")
    assert not _side_allows(policies, workers, redis, "Egress", redis, 6379, "TCP"), "ranks > 0 need no Redis"
    for host in INTERNET:
        assert not flow_allowed(policies, workers, host, 443) and not flow_allowed(policies, host, workers, low)
    if redis_w is not None:
        assert flow_allowed(policies, keda, redis, 6379), "the KEDA operator polls the streams"
        assert not flow_allowed(policies, stranger, redis, 6379)
        assert flow_allowed(policies, prometheus, redis, 9121), "Prometheus scrapes the Redis exporter"
        assert not flow_allowed(policies, stranger, redis, 9121) and not flow_allowed(policies, keda, redis, 9121)
        assert not flow_allowed(policies, prometheus, redis, 6379)
        for host in INTERNET:
            assert not flow_allowed(policies, host, redis, 6379) and not flow_allowed(policies, redis, host, 443)


def test_the_readme_says_how_to_create_the_secret_and_switch_redis():
    text = (K8S / "README.md").read_text()
    for needle in ("create secret generic opsd-secrets", "redis-password", "api-token", "components/redis",
                   "kubectl apply -k k8s/overlays/gpu", "opsd-redis", "streamLength", "KEDA 2.11",
                   "components/keda", "components/monitoring", "docker build -f services/<role>/Dockerfile",
                   "kind load docker-image", "minikube image load", "linux/amd64", "10001", "169.254.20.10",
                   "openshift-dns", "release", "reclaim_idle_ms", "num_games", "max_staleness", "model.threads",
                   # the trainer across nodes, models in, a run as a parameter, scheduling, what ran here
                   "publishNotReadyAddresses", "podFailurePolicy", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_HCA",
                   "IPC_LOCK", "hostNetwork", "enforce: privileged", "Multus", "HF_HUB_OFFLINE=1", "hf-token",
                   "Air-gapped", "OPSD_RUN_NAME", "OPSD_TRAINER_WORKER_NODES", "Helm", "priorityclass.yaml",
                   "v2.20.2, commit 68a5b50", "redis_scaler.go", "Never run here"):
        assert needle in text, needle
    for block in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S):
        yaml.safe_load(block)  # what users copy must at least parse


def test_the_redis_start_script_refuses_a_password_unsafe_in_a_url(tmp_path):
    """Run k8s/components/redis's start script with /bin/sh and a fake redis-server."""
    redis = Build(kustomize("k8s/overlays/cpu-demo")).get("Deployment", "redis")
    script = container(redis)["command"][-1]
    p, conf = run_redis_start_script(script, GOOD_REDIS_PASSWORD, tmp_path / "good")
    assert p.returncode == 0, p.stderr
    args, config = p.stdout.split("CONFIG:\n")
    assert f'requirepass "{GOOD_REDIS_PASSWORD}"' in config and GOOD_REDIS_PASSWORD not in args
    assert "appendonly yes\nappendfsync always\n" in config and "dir /data\n" in config
    for i, bad in enumerate(BAD_REDIS_PASSWORDS):
        p, conf = run_redis_start_script(script, bad, tmp_path / f"bad{i}")
        assert p.returncode == 1 and not conf.exists() and "ARGS" not in p.stdout, (bad, p.stdout, p.stderr)
        assert "REDIS_PASSWORD" in p.stderr and "A-Za-z0-9_-" in p.stderr, p.stderr
        assert not bad or bad not in p.stdout + p.stderr, "the refused password is printed"


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_the_weights_http_component_leaves_rollout_and_teacher_without_the_run_volume(overlay, tmp_path):
    """k8s/components/weights-http (k8s/README.md, "Weights over the network"): rollout and teacher pods fetch
    weights from the trainer's Service over the network and mount no PVC; the trainer serves them with the token."""
    component = "../../components/weights-http"
    assert component in (K8S / "README.md").read_text()
    b = overlay_copy(tmp_path, overlay, add={"components": [os.path.relpath(K8S / "components" / "weights-http", tmp_path)]})
    for role in ("rollout", "teacher"):
        w = b.role(role)
        assert "emptyDir" in mount(w, "/data") and "persistentVolumeClaim" not in mount(w, "/data"), role
        # No run volume; the model cache (HF_HOME), read-only, is the only claim left.
        claims = [v["persistentVolumeClaim"] for v in pod_spec(w)["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [{"claimName": "opsd-models", "readOnly": True}], role
        env = b.env(container(w))
        assert env["OPSD_WEIGHTS_TRANSPORT"] == "http" and env["OPSD_WEIGHTS_URL"] == "http://trainer:8000", role
        assert env["OPSD_API_TOKEN"] == "<secret:opsd-secrets/api-token>", role
    trainer = b.role("trainer")
    env = b.env(container(trainer))
    assert env["OPSD_WEIGHTS_TRANSPORT"] == "http" and env["OPSD_API_TOKEN"] == "<secret:opsd-secrets/api-token>"
    assert mount(trainer, "/data")["persistentVolumeClaim"]["claimName"] == "opsd-data"
    service = b.get("Service", "trainer")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8000, "http")]
    policies = b.of("NetworkPolicy")
    pods = {r: Pod(NAMESPACE, pod_labels(b.role(r)), {p["name"]: p["containerPort"] for p in container(b.role(r))["ports"]})
            for r in ROLES}
    for role in ROLES:
        assert flow_allowed(policies, pods[role], pods["trainer"], 8000) == (role in ("rollout", "teacher")), role
    assert not flow_allowed(policies, Pod("default", {"app": "curious"}), pods["trainer"], 8000)
    out = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"], stdin=b.text).stdout
    assert not [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL"))], out


# --- the trainer across nodes ------------------------------------------------------------------


def run_copy(tmp_path: Path, namespace: str, name: str, worker_nodes: int, overlay: str = "gpu") -> Build:
    """A run as k8s/README.md ("A run is a parameter") writes one, at k8s/runs/<x>/, with its namespace and
    opsd-run literals replaced: built from `tmp_path`."""
    k = readme_block("A run is a parameter")
    home = K8S / "runs" / "example"  # where the README puts it: its paths are relative to that directory
    assert k["resources"] == ["../../overlays/gpu"] and k["transformers"] == ["../../run"], k
    k["namespace"] = namespace
    k["resources"] = [os.path.relpath((home / f"../../overlays/{overlay}").resolve(), tmp_path)]
    k["transformers"] = [os.path.relpath((home / t).resolve(), tmp_path) for t in k["transformers"]]
    (generator,) = k["configMapGenerator"]
    assert generator["name"] == "opsd-run" and generator["behavior"] == "merge"
    literals = dict(x.split("=", 1) for x in generator["literals"])
    assert set(literals) == {"OPSD_RUN_NAME", "OPSD_TRAINER_WORKER_NODES"}, literals
    generator["literals"] = [f"OPSD_RUN_NAME={name}", f"OPSD_TRAINER_WORKER_NODES={worker_nodes}"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return Build(run_tool([tool("kubectl"), "kustomize", str(tmp_path)]).stdout, f"run {name} in {namespace}")


def validate(text: str) -> None:
    """kubernetes-validate (strict) of a build: no error; only the CRD kinds go unchecked."""
    out = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"], stdin=text).stdout
    assert not [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL"))], out
    unchecked = set(re.findall(r"Couldn't find schema for kind (\S+) with api version (\S+)", out))
    assert unchecked <= set(CRD_KINDS.items()), out


def test_the_trainer_jobs(build):
    """Rank 0 (Job trainer) and ranks > 0 (Job trainer-workers): Indexed Jobs that complete at DONE, fail on
    FATAL_EXIT, rendezvous at rank 0's pod through a headless Service that publishes it before it is ready."""
    rank0, workers = build.role("trainer"), build.role("trainer-workers")
    nodes = int(build.generated("opsd-run")["data"]["OPSD_TRAINER_WORKER_NODES"])
    assert (rank0["spec"]["completions"], rank0["spec"]["parallelism"]) == (1, 1)
    assert workers["spec"]["completions"] == workers["spec"]["parallelism"] == nodes  # all at once: a rendezvous
    for job in (rank0, workers):
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and 1 <= spec["backoffLimit"] <= 10
        fail, ignore = spec["podFailurePolicy"]["rules"]
        assert fail == {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [3]}}
        assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        assert container(job)["name"] == "trainer"
        env = build.env(container(job))
        assert env["OPSD_EXIT_WHEN_DONE"] == "1" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert mount(job, "/models")["persistentVolumeClaim"] == {"claimName": "opsd-models", "readOnly": True}
    from opsd.service import FATAL_EXIT  # the code the Jobs fail on

    assert FATAL_EXIT == 3
    # MASTER_ADDR = <job>-<index 0>.<subdomain>: the hostname an Indexed Job gives its pod, published by a
    # headless Service that selects rank 0 only and lists it before it is ready.
    env = build.env(container(rank0))
    peers = build.get("Service", pod_spec(rank0)["subdomain"])
    assert env["MASTER_ADDR"] == f"{rank0['metadata']['name']}-0.{peers['metadata']['name']}"
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert selects({"matchLabels": peers["spec"]["selector"]}, pod_labels(rank0))
    assert not selects({"matchLabels": peers["spec"]["selector"]}, pod_labels(workers))
    (port,) = peers["spec"]["ports"]
    assert port["port"] == int(env["MASTER_PORT"])
    assert {"name": port["targetPort"], "containerPort": port["port"]} in container(rank0)["ports"]
    # Ranks > 0: no run volume (the checkpoint comes from rank 0 over the process group), no Service, no port.
    assert not [v for v in pod_spec(workers)["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "opsd-data"]
    assert "emptyDir" in mount(workers, "/data") and "ports" not in container(workers)
    assert mount(rank0, "/data")["persistentVolumeClaim"]["claimName"] == "opsd-data"
    # Both protected from drains while they run (a Job's pods: minAvailable, a number).
    budgets = {p["metadata"]["name"]: p for p in build.of("PodDisruptionBudget")}
    assert budgets["trainer"]["spec"]["minAvailable"] == 1 and selects(budgets["trainer"]["spec"]["selector"], pod_labels(rank0))
    assert budgets["trainer-workers"]["spec"]["minAvailable"] == nodes
    assert selects(budgets["trainer-workers"]["spec"]["selector"], pod_labels(workers))
    for role in ("rollout", "teacher"):
        assert budgets[role]["spec"]["maxUnavailable"] == 1 and selects(budgets[role]["spec"]["selector"], pod_labels(build.role(role)))
    assert "embedder" not in budgets  # one replica: a budget would block every drain or allow all
    for budget in budgets.values():
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert sum(selects(budget["spec"]["selector"], pod_labels(w)) for w in build.workloads()) == 1, budget


def trainer_argv(build: Build, job: str, tmp_path: Path, index: int | None = None) -> list[str]:
    """What the Job's container runs: its `sh -c` script under /bin/sh with the pod's environment (a fake
    python first on PATH prints its arguments)."""
    p = run_trainer_script(build, job, tmp_path, index)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def run_trainer_script(build: Build, job: str, tmp_path: Path, index: int | None = None) -> subprocess.CompletedProcess:
    """The Job's `sh -c` script run under /bin/sh with the pod's environment and a fake python (`trainer_argv`)."""
    c = container(build.role(job))
    assert c["command"] == ["sh", "-c"] and len(c["args"]) == 1
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in build.env(c).items() if not v.startswith("<secret:")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = str(index)  # the Job controller's, in an Indexed Job's pods
    return subprocess.run(["/bin/sh", "-c", c["args"][0]], capture_output=True, text=True, env=env, timeout=30)


@pytest.mark.parametrize("worker_nodes", [0, 2])
def test_the_trainer_pods_start_torchrun_with_their_node_rank(tmp_path, worker_nodes):
    """Each pod's script gives torchrun (its own argument parser) the node count, its node rank, the rendezvous
    and the run directory of the run's name; one node by default."""
    from torch.distributed.run import config_from_args, parse_args

    b = run_copy(tmp_path / "run", "team-t", "tnodes", worker_nodes)
    wait = int(b.generated("opsd-trainer")["data"]["OPSD_RENDEZVOUS_TIMEOUT_S"])
    startup = container(b.role("trainer"))["startupProbe"]
    # Rank 0 turns ready only after the rendezvous: its startup budget is that wait plus 20 min of loading.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= wait + 1200
    pods = [("trainer", 0, None)] + [("trainer-workers", i + 1, i) for i in range(b.role("trainer-workers")["spec"]["completions"])]
    assert len(pods) == worker_nodes + 1
    for job, rank, index in pods:
        argv = trainer_argv(b, job, tmp_path / f"{job}-{index}", index)
        assert argv[:2] == ["-m", "services.trainer.torchrun"] and importlib.util.find_spec("services.trainer.torchrun")
        args = parse_args(argv[2:])
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == (str(worker_nodes + 1), rank, "1"), (job, index)
        assert (args.master_addr, args.master_port) == ("trainer-0.trainer-peers", 29500)
        assert args.module and args.training_script == "services.trainer"
        assert args.training_script_args == ["--config", "/etc/opsd/run.yaml", "--run-dir", "/data/runs/tnodes"]
        # What torchrun's static rendezvous reads as its TCPStore timeout (static_tcp_rendezvous.py: int(timeout)).
        config, _, _ = config_from_args(args)
        assert (config.rdzv_backend, int(config.rdzv_configs["timeout"])) == ("static", wait)


def test_the_readme_multi_gpu_snippet_gives_each_trainer_pod_its_ranks_and_gpus(tmp_path):
    """k8s/README.md, "The trainer across nodes": OPSD_NPROC_PER_NODE and the GPU limit of both Jobs move together."""
    b = overlay_copy(tmp_path / "overlay", "gpu", add=readme_block("The trainer across nodes"))
    validate(b.text)
    for job in TRAINER_JOBS:
        c = container(b.role(job))
        assert int(c["resources"]["limits"][GPU]) == int(b.env(c)["OPSD_NPROC_PER_NODE"]) == 4, job
    argv = trainer_argv(b, "trainer", tmp_path / "argv")
    assert argv[argv.index("--nproc-per-node") + 1] == "4"


def test_the_readme_run_directory_is_not_ignored_by_git():
    """k8s/README.md suggests committing a run at k8s/runs/<name>/; only the repo root's runs/ (outputs) is ignored."""
    text = (K8S / "README.md").read_text()
    (path,) = set(re.findall(r"`(k8s/runs/[a-z0-9-]+/kustomization\.yaml)`", text))
    for p, ignored in ((path, False), ("runs/bench/x.json", True)):  # check-ignore: 0 ignored, 1 not
        assert subprocess.run(["git", "check-ignore", "-q", p], cwd=ROOT).returncode == (0 if ignored else 1), p


def test_a_negative_worker_node_count_fails_the_trainer_jobs_with_its_name(tmp_path):
    """OPSD_TRAINER_WORKER_NODES=-1 renders and passes the schemas (nothing bounds completions there), and rank 0's
    script would start torchrun with --nnodes 0: each trainer pod refuses it, exit 3 (podFailurePolicy FailJob)."""
    b = run_copy(tmp_path / "run", "team-t", "tnodes", -1)
    validate(b.text)
    for job, index in (("trainer", None), ("trainer-workers", 0)):
        p = run_trainer_script(b, job, tmp_path / job, index)
        assert p.returncode == 3 and not p.stdout, (job, p.stdout)
        assert "OPSD_TRAINER_WORKER_NODES=-1 (ConfigMap opsd-run): expected a whole number >= 0" in p.stderr


# --- one run, one parameter set ----------------------------------------------------------------


def test_two_runs_in_two_namespaces_render_apart(tmp_path):
    """Two runs from the README's run parameters: every object of each lives in its namespace, and nothing
    (Redis address, KEDA's addresses and streams, selectors, Service names, volumes) names the other run or
    the defaults (namespace opsd, run quickstart); both validate, custom resources against their CRDs' schemas."""
    runs = {"team-kestrel": ("kestrel7", 0), "team-osprey": ("osprey9", 2)}  # names no other text contains
    builds = {ns: run_copy(tmp_path / ns, ns, name, nodes) for ns, (name, nodes) in runs.items()}
    allowed_namespaces = {"kube-system", "monitoring", "keda"}  # DNS, Prometheus, the KEDA operator
    for ns, b in builds.items():
        name, nodes = runs[ns]
        other_ns, (other_name, _) = next((n, r) for n, r in runs.items() if n != ns)
        validate(b.text)
        problems, custom = check(b.docs)  # the custom resources (KEDA's, the PodMonitors) against their pinned CRDs
        assert not problems and custom >= 4, problems
        assert [d["metadata"]["name"] for d in b.of("Namespace")] == [ns]
        for d in b.docs:
            if d["kind"] not in CLUSTER_SCOPED:
                assert d["metadata"]["namespace"] == ns, (d["kind"], d["metadata"]["name"])
        # No text of the run names the other one or the defaults (the run config is a user's file: its own).
        for d in b.docs:
            if d["metadata"]["name"] != b.generated("opsd-config")["metadata"]["name"]:
                text = yaml.safe_dump(d)
                for word in (other_ns, other_name, "quickstart", ".opsd.svc", "redis.opsd"):
                    assert word not in text, (ns, d["kind"], d["metadata"]["name"], word)
        address = f"redis.{ns}.svc:6379"
        assert b.generated("opsd-redis")["data"]["address"] == address
        run_dir = run_dir_of(b, "rollout")
        assert {run_dir_of(b, role) for role in ROLES + ("trainer-workers",)} == {f"/data/runs/{name}"}
        names = StreamNames(derived_prefix(b, tmp_path / ns, run_dir))  # what the roles derive from it
        for s in b.of("ScaledObject"):
            by_type = triggers(s)
            assert {t["metadata"]["address"] for t in by_type.values()} == {address}
            assert by_type["redis-streams"]["metadata"]["stream"] == getattr(names, SCALED[s["metadata"]["name"]])
            assert by_type["redis"]["metadata"]["listName"] == f"{names.prefix}:active"
        assert b.role("trainer-workers")["spec"]["completions"] == nodes
        assert b.get("PodDisruptionBudget", "trainer-workers")["spec"]["minAvailable"] == nodes
        # Selectors: pods of this namespace, or the few cluster services by namespace name.
        for p in b.of("NetworkPolicy"):
            for rule in p["spec"].get("ingress", []) + p["spec"].get("egress", []):
                for peer in rule.get("from", []) + rule.get("to", []):
                    if "namespaceSelector" in peer:
                        (value,) = peer["namespaceSelector"]["matchLabels"].values()
                        assert value in allowed_namespaces, (p["metadata"]["name"], value)
        # Service names in the pods' settings are relative (resolved in the pod's own namespace); only the
        # Redis address, which the KEDA operator resolves from its namespace, names one: this run's.
        claims = b.names("PersistentVolumeClaim")
        for w in b.workloads():
            spec = pod_spec(w)
            assert spec.get("serviceAccountName", "default") == "default", w["metadata"]["name"]
            for c in spec["containers"] + spec.get("initContainers", []):
                for key, value in b.env(c).items():
                    assert ".svc" not in value or value == address, (w["metadata"]["name"], key, value)
            for v in spec["volumes"]:
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"]["claimName"] in claims
    ids = [{(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in b.docs} for b in builds.values()]
    assert not ids[0] & ids[1], "two runs share an object"


# --- options: scheduling, models in ------------------------------------------------------------


def with_option(tmp_path: Path, option: str, overlay: str = "gpu") -> Build:
    """The overlay with one more components line, as k8s/README.md says to add it."""
    line = f"../../components/{option}"
    assert line in (K8S / "README.md").read_text() and f"#   - {line}" in (K8S / "overlays/gpu/kustomization.yaml").read_text()
    return overlay_copy(tmp_path, overlay, add={"components": [os.path.relpath(K8S / "components" / option, tmp_path)]})


@pytest.mark.parametrize("option", ["runtime-class", "gpu-model", "priority"])
def test_the_scheduling_options(option, tmp_path):
    b = with_option(tmp_path, option)
    validate(b.text)
    field, value = {"runtime-class": ("runtimeClassName", "nvidia"),
                    "gpu-model": ("nodeSelector", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
                    "priority": ("priorityClassName", "opsd-run")}[option]
    for w in b.workloads():
        # Every pod of the run gets its priority; the GPU settings go to the GPU roles' pods only.
        wanted = option == "priority" or w["metadata"]["name"] in GPU_ROLES
        assert pod_spec(w).get(field) == (value if wanted else None), (option, w["metadata"]["name"])
    if option == "priority":  # cluster-wide, applied once apart from any run: not in the build
        assert not b.of("PriorityClass")
        text = (K8S / "components" / "priority" / "priorityclass.yaml").read_text()
        validate(text)
        pc = yaml.safe_load(text)
        assert (pc["kind"], pc["metadata"]["name"], pc["globalDefault"]) == ("PriorityClass", value, False)
        assert 0 < pc["value"] < 1_000_000_000  # above the default, below the system's classes


def test_the_readme_embedder_gpu_patch(tmp_path):
    """k8s/README.md, "The embedder on a GPU": one patch gives it a GPU and lets it on the GPU nodes."""
    b = overlay_copy(tmp_path, "gpu", add=readme_block("The embedder on a GPU"))
    validate(b.text)
    w = b.role("embedder")
    assert int(container(w)["resources"]["limits"][GPU]) == 1
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod_spec(w)["tolerations"]


def test_the_model_fetch_option(tmp_path):
    """Job model-fetch: `opsd prepare` online into the HF cache the roles mount read-only, the optional token,
    HTTPS egress for it alone; the trainer's pods wait for the model offline."""
    b = with_option(tmp_path, "model-fetch")
    validate(b.text)
    job = b.get("Job", "model-fetch")
    c = container(job)
    assert c["command"] == ["opsd", "prepare", "/etc/opsd/run.yaml"]
    assert importlib.util.find_spec("opsd.cli") is not None
    env = b.env(c)
    assert env["HF_HOME"] == "/models/hf" and env["HF_HUB_OFFLINE"] == "0"
    (token,) = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": "hf-token", "optional": True}
    assert mount(job, "/models")["persistentVolumeClaim"] == {"claimName": "opsd-models"}
    assert not [m for m in c["volumeMounts"] if m["mountPath"] == "/models" and m.get("readOnly")]
    for role in GPU_ROLES:  # the roles: the same cache, read-only, never downloading
        w = b.role(role)
        assert mount(w, "/models")["persistentVolumeClaim"] == {"claimName": "opsd-models", "readOnly": True}
        assert b.env(container(w))["HF_HUB_OFFLINE"] == "1" and b.env(container(w))["HF_HOME"] == "/models/hf"
        inits = pod_spec(w).get("initContainers", [])
        assert [i["name"] for i in inits] == (["wait-for-model"] if role in TRAINER_JOBS else []), role
        for i in inits:
            assert i["image"] == container(w)["image"] and b.env(i)["HF_HUB_OFFLINE"] == "1"
    policies = b.of("NetworkPolicy")
    fetch = Pod(NAMESPACE, pod_labels(job))
    for host in INTERNET[:2]:  # a public address, v4 and v6
        assert flow_allowed(policies, fetch, host, 443), host.ip
        assert not flow_allowed(policies, fetch, host, 80) and not flow_allowed(policies, host, fetch, 443)
    for private in PRIVATE_IPS:
        assert not flow_allowed(policies, fetch, Pod(None, {}, ip=private), 443), private
    assert flow_allowed(policies, fetch, Pod("kube-system", {"k8s-app": "kube-dns"}), 53, "UDP")
    for role in ROLES + ("trainer-workers",):  # nobody else leaves the cluster
        src = Pod(NAMESPACE, pod_labels(b.role(role)))
        assert not any(flow_allowed(policies, src, host, 443) for host in INTERNET), role


def test_the_wait_for_model_script_waits_for_a_complete_snapshot_and_writes_nothing_to_the_cache(tmp_path):
    """The trainer pods' init container (component model-fetch), run under /bin/sh with the pod's settings: it
    loops, saying why, while the HF cache lacks the model, and exits 0 once the snapshot is there, leaving
    the cache as it was (the roles mount it read-only)."""
    from opsd.config import ModelSection
    from opsd.models.hf import ensure_model
    from tests.hub_cache import cache_model

    (init,) = pod_spec(with_option(tmp_path / "build", "model-fetch").role("trainer"))["initContainers"]
    script = init["args"][0]
    assert init["command"] == ["sh", "-c"] and script.count("/etc/opsd/run.yaml") == 1
    model_id, commit = "opsd-test/k8s-tiny", "0123456789abcdef0123456789abcdef01234567"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": model_id, "revision": commit}, "env": {"game_pool": 2}}))
    hf_home = tmp_path / "models" / "hf"
    hf_home.mkdir(parents=True)
    pod_env = Build(kustomize("k8s/overlays/gpu")).generated("opsd-env")["data"]
    assert pod_env["HF_HOME"] == "/models/hf" and pod_env["HF_HUB_OFFLINE"] == "1"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "OPSD_", "TRANSFORMERS_"))}
    env.update(pod_env, HF_HOME=str(hf_home), OPSD_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path),
               HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # `opsd`, the console script
    command = ["/bin/sh", "-c", script.replace("/etc/opsd/run.yaml", str(config))]
    waiting = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    watchdog = threading.Timer(300, os.killpg, (waiting.pid, signal.SIGKILL))  # a hang fails, never blocks
    watchdog.start()
    try:
        lines = []
        for line in waiting.stdout:  # the first attempt's refusal, then the loop's own line
            lines.append(line)
            if "waiting for Job model-fetch" in line:
                break
        assert waiting.poll() is None, "".join(lines)
        out = "".join(lines)
        assert f"'{model_id}' revision '{commit}' is not available: HF_HUB_OFFLINE is set" in out, out
    finally:
        watchdog.cancel()
        os.killpg(waiting.pid, signal.SIGKILL)
        waiting.wait()

    cache_model(hf_home, model_id, ensure_model(ModelSection(name="tiny-random")), commit, refs=("main",))

    def tree() -> dict[str, tuple[int, int]]:
        return {str(f.relative_to(hf_home)): (f.lstat().st_size, f.lstat().st_mtime_ns) for f in hf_home.rglob("*")}

    before = tree()
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model {model_id} revision {commit}: commit {commit}" in done.stdout, done.stdout
    assert "waiting for Job model-fetch" not in done.stdout
    assert tree() == before, "the roles' cache is read-only: nothing may be written there"


# --- options: experiment trackers --------------------------------------------------------------

TRACKERS_SECRET = "opsd-trackers"  # created by the user (k8s/README.md, "Experiment trackers"), never in the repo
TRACKERS_POLICY = "trainer-trackers-egress"


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_the_trackers_option_gives_rank_0_alone_its_secret_and_https_out(overlay, tmp_path):
    """k8s/components/trackers: Job trainer (rank 0, the trackers' one writer) gets the optional Secret
    opsd-trackers and HTTPS egress to public addresses; nothing else of the overlay changes."""
    b = with_option(tmp_path, "trackers", overlay)
    validate(b.text)
    shipped = Build(kustomize(f"k8s/overlays/{overlay}"))
    changed = sorted((d["kind"], d["metadata"]["name"]) for d in b.docs if d not in shipped.docs)
    assert changed == [("Job", "trainer"), ("NetworkPolicy", TRACKERS_POLICY)] and len(b.docs) == len(shipped.docs) + 1
    assert not b.of("Secret")

    # The Secret: optional (the Job starts without it), first in envFrom so that the run's ConfigMaps win on a
    # name clash (Kubernetes: a later source wins); the Job is otherwise the shipped one.
    rank0 = copy.deepcopy(b.role("trainer"))
    env_from = container(rank0)["envFrom"]
    assert env_from[0] == {"secretRef": {"name": TRACKERS_SECRET, "optional": True}}, env_from
    container(rank0)["envFrom"] = env_from[1:]
    assert rank0 == shipped.role("trainer")
    refer = [(w["kind"], w["metadata"]["name"]) for w in b.workloads() if TRACKERS_SECRET in yaml.safe_dump(w)]
    assert refer == [("Job", "trainer")], refer  # not trainer-workers (ranks > 0 write to no tracker), not the roles

    # The policy: egress only, selecting exactly rank 0's pods, port 443, the ranges model-fetch-egress allows.
    policy = b.get("NetworkPolicy", TRACKERS_POLICY)
    assert policy["spec"]["policyTypes"] == ["Egress"] and "ingress" not in policy["spec"]
    selected = [(w["kind"], w["metadata"]["name"]) for w in b.workloads()
                if selects(policy["spec"]["podSelector"], pod_labels(w))]
    assert selected == [("Job", "trainer")], selected
    (rule,) = policy["spec"]["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 443}]
    model_fetch = yaml.safe_load((K8S / "components" / "model-fetch" / "networkpolicy.yaml").read_text())
    assert rule["to"] == model_fetch["spec"]["egress"][0]["to"]

    policies = b.of("NetworkPolicy")
    trainer = Pod(NAMESPACE, pod_labels(b.role("trainer")), {"http": 8000})
    for host in INTERNET[:2]:  # a public address, v4 and v6
        assert flow_allowed(policies, trainer, host, 443), host.ip
        assert not flow_allowed(policies, trainer, host, 80) and not flow_allowed(policies, trainer, host, 5000)
        assert not flow_allowed(policies, host, trainer, 443) and not flow_allowed(policies, host, trainer, 8000)
    for private in PRIVATE_IPS:
        assert not flow_allowed(policies, trainer, Pod(None, {}, ip=private), 443), private
    assert not flow_allowed(policies, trainer, Pod("default", {"app": "website"}), 443), "a pod elsewhere"
    redis = b.get("Deployment", "redis")
    assert flow_allowed(policies, trainer, Pod(NAMESPACE, pod_labels(redis), {"redis": 6379}), 6379)
    for role in ("embedder", "rollout", "teacher", "trainer-workers"):  # nobody else leaves the cluster
        src = Pod(NAMESPACE, pod_labels(b.role(role)))
        assert not any(flow_allowed(policies, src, host, 443) for host in INTERNET), role


def test_the_readme_trackers_section_matches_the_component_and_the_image():
    """k8s/README.md, "Experiment trackers": the component line, the image's build argument (an extra that
    exists), the Secret's name and keys the trackers read (docs/trackers.md), and what ran here."""
    section = readme_section("Experiment trackers")
    for needle in ("- ../../components/trackers", "--build-arg OPSD_EXTRAS=trackers", "run.report_to",
                   TRACKERS_POLICY, "What ran here", "Never run here", "HTTPS_PROXY", "WANDB_MODE=offline"):
        assert needle in section, needle
    assert "ARG OPSD_EXTRAS" in (ROOT / "services" / "trainer" / "Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "trackers" in extras
    (name,) = set(re.findall(r"create secret generic (\S+)", section))
    assert name == TRACKERS_SECRET
    keys = set(re.findall(r"--from-literal=(\w+)=", section)) | set(re.findall(r"`(MLFLOW_\w+|WANDB_\w+)", section))
    tracker_docs = (ROOT / "docs" / "trackers.md").read_text()
    assert {"WANDB_API_KEY", "MLFLOW_TRACKING_URI"} <= keys
    for key in keys - {"MLFLOW_TRACKING_PASSWORD"}:  # the docs write it USERNAME / PASSWORD
        assert f"`{key}`" in tracker_docs, key


def test_the_readme_in_cluster_mlflow_patch_admits_the_server_alone(tmp_path):
    """The README's patch for an MLflow server in the cluster: rank 0 reaches that server's pods on the port of
    the tracking URI the README puts in the Secret, and no longer the internet; nobody else reaches it."""
    fragment = readme_block("Experiment trackers")
    assert set(fragment) == {"patches"}
    component = os.path.relpath(K8S / "components" / "trackers", tmp_path)
    b = overlay_copy(tmp_path, "gpu", add={"components": [component], **fragment})
    validate(b.text)
    (uri,) = re.findall(r"MLFLOW_TRACKING_URI=(http://[^`\s]+)", readme_section("Experiment trackers"))
    url = urllib.parse.urlsplit(uri)
    service, namespace = url.hostname.split(".")[:2]  # <service>.<namespace>.svc
    server = Pod(namespace, {"app.kubernetes.io/name": service})
    policies = b.of("NetworkPolicy")
    trainer = Pod(NAMESPACE, pod_labels(b.role("trainer")))
    assert flow_allowed(policies, trainer, server, url.port)
    assert not flow_allowed(policies, trainer, server, 443)
    assert not flow_allowed(policies, trainer, Pod("default", server.labels), url.port), "the same labels elsewhere"
    for host in INTERNET:
        assert not flow_allowed(policies, trainer, host, 443), host.ip
    for role in ("embedder", "rollout", "teacher", "trainer-workers"):
        assert not flow_allowed(policies, Pod(NAMESPACE, pod_labels(b.role(role))), server, url.port), role
