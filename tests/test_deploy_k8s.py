"""Offline checks of k8s/: every kustomize build validates, and says what the roles need.

`kubectl kustomize` builds each overlay (and the base); `kubernetes-validate` checks the
core kinds against the bundled Kubernetes schemas (strict: unknown fields fail). It has no
schema for the CRDs (KEDA ScaledObject/TriggerAuthentication, the Prometheus Operator's
PodMonitor), so the tests below check their required fields and that they point at objects
the same build contains. NetworkPolicies are checked by evaluating the flows the roles need
(and some they must not get) against them.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from opsd.config import RunConfig
from opsd.queue import StreamNames
from tests.deploy_tools import BAD_REDIS_PASSWORDS, GOOD_REDIS_PASSWORD, ROOT, run_redis_start_script, run_tool, tool

K8S = ROOT / "k8s"
BUILDS = ("base", "overlays/cpu-demo", "overlays/gpu")
OVERLAYS = ("overlays/cpu-demo", "overlays/gpu")
K8S_VERSION = "1.34.0"  # a recent release that kubernetes-validate 1.37 bundles
CRD_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "TriggerAuthentication": "keda.sh/v1alpha1",
             "PodMonitor": "monitoring.coreos.com/v1"}
NAMESPACE = "opsd"
ROLES = ("embedder", "rollout", "teacher", "trainer")
SCALED = {"rollout": "tasks", "teacher": "rollouts"}  # role -> the StreamNames attribute of its input
REDIS_USERS = ("rollout", "teacher", "trainer")  # the embedder never talks to Redis
TOKEN_USERS = ("embedder", "teacher", "rollout")  # the embedder requires it; /correspond and Search's /retrieve send it
EMBEDDER_CLIENTS = ("teacher", "rollout")
WORKERS = ("rollout", "teacher", "trainer")  # a SIGTERM lets them finish a job: long grace period
SECRET = "opsd-secrets"  # created by the user (k8s/README.md), never in the repo
SECRET_KEYS = {"redis-password", "api-token"}
GPU = "nvidia.com/gpu"
CLUSTER_SCOPED = {"Namespace"}
# The components that need CRDs: an overlay without them must still build (k8s/README.md).
CRD_COMPONENTS = ("../../components/keda", "../../components/monitoring")

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
        return self.of("Deployment") + self.of("StatefulSet")

    def role(self, role: str) -> dict:
        kind = "StatefulSet" if role == "trainer" else "Deployment"
        w = self.get(kind, role)
        assert w is not None, f"no {kind} {role}"
        return w

    def env(self, container: dict) -> dict[str, str]:
        """A container's environment as Kubernetes would set it (Secret values as <secret:NAME/KEY>, downward API
        resource values as <resource:NAME>)."""
        env: dict[str, str] = {}
        for src in container.get("envFrom", []):
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


def test_the_base_run_config_is_the_quickstart_with_an_explicit_stream_prefix():
    ours = yaml.safe_load((K8S / "base" / "run.yaml").read_text())
    quickstart = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    prefix = ours["redis"].pop("stream_prefix")
    if not ours["redis"]:
        del ours["redis"]
    assert ours == quickstart
    # The prefix a role would derive from its run dir (opsd/service.py), written out for KEDA.
    assert prefix == "opsd:quickstart"
    assert RunConfig.load(K8S / "base" / "run.yaml").redis.stream_prefix == prefix


def run_config(build: Build, tmp_path: Path) -> RunConfig:
    """The run config the build mounts into every role (ConfigMap opsd-config)."""
    config = tmp_path / "run.yaml"
    config.write_text(build.generated("opsd-config")["data"]["run.yaml"])
    return RunConfig.load(config)


def test_keda_scales_on_the_streams_of_the_run_config(build, tmp_path):
    cfg = run_config(build, tmp_path)
    assert cfg.redis.stream_prefix, "the deployed config must name its stream prefix (KEDA needs it)"
    names = StreamNames(cfg.redis.stream_prefix)
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
        assert spec["minReplicaCount"] == 1 and spec["maxReplicaCount"] >= 1 and spec["cooldownPeriod"] > 0
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["stream"] == getattr(names, SCALED[role])
        # No consumerGroup: KEDA reads XLEN, the backlog (waiting + in flight) whatever the ack order
        # (tests/test_keda_backlog.py); one pod's share is the groups it holds at once.
        assert "consumerGroup" not in meta and "lagCount" not in meta
        assert meta["streamLength"] == str(cfg.groups_in_flight(role))
        # Activation only decides 0 <-> 1 pods (minReplicaCount is 1); "0" or "1" (kedacore/keda#6478).
        assert meta["activationLagCount"] in ("0", "1")
        assert re.fullmatch(r"[\w.-]+:\d+", meta["address"]), meta["address"]
        auth = build.get("TriggerAuthentication", trigger["authenticationRef"]["name"])
        assert auth is not None and auth["apiVersion"] == CRD_KINDS["TriggerAuthentication"]
        refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
        assert refs["password"] == (SECRET, "redis-password")
    # The roles read that same config file, and the run dir the prefix names.
    for role in ROLES:
        w = build.role(role)
        args = container(w)["args"]
        config_path = Path(args[args.index("--config") + 1])
        volume = mount(w, str(config_path.parent))
        assert volume["configMap"]["name"] == build.generated("opsd-config")["metadata"]["name"]
        assert config_path.name in build.generated("opsd-config")["data"]
        run_dir = Path(args[args.index("--run-dir") + 1])
        assert run_dir.is_relative_to("/data") and f"opsd:{run_dir.name}" == cfg.redis.stream_prefix


def test_keda_scale_out_is_reachable(build, tmp_path):
    """KEDA wants ceil(XLEN / streamLength) pods; the backlog never exceeds what the trainer issues at once.

    The trainer keeps the tasks of steps [n, n + max_staleness] issued, env.num_games groups a step
    (services/trainer/controller.py), and each task becomes one rollout group: that is the most
    entries either stream can hold undelivered. Below 2 pods' worth, KEDA could never scale out.
    """
    cfg = run_config(build, tmp_path)
    max_lag = cfg.env.num_games * (cfg.run.max_staleness + 1)
    for s in build.of("ScaledObject"):
        per_pod = int(s["spec"]["triggers"][0]["metadata"]["streamLength"])
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
        meta = s["spec"]["triggers"][0]["metadata"]
        assert meta["address"] == data["address"], s["metadata"]["name"]
        assert meta["enableTLS"] == data["tls"], s["metadata"]["name"]
    service = build.get("Service", "redis")
    if service is not None:  # in-cluster Redis: a name the KEDA operator (another namespace) resolves too
        port = service["spec"]["ports"][0]["port"]
        assert data["address"] == f"redis.{service['metadata']['namespace']}.svc:{port}"
    for role in REDIS_USERS:
        env = build.env(container(build.role(role)))
        assert env["REDIS_ADDRESS"] == data["address"] and env["REDIS_SCHEME"] == data["scheme"]
        assert env["REDIS_PASSWORD"] == f"<secret:{SECRET}/redis-password>"
        assert env["REDIS_URL"] == "$(REDIS_SCHEME)://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0"


def readme_block(heading: str) -> dict:
    """The first ```yaml block under the k8s/README.md heading that starts with `heading`, parsed."""
    text = (K8S / "README.md").read_text()
    section = re.search(rf"^#+ (?:\d+\. )?{re.escape(heading)}.*?(?=^#+ |\Z)", text, re.M | re.S)
    assert section, f"k8s/README.md: no section {heading!r}"
    block = re.search(r"^```yaml\n(.*?)^```", section.group(0), re.M | re.S)
    assert block, f"k8s/README.md, {heading!r}: no yaml block"
    return yaml.safe_load(block.group(1))


def overlay_copy(tmp_path: Path, overlay: str = "gpu", drop: tuple[str, ...] = (), add: dict | None = None) -> Build:
    """Build a copy of an overlay with component lines deleted and README fragments appended (as a user would)."""
    source = K8S / "overlays" / overlay
    lines = (source / "kustomization.yaml").read_text().splitlines()
    kept = [line for line in lines if line.strip().removeprefix("- ") not in drop]
    assert len(lines) - len(kept) == len(drop), f"not every line of {drop} is in the overlay"
    k = yaml.safe_load("\n".join(kept))
    k["resources"] = [os.path.relpath((source / r).resolve(), tmp_path) for r in k["resources"]]
    k["components"] = [os.path.relpath((source / c).resolve(), tmp_path) for c in k.get("components", [])]
    for key, value in (add or {}).items():
        k[key] = k.get(key, []) + value  # the README's entries go after the overlay's own
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
    assert [s["spec"]["triggers"][0]["metadata"]["address"] for s in b.of("ScaledObject")] == [address] * len(SCALED)
    assert {s["spec"]["triggers"][0]["metadata"]["enableTLS"] for s in b.of("ScaledObject")} == {literals["tls"]}
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


@pytest.mark.parametrize("role", ROLES)
def test_each_role_runs_its_module_with_probes_env_and_service(build, role):
    w = build.role(role)
    labels = {"app.kubernetes.io/name": role, "app.kubernetes.io/component": role, "app.kubernetes.io/part-of": "opsd"}
    assert w["metadata"]["labels"] == labels and pod_labels(w) == labels
    assert selects(w["spec"]["selector"], pod_labels(w))
    c = container(w)
    assert c["command"] == ["python", "-m", f"services.{role}"]
    assert importlib.util.find_spec(f"services.{role}.__main__") is not None
    assert {"name": "http", "containerPort": 8000} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading takes minutes"
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
    if role == "trainer":
        assert w["spec"]["replicas"] == 1 and w["spec"]["serviceName"] == "trainer"
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
    for role in ROLES:
        w = b.role(role)
        assert int(container(w)["resources"]["limits"][GPU]) == 1, role
        if path == "overlays/gpu":
            assert container(w)["image"] == f"ghcr.io/opsd-project/opsd-{role}:0.1.0-cuda"
            assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod_spec(w)["tolerations"]
    if path == "overlays/gpu":
        # The component's own values (a Component does not build alone).
        shipped = yaml.safe_load_all((K8S / "components" / "keda" / "keda.yaml").read_text())
        base = {s["spec"]["maxReplicaCount"] for s in shipped if s["kind"] == "ScaledObject"}
        assert min(max_replicas) > max(base)
        for role in ("rollout", "teacher", "trainer"):
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
        if p.get("protocol", "TCP") == protocol and (p.get("port") is None or number == port):
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
                   "openshift-dns", "release", "reclaim_idle_ms", "num_games", "max_staleness", "model.threads"):
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
        assert not [v for v in pod_spec(w)["volumes"] if "persistentVolumeClaim" in v], role
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
