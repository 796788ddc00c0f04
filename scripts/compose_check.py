"""`make compose-check`: build the images and run the docker compose stack on a real Docker engine, then check it.

    .venv/bin/python scripts/compose_check.py [--skip-build | --build-only] [--rebuild-base] [--memory 8g] [--out DIR]
                                              [--weights file|http] [--trainer-nodes 2]

From nothing but a Debian 12 machine with Debian's archive and a package index (PyPI or a mirror) and
no image registry, as root:

 1. Docker engine: uses one that answers `docker info`; else installs Debian's docker.io (apt-get) and
    starts dockerd niced (19, idle I/O) inside a memory cgroup of `--memory` (cgroup v1) that also holds
    every container and build step (`--cgroup-parent`); that dockerd alone is stopped at the end.
 2. Base image: `debootstrap --variant=minbase bookworm` + `docker import` -> opsd-debian:bookworm.
 3. The four CPU role images, one build at a time, in mirror mode (services/<role>/Dockerfile header):
    CPU_BASE=opsd-debian:bookworm, PYTHON_SOURCE=system (Debian's python3.11, uv from the index),
    the machine's CA bundle as the BuildKit secret `ca_bundle`, the index and find-links of the
    machine's pip configuration (`pip config list`, PIP_* variables: any file:// location is left out, as
    a container cannot read it), and the machine's CPU torch 2.13.0 wheel (found in pip's find-links)
    copied into deploy/docker/wheels/. Redis and Prometheus from Debian packages
    (docker-compose.debian.yml); Grafana is not started (no image, no Debian package).
 4. The stack (`-p opsd-check`, its own env file, config and volumes; a user's `.env` and stack are not
    touched) with `--scale rollout=2`, on the quickstart's TextWorld AlignOPSD config cut small with the
    tiny random model (`check_config`), and its checks (`check_stack`): every role healthy and running as
    uid 10001; a rollout worker holding a task has its process SIGKILLed (Docker restarts it), then one is
    `docker kill`ed (Docker leaves it down: `up -d` starts it); the run reaches DONE with every group
    trained once (`python -m services.trainer.books` in the trainer container); both rollout replicas
    did work; Prometheus's targets API lists every replica up; every query of the Grafana dashboard
    returns data from Prometheus over the run, or has a reason it cannot (NO_DATA_REASONS).
    With `--weights http` the stack also gets docker-compose.http.yml: rollout and teacher fetch every policy
    version from the trainer's API and mount volumes of their own, not the trainer's; checked on their
    mounts and their logs (`check_weights_over_http`).
    With `--trainer-nodes 2` the stack gets docker-compose.multinode.yml instead of the checks above: the
    trainer as two containers ("nodes", one rank each) in one torchrun world, gloo over the compose network,
    `trainer-1` without the run volume; a run of MULTINODE_STEPS steps (`multinode_config`), checked from the
    logs, metrics.jsonl and Redis (`check_trainer_nodes`). `make compose-check` runs all three modes.
 5. `down` (no container left), `down -v` (no volume left).

Prints one table (check, pass/FAIL, seconds, detail) and writes it with every log to --out
(default runs/compose-check/<UTC time>/). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("embedder", "rollout", "teacher", "trainer")
PROJECT = "opsd-check"
BASE_IMAGE = "opsd-debian:bookworm"
RUN_NAME = "compose-check"
CONFIG_NAME = "compose-check.yaml"
WHEELS = ROOT / "deploy" / "docker" / "wheels"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PROMETHEUS = "http://127.0.0.1:9090"  # docker-compose.yml publishes it on loopback
# Grafana's $__rate_interval with Prometheus's 15 s scrape interval: max(4 x 15 s, step + 15 s) = 1 m.
TEMPLATE_VALUES = {"$__rate_interval": "1m", "$__interval": "15s", "$role": ".*", "${role}": ".*",
                   "$namespace": ".*", "${namespace}": ".*"}  # "All"; compose's series have no namespace
# Dashboard queries that cannot return data in this stack, and why (any other empty query fails the check).
NO_DATA_REASONS = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU metric of NVIDIA's dcgm-exporter (docker-compose.gpu.yml): no GPU here",
    "DCGM_FI_DEV_FB_USED": "GPU metric of NVIDIA's dcgm-exporter (docker-compose.gpu.yml): no GPU here",
    "redis_errors_total": "Redis lists an error type only once one was replied: none was in this run",
    "opsd_privileged_signal": "set once a step has turns that played the privileged hint's next command (and "
                              "others): the tiny random model played none (metrics.jsonl: hint_match_turns 0 at every step)",
    "opsd_tracker_errors_total": "labelled (at 0) once the trainer opens an experiment tracker: this run's "
                                 "run.report_to names none",
}
# A reason that can be checked against the run's metrics.jsonl records must hold there.
REASON_HOLDS = {
    "opsd_privileged_signal": lambda records: bool(records) and all(
        r.get("privileged_signal") is None and not r.get("hint_match_turns") for r in records),
    "opsd_tracker_errors_total": lambda records: not check_config().get("run", {}).get("report_to"),
}
# Memory limits of the containers (compose mem_limit), a bound on a runaway one: the first role converts the
# packaged SmolLM2 (the tiny model's tokenizer source) once. dockerd's cgroup caps their sum (--memory).
MEM_LIMITS = {"embedder": "3g", "rollout": "3g", "teacher": "3g", "trainer": "3g", "redis": "512m", "redis-exporter": "128m",
              "prometheus": "1g"}
# --trainer-nodes 2: two steps, so that the workers run a job of policy version 1 (the first one the two ranks
# trained) before DONE removes the per-version files.
MULTINODE_STEPS = 2


def check_config() -> dict:
    """The run: configs/quickstart.yaml (what compose runs by default) with the tiny model, cut small.

    Four games a step and two groups in flight per rollout worker (so each of two replicas has work, and
    the engine gauges of the dashboard have data), several steps so that a worker can be killed mid-run,
    a short reclaim time so that the killed worker's job is taken over within seconds.
    """
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["run"].update(name=RUN_NAME, steps=16, step_timeout_s=600)
    cfg["model"].update(name="tiny-random")
    cfg["env"].update(num_games=4, game_pool=8, max_turns=3, list_admissible=False, one_shot=False)
    cfg["rollout"].update(group_size=2, max_new_tokens=16, max_groups_in_flight=2)
    cfg["teacher"]["thinking_max_new_tokens"] = 8
    cfg["trainer"].update(micro_batch_size=4, threads=1, kl_coef=0.01)  # the KL to the reference: its panel has data
    cfg["redis"] = {"reclaim_idle_ms": 10_000}
    return cfg


def multinode_config() -> dict:
    """`check_config` for the two-node trainer: MULTINODE_STEPS steps of 2 games, DDP across the two containers
    (trainer.data_parallel ddp; nproc_per_node 1 = one rank per container)."""
    cfg = check_config()
    cfg["run"]["steps"] = MULTINODE_STEPS
    cfg["env"].update(num_games=2, game_pool=4)
    cfg["trainer"].update(data_parallel="ddp", nproc_per_node=1)
    return cfg


# ------------------------------------------------------------------------------------------ plumbing


@dataclass
class Row:
    check: str
    ok: bool | None  # None: information, not a check
    seconds: float
    detail: str


@dataclass
class Context:
    out: Path
    docker: str = "docker"  # any docker CLI, for everything but builds
    build_docker: str = "docker"  # a CLI that builds with BuildKit
    compose: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    redis_password: str = ""
    started_dockerd: subprocess.Popen | None = None
    weights: str = "file"  # weights.transport of the stack: http adds docker-compose.http.yml
    trainer_nodes: int = 1  # 2: docker-compose.multinode.yml, `check_trainer_nodes`
    cgroup: Path | None = None

    def add(self, check: str, ok: bool | None, seconds: float, detail: str) -> None:
        self.rows.append(Row(check, ok, seconds, detail))
        mark = {True: "pass", False: "FAIL", None: "info"}[ok]
        print(f"[compose-check] {mark}: {check} ({seconds:.0f} s) {detail}", flush=True)


def log(msg: str) -> None:
    print(f"[compose-check] {msg}", flush=True)


def run(args: list[str], *, log_to: Path | None = None, check: bool = True, timeout: float = 3600,
        env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to `log_to` (appended) when given, else is returned."""
    if log_to is not None:
        with open(log_to, "a") as f:
            f.write(f"\n$ {' '.join(args)}\n")
            f.flush()
            p = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                               env=env, input=input)
    else:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, input=input)
    if check and p.returncode != 0:
        where = f"see {log_to}" if log_to else (p.stderr or p.stdout)[-3000:]
        raise RuntimeError(f"{' '.join(args[:4])} ... exited {p.returncode}: {where}")
    return p


def wait_for(what: str, predicate, timeout: float, poll: float = 2.0):
    """Poll `predicate` until it returns a true value (returned); RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def apt_install(ctx: Context, *packages: str) -> None:
    log(f"apt-get install {' '.join(packages)}")
    run(["apt-get", "update", "-q"], log_to=ctx.out / "apt.log")
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], log_to=ctx.out / "apt.log",
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


# ------------------------------------------------------------------------------------------ engine


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)b?", text.strip().lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 8g, 512m)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def memory_cgroup(name: str, limit: int) -> tuple[Path, str] | None:
    """A cgroup-v1 memory cgroup `name` under this process's own, limited to `limit` bytes: (its directory,
    its path for dockerd's --cgroup-parent). None on cgroup v2 or without a writable memory controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own = next((line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory"), None)
    base = Path("/sys/fs/cgroup/memory")
    if own is None or not base.is_dir():
        return None
    rel = f"{own.rstrip('/')}/{name}"
    path = base / rel.lstrip("/")
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        return None
    return path, rel


def docker_answers(docker: str) -> bool:
    return subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0


def build_cli(candidates: list[str]) -> str | None:
    """A docker CLI that builds with BuildKit: one with the buildx plugin, or a pre-23 one (BuildKit built in)."""
    for docker in candidates:
        if not docker or not Path(docker).exists():
            continue
        if subprocess.run([docker, "buildx", "version"], capture_output=True).returncode == 0:
            return docker
        p = subprocess.run([docker, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True)
        major = re.match(r"(\d+)\.", p.stdout.strip())
        if major and int(major.group(1)) < 23:
            return docker
    return None


def ensure_engine(ctx: Context, memory: int) -> None:
    t0 = time.monotonic()
    if not shutil.which("dockerd") and not Path("/usr/sbin/dockerd").exists():
        apt_install(ctx, "docker.io")
    ctx.docker = shutil.which("docker") or "/usr/bin/docker"
    if docker_answers(ctx.docker):
        how = "found running (left running)"
    else:
        cg = memory_cgroup("opsd-compose-check", memory)
        args = ["nice", "-n", "19", "ionice", "-c3", "dockerd", "--pidfile", str(ctx.out / "dockerd.pid")]
        if cg:
            ctx.cgroup = cg[0]
            args += [f"--cgroup-parent={cg[1]}"]
        log(f"starting {' '.join(args)}")
        logf = open(ctx.out / "dockerd.log", "w")

        def into_cgroup() -> None:  # dockerd, containerd and every shim inherit it
            os.setsid()
            if cg:
                (cg[0] / "cgroup.procs").write_text(str(os.getpid()))

        ctx.started_dockerd = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=into_cgroup)
        wait_for("dockerd to answer", lambda: docker_answers(ctx.docker), 120)
        how = f"started (pid {ctx.started_dockerd.pid}, nice 19, memory cgroup {cg[1] + ' ' + str(memory >> 20) + ' MiB' if cg else 'none'})"
    ctx.build_docker = build_cli([ctx.docker, "/usr/bin/docker"]) or ""
    if not ctx.build_docker:
        raise RuntimeError("no docker CLI that builds with BuildKit (install the buildx plugin, or Debian's docker.io)")
    version = run([ctx.docker, "version", "--format", "{{.Server.Version}}"]).stdout.strip()
    ctx.add("Docker engine", None, time.monotonic() - t0, f"{version}, {how}; builds with {ctx.build_docker}")


def compose_cli(ctx: Context) -> list[str]:
    if subprocess.run([ctx.docker, "compose", "version"], capture_output=True).returncode == 0:
        return [ctx.docker, "compose"]
    if not shutil.which("docker-compose"):
        apt_install(ctx, "docker-compose")
    return ["docker-compose"]


def stop_engine(ctx: Context) -> None:
    p = ctx.started_dockerd
    if p is None or p.poll() is not None:
        return
    log(f"stopping the dockerd this check started (pid {p.pid})")
    os.kill(p.pid, signal.SIGTERM)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    if ctx.cgroup is not None:  # with what dockerd left in it (BuildKit's empty buildkit/), deepest first
        for path in sorted((d for d in ctx.cgroup.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)) + [ctx.cgroup]:
            try:
                path.rmdir()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------ images


def image_exists(ctx: Context, image: str) -> bool:
    return subprocess.run([ctx.docker, "image", "inspect", image], capture_output=True).returncode == 0


def image_size(ctx: Context, image: str) -> str:
    size = int(run([ctx.docker, "image", "inspect", "-f", "{{.Size}}", image]).stdout.strip())
    return f"{size / 1e9:.2f} GB"


def base_image(ctx: Context, rebuild: bool) -> None:
    t0 = time.monotonic()
    if image_exists(ctx, BASE_IMAGE) and not rebuild:
        ctx.add(f"base image {BASE_IMAGE}", None, 0, "present (--rebuild-base to make it again)")
        return
    if not shutil.which("debootstrap"):
        apt_install(ctx, "debootstrap")
    rootfs = ctx.out / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    run(["nice", "-n", "19", "debootstrap", "--variant=minbase", "--include=ca-certificates", "bookworm", str(rootfs),
         DEBIAN_MIRROR], log_to=ctx.out / "debootstrap.log", timeout=1800)
    # debootstrap writes `bookworm main` only: add the point-release updates and security, as debian:12 has.
    (rootfs / "etc/apt/sources.list").write_text(
        f"deb {DEBIAN_MIRROR} bookworm main\ndeb {DEBIAN_MIRROR} bookworm-updates main\n"
        "deb http://deb.debian.org/debian-security bookworm-security main\n")
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run([ctx.docker, "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    ctx.add(f"base image {BASE_IMAGE}", True, time.monotonic() - t0,
            f"debootstrap minbase + docker import, {image_size(ctx, BASE_IMAGE)}")


def pip_settings() -> dict[str, str]:
    """This machine's pip settings (`pip config list` and PIP_* variables): index-url, extra-index-url,
    find-links, cert. Values are as pip has them (space-separated lists)."""
    out: dict[str, str] = {}
    pip = [sys.executable, "-m", "pip"]
    p = subprocess.run([*pip, "config", "list"], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        out[name] = value.strip().strip("'\"")
    for name in ("index-url", "extra-index-url", "find-links", "cert"):
        env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if env:
            out[name] = env
    return out


def cpu_torch_wheel(settings: dict[str, str]) -> Path | None:
    """The CPU torch 2.13.0 wheel in one of pip's local find-links directories, if any."""
    for location in settings.get("find-links", "").split():
        folder = Path(location.removeprefix("file://"))
        for wheel in sorted(glob.glob(str(folder / "torch-2.13.0+cpu-cp311-*.whl"))):
            return Path(wheel)
    return None


def build_args(settings: dict[str, str]) -> list[str]:
    """--build-arg/--secret for a mirror build from this machine's pip settings (remote locations only)."""
    def remote(values: str) -> str:
        return " ".join(v for v in values.split() if not v.startswith(("file:", "/")))

    args = ["--build-arg", f"CPU_BASE={BASE_IMAGE}", "--build-arg", "PYTHON_SOURCE=system"]
    if remote(settings.get("index-url", "")):
        args += ["--build-arg", f"INDEX_URL={remote(settings['index-url'])}"]
    if remote(settings.get("extra-index-url", "")):
        args += ["--build-arg", f"EXTRA_INDEX_URL={remote(settings['extra-index-url'])}"]
    if remote(settings.get("find-links", "")):
        args += ["--build-arg", f"FIND_LINKS={remote(settings['find-links'])}"]
    bundle = settings.get("cert") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(bundle).is_file():
        args += ["--secret", f"id=ca_bundle,src={bundle}"]
    return args


def build_images(ctx: Context) -> None:
    settings = pip_settings()
    wheel = cpu_torch_wheel(settings)
    if wheel is not None:
        target = WHEELS / wheel.name
        if not target.exists():
            shutil.copy(wheel, target)
        torch_from = f"{wheel} (copied into deploy/docker/wheels/)"
    else:
        torch_from = "the PyTorch CPU index (no local CPU wheel in pip's find-links)"
    args = build_args(settings)
    log(f"CPU torch from {torch_from}; build args: {' '.join(args)}")
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    for role in ROLES:
        t0 = time.monotonic()
        image = f"opsd-{role}:0.1.0"
        run([ctx.build_docker, "build", "--progress=plain", "-f", f"services/{role}/Dockerfile", *args, "-t", image, "."],
            log_to=ctx.out / f"build-{role}.log", env=env, timeout=5400)
        ctx.add(f"build {image}", True, time.monotonic() - t0, image_size(ctx, image) + (f"; torch from {torch_from}" if role == ROLES[0] else ""))
    # The images the new ones replaced (same tag), and nothing else: dangling ones with our label.
    run([ctx.docker, "image", "prune", "-f", "--filter", "label=org.opencontainers.image.version=0.1.0"], check=False)
    t0 = time.monotonic()
    run([*ctx.compose, "build", "redis", "redis-exporter", "prometheus"], log_to=ctx.out / "build-debian.log",
        timeout=1800, env={**os.environ, "OPSD_DEBIAN_BASE": BASE_IMAGE})
    ctx.add("build redis, redis-exporter, prometheus (Debian packages)", True, time.monotonic() - t0,
            f"opsd-redis-debian:7.0 {image_size(ctx, 'opsd-redis-debian:7.0')}, "
            f"opsd-redis-exporter-debian:1.45 {image_size(ctx, 'opsd-redis-exporter-debian:1.45')}, "
            f"opsd-prometheus-debian:2.42 {image_size(ctx, 'opsd-prometheus-debian:2.42')}; Grafana: not built "
            "(no image without a registry, no Debian package)")


# ------------------------------------------------------------------------------------------ the stack


def write_stack_files(ctx: Context) -> None:
    """The env file (fresh secrets), the run's config and an override: configs mounted from there, memory limits."""
    configs = ctx.out / "configs"
    configs.mkdir(exist_ok=True)
    cfg = multinode_config() if ctx.trainer_nodes == 2 else check_config()
    (configs / CONFIG_NAME).write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = ctx.out / "compose.env"
    ctx.redis_password = secrets.token_urlsafe(32)
    env.write_text("".join(f"{k}={v}\n" for k, v in {
        "REDIS_PASSWORD": ctx.redis_password, "OPSD_API_TOKEN": secrets.token_urlsafe(32),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(32), "OPSD_CONFIG": CONFIG_NAME, "OPSD_RUN": RUN_NAME,
        "OPSD_DEBIAN_BASE": BASE_IMAGE,
        # Redis's maxmemory is 3/4 of this (docker-compose.yml): the same limit as its mem_limit below.
        "OPSD_REDIS_MEMORY_MB": str(parse_size(MEM_LIMITS["redis"]) >> 20)}.items()))
    env.chmod(0o600)
    limits = {**MEM_LIMITS, "trainer-1": MEM_LIMITS["trainer"]} if ctx.trainer_nodes == 2 else MEM_LIMITS
    services = {name: {"mem_limit": limit} for name, limit in limits.items()}
    for role in [*ROLES, "trainer-1"] if ctx.trainer_nodes == 2 else ROLES:
        services[role]["volumes"] = [f"{configs}:/app/configs:ro"]
    (ctx.out / "compose.check.yml").write_text(yaml.safe_dump({"services": services}, sort_keys=False))
    ctx.compose += ["--env-file", str(env), "-f", str(ctx.out / "compose.check.yml")]


def containers(ctx: Context, service: str, all_: bool = False) -> list[str]:
    args = [ctx.docker, "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={PROJECT}",
            "--filter", f"label=com.docker.compose.service={service}"]
    return run(args + (["-a"] if all_ else [])).stdout.split()


def inspect(ctx: Context, cid: str) -> dict:
    return json.loads(run([ctx.docker, "inspect", cid]).stdout)[0]


def exec_in(ctx: Context, cid: str, *args: str, check: bool = True, input: str | None = None) -> str:
    return run([ctx.docker, "exec", *(["-i"] if input is not None else []), cid, *args], check=check,
               input=input, timeout=300).stdout


def trainer_file(ctx: Context, name: str) -> str | None:
    (trainer,) = containers(ctx, "trainer")
    p = subprocess.run([ctx.docker, "exec", trainer, "cat", f"/data/runs/{RUN_NAME}/{name}"], capture_output=True,
                       text=True, timeout=60)
    return p.stdout if p.returncode == 0 else None


def steps_logged(ctx: Context) -> int:
    text = trainer_file(ctx, "metrics.jsonl") or ""
    return sum(1 for line in text.splitlines() if line.strip())


def consumer_name(ctx: Context, cid: str) -> str | None:
    """The Redis consumer name of the role process running in container `cid` now: <role>-<hostname>-<pid>
    (opsd.service; the pid as the container sees it). None while it has no process."""
    info = inspect(ctx, cid)
    try:
        init = info["State"]["Pid"]
        child = Path(f"/proc/{init}/task/{init}/children").read_text().split()[0]
        status = Path(f"/proc/{child}/status").read_text()
    except (OSError, IndexError):
        return None
    nspid = next(line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:"))
    return f"{info['Config']['Labels']['com.docker.compose.service']}-{info['Config']['Hostname']}-{nspid}"


def redis_client(ctx: Context):
    """A client on the stack's Redis at its container's address on the compose network (from this host:
    a held task lasts about a second, too short to poll through `docker exec`)."""
    import redis

    (cid,) = containers(ctx, "redis")
    networks = inspect(ctx, cid)["NetworkSettings"]["Networks"]
    address = next(n["IPAddress"] for n in networks.values() if n.get("IPAddress"))
    return redis.Redis(host=address, port=6379, password=ctx.redis_password, socket_timeout=10)


def rollout_holding_a_task(ctx: Context, client=None) -> str | None:
    """A rollout container whose running process holds a task now (a pending entry of its consumer), or None.

    A consumer that died keeps its pending entries until they are re-claimed: those do not count.
    """
    client = client or redis_client(ctx)
    pending = client.xpending(f"opsd:{RUN_NAME}:tasks", "rollout")
    holders = {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
               for c in pending.get("consumers") or [] if int(c["pending"]) > 0}
    if not holders:
        return None
    for cid in containers(ctx, "rollout"):
        if consumer_name(ctx, cid) in holders:
            return cid
    return None


def holder_before_done(ctx: Context, client) -> str | None:
    """rollout_holding_a_task, or RuntimeError once the run is DONE (a kill then would not be mid-run)."""
    holder = rollout_holding_a_task(ctx, client)
    if holder is None and trainer_file(ctx, "DONE") is not None:
        raise RuntimeError("the run finished before a rollout could be killed mid-run (raise run.steps)")
    return holder


def health(ctx: Context, cid: str) -> str:
    state = inspect(ctx, cid)["State"]
    return state.get("Health", {}).get("Status", state["Status"]) if state["Status"] == "running" else state["Status"]


def main_process(ctx: Context, cid: str) -> int:
    """The host pid of the role's python (the child of the container's init, tini)."""
    init = inspect(ctx, cid)["State"]["Pid"]
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    return int(children[0]) if children else init


def prometheus(path: str, **params) -> dict:
    url = f"{PROMETHEUS}{path}?{urllib.parse.urlencode(params)}" if params else f"{PROMETHEUS}{path}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with the template variables substituted) of every panel target of the dashboard."""
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/opsd.json").read_text())

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    out = []
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            for name, value in sorted(TEMPLATE_VALUES.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(name, value)
            if re.search(r"\$(?!\d)", expr):  # $1 & co. are label_replace's capture groups
                raise RuntimeError(f"{panel.get('title')}: a template variable the check does not know: {expr}")
            out.append((panel.get("title", "?"), expr))
    return out


def check_books(ctx: Context, cfg: dict, runner: list[str] | None = None) -> None:
    """The finished run's books (`python -m services.trainer.books` in the trainer container, or through `runner`,
    a command prefix that runs it where the run volume is): every group of the run (`cfg`: its config) trained
    exactly once."""
    runner = runner or [ctx.docker, "exec", *containers(ctx, "trainer")]
    p = subprocess.run([*runner, "python", "-m", "services.trainer.books", "--run-dir",
                        f"/data/runs/{RUN_NAME}", "--config", f"/app/configs/{CONFIG_NAME}"],
                       capture_output=True, text=True, timeout=300)
    (ctx.out / "books.json").write_text(p.stdout + p.stderr)
    books = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
    expected = cfg["run"]["steps"] * cfg["env"]["num_games"]
    ok = p.returncode == 0 and books.get("trained") == books.get("applied_entries") == expected
    ctx.add("every group trained once (trainer's books)", ok, 0,
            f"trained {books.get('trained')}/{expected}, applied {books.get('applied_entries')}, "
            f"produced {books.get('produced')}, dead {books.get('dead_lettered')}, "
            f"duplicates dropped {books.get('redeliveries_deduplicated', {}).get('checkpoint')}, "
            f"violations {books.get('violations', p.stderr.strip()[-300:])}")


def check_stack(ctx: Context) -> None:
    compose = ctx.compose
    t_up = time.time()
    t0 = time.monotonic()
    run([*compose, "up", "-d", "--no-build", "--scale", "rollout=2"], log_to=ctx.out / "compose.log", timeout=900)
    role_cids = {role: containers(ctx, role) for role in ROLES}
    all_roles = [cid for cids in role_cids.values() for cid in cids]
    wait_for("every role container healthy", lambda: all(health(ctx, c) == "healthy" for c in all_roles), 900, 5)
    ctx.add(f"every role healthy ({', '.join(r + ' x2' if r == 'rollout' else r for r in ROLES)})", True, time.monotonic() - t0,
            f"{len(all_roles)} containers healthy after `up -d --scale rollout=2`")

    uids = {}
    for cid in all_roles:
        name = inspect(ctx, cid)["Name"].lstrip("/")
        uids[name] = Path(f"/proc/{main_process(ctx, cid)}/status").read_text().split("Uid:")[1].split()[0]
    ok = all(u == "10001" for u in uids.values())
    ctx.add("roles run as uid 10001", ok, 0, ", ".join(f"{n}={u}" for n, u in sorted(uids.items())))

    # A crash of a rollout worker while it holds a task (its python SIGKILLed, as the OOM killer would).
    t0 = time.monotonic()
    wait_for("a first step", lambda: steps_logged(ctx) >= 1, 900, 1)
    client = redis_client(ctx)
    victim = wait_for("a rollout holding a task", lambda: holder_before_done(ctx, client), 900, 0.2)
    before = inspect(ctx, victim)["RestartCount"]
    os.kill(main_process(ctx, victim), signal.SIGKILL)
    wait_for("the crashed rollout restarted", lambda: inspect(ctx, victim)["RestartCount"] > before
             and health(ctx, victim) in ("starting", "healthy"), 300)
    ctx.add("rollout crash mid-run (SIGKILL of its process): restarted", True, time.monotonic() - t0,
            f"restart policy restarted {victim[:12]} (RestartCount {before} -> {inspect(ctx, victim)['RestartCount']})")

    # `docker kill` of a rollout container mid-run: Docker counts it as a manual stop (no restart policy
    # applies, as for `docker stop`); `up -d` brings it back, the other replica goes on meanwhile.
    t0 = time.monotonic()
    killed = wait_for("a rollout holding a task", lambda: holder_before_done(ctx, client), 900, 0.2)
    step_at_kill = steps_logged(ctx)
    run([ctx.docker, "kill", killed])
    time.sleep(10)
    state = inspect(ctx, killed)["State"]
    stayed_down = state["Status"] == "exited"
    run([*compose, "up", "-d", "--no-build", "--scale", "rollout=2"], log_to=ctx.out / "compose.log", timeout=900)
    wait_for("the killed rollout running again", lambda: health(ctx, killed) in ("starting", "healthy"), 300)
    ctx.add("`docker kill` rollout mid-run: down until `up -d`, then back", stayed_down, time.monotonic() - t0,
            f"{killed[:12]} killed at step {step_at_kill}: {'stayed exited (Docker: a manual stop)' if stayed_down else 'was ' + state['Status']}; "
            "`up -d --scale rollout=2` started it again")

    t0 = time.monotonic()
    wait_for("DONE", lambda: trainer_file(ctx, "DONE") is not None, 1800, 5)
    ctx.add("run reaches DONE", True, time.time() - t_up, f"{steps_logged(ctx)} steps in metrics.jsonl, "
            f"{time.time() - t_up:.0f} s after `up`")

    check_books(ctx, check_config())

    # Both replicas did work (their own /metrics: groups finished).
    shares = {}
    for cid in containers(ctx, "rollout"):
        text = exec_in(ctx, cid, "python", "-c", "import urllib.request; print(urllib.request.urlopen("
                       "'http://127.0.0.1:8000/metrics', timeout=10).read().decode())")
        m = re.search(r'^opsd_groups_total\{role="rollout"\} (\S+)', text, re.M)
        shares[cid[:12]] = float(m.group(1)) if m else 0.0
    # A restarted replica's counter starts again at 0: Prometheus's view over the whole run is the fair one.
    since = f"{int(time.time() - t_up) + 60}s"
    series = prometheus("/api/v1/query", query=f'max by (instance) (max_over_time(opsd_groups_total{{role="rollout"}}[{since}]))')
    by_instance = {s["metric"].get("instance", "?"): float(s["value"][1]) for s in series["data"]["result"]}
    ok = len(containers(ctx, "rollout")) == 2 and sum(1 for v in by_instance.values() if v > 0) >= 2
    ctx.add("--scale rollout=2: both replicas share the work", ok, 0,
            f"groups per instance (Prometheus, incl. restarted ones) {by_instance}; now per container {shares}")

    if ctx.weights == "http":
        check_weights_over_http(ctx)

    # Prometheus: every role replica is a target and up.
    t0 = time.monotonic()
    want = {role: 2 if role == "rollout" else 1 for role in ROLES}

    def targets_up():
        active = prometheus("/api/v1/targets", state="active")["data"]["activeTargets"]
        up = {}
        for t in active:
            if t["labels"].get("job") == "opsd" and t["health"] == "up":
                up[t["labels"].get("service")] = up.get(t["labels"].get("service"), 0) + 1
        return up if up == want else None

    try:
        up = wait_for("Prometheus targets", targets_up, 180, 5)
        ctx.add("Prometheus targets: every replica up", True, time.monotonic() - t0, f"job opsd, up per service {up}")
    except RuntimeError:
        active = prometheus("/api/v1/targets", state="active")["data"]["activeTargets"]
        ctx.add("Prometheus targets: every replica up", False, time.monotonic() - t0,
                "; ".join(f"{t['labels'].get('service')} {t['scrapeUrl']} {t['health']} {t.get('lastError', '')}" for t in active))

    # Every dashboard query over the run, from this real Prometheus.
    t0 = time.monotonic()
    end = time.time()
    results, empty, unexplained = [], [], []
    records = [json.loads(line) for line in (trainer_file(ctx, "metrics.jsonl") or "").splitlines() if line.strip()]
    for title, expr in dashboard_queries():
        r = prometheus("/api/v1/query_range", query=expr, start=f"{t_up:.0f}", end=f"{end:.0f}", step="15")
        n = len(r["data"]["result"]) if r.get("status") == "success" else -1
        results.append({"panel": title, "expr": expr, "series": n, "error": r.get("error")})
        if n <= 0:
            metrics = set(re.findall(r"\b(opsd_[a-z_]+|redis_[a-z_]+|DCGM_[A-Z_]+)", expr))
            reason = "; ".join(sorted({NO_DATA_REASONS[m] for m in metrics if m in NO_DATA_REASONS
                                       and REASON_HOLDS.get(m, lambda _: True)(records)}))
            (empty if reason else unexplained).append(f"{title}: {reason or 'no data, no known reason'} [{expr}]")
    (ctx.out / "dashboard_queries.json").write_text(json.dumps(results, indent=1))
    with_data = sum(1 for r in results if r["series"] > 0)
    ctx.add("dashboard queries return data", not unexplained, time.monotonic() - t0,
            f"{with_data}/{len(results)} with data; no data, with reason: {len(empty)}"
            + "".join(f"\n    - {e}" for e in empty + unexplained))

    # Grafana is not part of this stack (docker-compose.debian.yml): say so in the table.
    ctx.add("Grafana", None, 0, "not run: no image registry and no Debian package (its queries are checked above)")

    t0 = time.monotonic()
    run([*compose, "logs", "--no-color"], log_to=ctx.out / "stack.log", check=False, timeout=300)
    run([*compose, "down"], log_to=ctx.out / "compose.log", timeout=600)
    left = run([ctx.docker, "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    volumes = run([ctx.docker, "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    ctx.add("`down` leaves no container", not left, time.monotonic() - t0,
            f"containers left: {len(left)}; volumes kept: {len(volumes)}")
    t0 = time.monotonic()
    run([*compose, "down", "-v"], log_to=ctx.out / "compose.log", timeout=600)
    volumes = run([ctx.docker, "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    ctx.add("`down -v` leaves no volume", not volumes, time.monotonic() - t0, f"volumes left: {volumes}")


def check_weights_over_http(ctx: Context) -> None:
    """docker-compose.http.yml: no rollout or teacher container mounts the trainer's volume (opsd-data), and each
    one's log says it loaded policy versions from http://trainer:8000/weights/ (opsd.weights.ensure_version)."""
    t0 = time.monotonic()
    shared = f"{PROJECT}_opsd-data"
    loaded, mounting = {}, []
    for role in ("rollout", "teacher"):
        for cid in containers(ctx, role):
            if any(m.get("Name") == shared for m in inspect(ctx, cid)["Mounts"]):
                mounting.append(f"{role} {cid[:12]}")
            logs = run([ctx.docker, "logs", cid], check=False)
            text = logs.stdout + logs.stderr
            versions = sorted({int(v) for v in re.findall(r"loaded policy version (\d+) from http://trainer:8000/weights/", text)})
            loaded[f"{role} {cid[:12]}"] = versions
    # A restarted rollout replica may not have needed a new version since: one replica per role suffices.
    ok = not mounting and all(any(v for k, v in loaded.items() if k.startswith(role)) for role in ("rollout", "teacher"))
    ctx.add("weights over http: rollout and teacher load versions from the trainer, no shared volume", ok,
            time.monotonic() - t0, f"versions loaded over http {loaded}; mounting {shared}: {mounting or 'none'}")


# `services.trainer.distributed.init_from_env`'s and `services.trainer.update.ppo_update`'s log lines.
RANK_LINE = re.compile(r"rank (\d+) of (\d+) on (\S+) \((\w+)\), host ([^,\s]+)")
SHARE_LINE = re.compile(r"rank (\d+) of 2: my share of the update: (\d+) of (\d+) sequences, (\d+) of (\d+) loss tokens")


def container_log(ctx: Context, cid: str) -> str:
    p = run([ctx.docker, "logs", cid], check=False)
    return p.stdout + p.stderr


def check_trainer_nodes(ctx: Context) -> None:
    """docker-compose.multinode.yml: the trainer as two containers (node ranks 0 and 1, one rank each) in one
    torchrun world over the compose network, ending as a Kubernetes Job's does (OPSD_EXIT_WHEN_DONE=1). Checked:
    both containers exit 0 at DONE, the world (two ranks, gloo, two host names), each rank's share of every update
    in its own log, `trainer-1` without the run volume, the versions published and loaded by rollout and teacher,
    the KEDA marker <prefix>:active during the run and gone after, the books. The run directory is read through
    `compose run` of the (exited) trainer's service, which mounts its volume."""
    compose = ctx.compose
    t_up = time.time()
    t0 = time.monotonic()
    run([*compose, "up", "-d", "--no-build", "redis", *ROLES, "trainer-1"], log_to=ctx.out / "compose.log", timeout=900)
    (node0,), (node1,) = containers(ctx, "trainer", all_=True), containers(ctx, "trainer-1", all_=True)
    client = redis_client(ctx)
    active = f"opsd:{RUN_NAME}:active"

    def exited(cid: str) -> bool:
        return inspect(ctx, cid)["State"]["Status"] == "exited"

    # Rank 0 writes the marker once both nodes are in and the model is loaded; it deletes it at DONE, then exits.
    during = wait_for(f"{active} or the trainer's exit", lambda: client.lrange(active, 0, -1) or exited(node0), 900, 0.5)
    wait_for("both trainer containers to exit", lambda: exited(node0) and exited(node1), 1800, 2)
    states = {name: inspect(ctx, cid) for name, cid in (("trainer", node0), ("trainer-1", node1))}
    ok = all(i["State"]["ExitCode"] == 0 and i["RestartCount"] == 0 for i in states.values())
    ctx.add("two-node trainer: both containers exit 0 at DONE (OPSD_EXIT_WHEN_DONE=1)", ok, time.monotonic() - t0,
            "; ".join(f"{n}: exit code {i['State']['ExitCode']}, restarts {i['RestartCount']}" for n, i in states.items())
            + f"; {time.time() - t_up:.0f} s after `up`")

    def run_file(name: str) -> str:
        p = run([*compose, "run", "--rm", "--no-deps", "-T", "trainer", "cat", f"/data/runs/{RUN_NAME}/{name}"], check=False)
        return p.stdout if p.returncode == 0 else ""

    records = [json.loads(line) for line in run_file("metrics.jsonl").splitlines() if line.strip()]
    versions = [r.get("policy_version") for r in records]
    published = int(client.get(f"opsd:{RUN_NAME}:policy_version") or -1)
    ok = versions == list(range(1, MULTINODE_STEPS + 1)) and published == MULTINODE_STEPS and bool(run_file("DONE"))
    ctx.add(f"two-node trainer: {MULTINODE_STEPS} steps trained, versions published, DONE", ok, 0,
            f"metrics.jsonl policy versions {versions}; Redis policy_version {published}")

    logs = {name: container_log(ctx, cid) for name, cid in (("trainer", node0), ("trainer-1", node1))}
    for name, text in logs.items():
        (ctx.out / f"{name}.log").write_text(text)
    ranks = {name: RANK_LINE.findall(text) for name, text in logs.items()}
    hosts = {name: i["Config"]["Hostname"] for name, i in states.items()}
    ok = ([r[:4] for r in ranks["trainer"]] == [("0", "2", "cpu", "gloo")]
          and [r[:4] for r in ranks["trainer-1"]] == [("1", "2", "cpu", "gloo")]
          and all(ranks[name][0][4] == hosts[name] for name in hosts) and hosts["trainer"] != hosts["trainer-1"])
    ctx.add("two-node trainer: one world of 2 ranks, gloo, one rank per container", ok, 0,
            f"rank lines {ranks}; container host names {hosts}")

    shares = {name: SHARE_LINE.findall(text) for name, text in logs.items()}
    pairs = list(zip(shares["trainer"], shares["trainer-1"]))
    ok = (len(shares["trainer"]) == len(shares["trainer-1"]) == MULTINODE_STEPS
          and all(r0[0] == "0" and r1[0] == "1" and int(r1[1]) > 0 and r0[2] == r1[2]
                  and int(r0[1]) + int(r1[1]) == int(r0[2]) and int(r0[3]) + int(r1[3]) == int(r0[4]) == int(r1[4])
                  for r0, r1 in pairs))
    ctx.add("two-node trainer: each rank trained its share of every update", ok, 0,
            "per step (rank 0 | rank 1): " + "; ".join(
                f"{r0[1]}+{r1[1]} of {r0[2]} sequences, {r0[3]}+{r1[3]} of {r0[4]} loss tokens" for r0, r1 in pairs))

    mounts = states["trainer-1"]["Mounts"]
    ok = not any(m.get("Destination") == "/data" or m.get("Name") == f"{PROJECT}_opsd-data" for m in mounts)
    shown = [f"{m.get('Name') or m.get('Source')}:{m.get('Destination')}" for m in mounts]
    ctx.add("two-node trainer: trainer-1 mounts no run volume", ok, 0, f"mounts {shown}")

    loaded = {}
    for role in ("rollout", "teacher"):
        for cid in containers(ctx, role):
            loaded[f"{role} {cid[:12]}"] = sorted({int(v) for v in re.findall(r"loaded policy version (\d+) from",
                                                                                container_log(ctx, cid))})
    ok = all(any(1 in v for k, v in loaded.items() if k.startswith(role)) for role in ("rollout", "teacher"))
    ctx.add("two-node trainer: rollout and teacher loaded version 1 (trained by both ranks)", ok, 0,
            f"versions loaded {loaded}")

    after = client.llen(active)
    ok = during == [run_file("run_id").strip().encode()] and after == 0
    ctx.add(f"KEDA marker {active}: one entry during the run, none after DONE", ok, 0,
            f"during the run {during!r} (the run id); after DONE LLEN {after}")
    check_books(ctx, multinode_config(), [*compose, "run", "--rm", "--no-deps", "-T", "trainer"])

    t0 = time.monotonic()
    run([*compose, "logs", "--no-color"], log_to=ctx.out / "stack.log", check=False, timeout=300)
    run([*compose, "down", "-v"], log_to=ctx.out / "compose.log", timeout=600)
    left = run([ctx.docker, "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    volumes = run([ctx.docker, "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    ctx.add("`down -v` leaves no container and no volume", not left and not volumes, time.monotonic() - t0,
            f"containers left: {len(left)}; volumes left: {volumes}")


# ------------------------------------------------------------------------------------------ report


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  result  seconds  detail", "-" * (width + 40)]
    for r in rows:
        mark = {True: "pass", False: "FAIL", None: "-"}[r.ok]
        lines.append(f"{r.check:<{width}}  {mark:<6}  {r.seconds:7.0f}  {r.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="logs and the table (default runs/compose-check/<UTC time>)")
    ap.add_argument("--memory", default="8g", help="memory cap of a dockerd this check starts (all containers and builds)")
    ap.add_argument("--skip-build", action="store_true", help="use the images already built")
    ap.add_argument("--build-only", action="store_true", help="build the images (mirror mode), run no stack")
    ap.add_argument("--rebuild-base", action="store_true", help="make the Debian base image again")
    ap.add_argument("--weights", choices=("file", "http"), default="file",
                    help="how rollout and teacher get policy versions: the shared volume, or the trainer's API "
                         "(docker-compose.http.yml)")
    ap.add_argument("--trainer-nodes", type=int, choices=(1, 2), default=1,
                    help="2: the trainer as two containers in one torchrun world (docker-compose.multinode.yml), "
                         "checked by check_trainer_nodes instead of the single-trainer checks")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("compose-check runs as root (it installs packages and starts dockerd)", file=sys.stderr)
        return 2
    out = args.out or ROOT / "runs" / "compose-check" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out.resolve(), weights=args.weights, trainer_nodes=args.trainer_nodes)
    started = time.monotonic()
    failed = None

    def interrupted(signum, frame):  # SIGTERM (a CI timeout): clean up as for a failure
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    try:
        ensure_engine(ctx, parse_size(args.memory))
        ctx.compose = [*compose_cli(ctx), "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                       "-f", str(ROOT / "docker-compose.debian.yml")]
        if ctx.weights == "http":
            ctx.compose += ["-f", str(ROOT / "docker-compose.http.yml")]
        if ctx.trainer_nodes == 2:
            ctx.compose += ["-f", str(ROOT / "docker-compose.multinode.yml")]
        write_stack_files(ctx)
        if not args.skip_build:
            base_image(ctx, args.rebuild_base)
            build_images(ctx)
        if not args.build_only:
            if ctx.trainer_nodes == 2:
                check_trainer_nodes(ctx)
            else:
                check_stack(ctx)
    except (Exception, KeyboardInterrupt) as e:  # the table shows where it stopped; the stack is taken down
        failed = f"{type(e).__name__}: {e}"
        ctx.add("stopped", False, 0, failed)
        if ctx.compose:
            run([*ctx.compose, "logs", "--no-color"], log_to=ctx.out / "stack.log", check=False, timeout=300)
            run([*ctx.compose, "down", "-v"], log_to=ctx.out / "compose.log", check=False, timeout=600)
    finally:
        stop_engine(ctx)
    ctx.add("total", None, time.monotonic() - started, f"logs in {ctx.out}")
    text = table(ctx.rows)
    (ctx.out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    return 0 if failed is None and all(r.ok is not False for r in ctx.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
