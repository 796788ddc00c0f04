"""Finding the offline validators the deployment tests run (kubectl, hadolint, ...).

The Python ones come with the dev extras (next to this interpreter); kubectl
and docker-compose come from the machine. A missing tool skips its test with
the reason, unless OPSD_REQUIRE_DEPLOY_TOOLS=1 (set by .ci/run), where it fails:
in CI a skipped validation must not pass for a done one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "OPSD_REQUIRE_DEPLOY_TOOLS"
CRDS = ROOT / "k8s" / "crds"
K8S_VERSION = "1.34.0"  # a recent release that kubernetes-validate 1.37 bundles


def tool(name: str) -> str:
    """The path of executable `name`: beside sys.executable first, then on PATH; skips or fails if absent."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found:
        return found
    reason = f"{name} is not installed (dev extras or the machine)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)


def run_tool(args: list[str], stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a validator from the repo root; fails the test with its output on a non-zero exit."""
    p = subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(args[:3])} ... exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


# The Redis start scripts (compose and k8s) accept only passwords safe inside redis://:PASSWORD@.
GOOD_REDIS_PASSWORD = "Good_pass-0123456789abcdefABCDEF"
BAD_REDIS_PASSWORDS = ("a/b", 'a"b', "a\\b", "a b", "", "a:b", "a@b", "a%b", "a$b", "a'b", "a\nb", "caf\u00e9",
                       "Zq7/secret-xK9")


def run_redis_start_script(script: str, password: str, tmp_path: Path,
                           memory_limit_mb: str = "4096") -> tuple[subprocess.CompletedProcess, Path]:
    """Run a Redis start script with /bin/sh, a fake redis-server first on PATH, the config file in `tmp_path`.

    `memory_limit_mb` is the container's memory limit as the script gets it (REDIS_MEMORY_LIMIT_MB: the
    Kubernetes downward API's limits.memory in Mi, compose's OPSD_REDIS_MEMORY_MB).
    The fake prints its arguments, then `CONFIG:` and the file it was given. Returns the run and that file.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "redis-server"
    fake.write_text('#!/bin/sh\necho "ARGS: $*"\necho "CONFIG:"\ncat "$1"\n')
    fake.chmod(0o755)
    conf = tmp_path / "redis.conf"
    assert script.count("/tmp/redis.conf") == 2, script  # written, then given to redis-server
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": password, "REDISCLI_AUTH": password,
           "REDIS_MEMORY_LIMIT_MB": memory_limit_mb}
    p = subprocess.run(["/bin/sh", "-c", script.replace("/tmp/redis.conf", str(conf))], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=30)
    if p.returncode == 0:
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600, "the config file holds the password: umask 077"
    return p, conf


# Schema checks of rendered Kubernetes objects: core kinds by kubernetes-validate, custom resources by the pinned
# CRDs' schemas in k8s/crds/ (tests/test_deploy_crds.py says what is and is not checked).
@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored file's content, for every k8s/crds/*.json."""
    out = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = crd
    assert out, "no CRD schema in k8s/crds (scripts/crd_schemas.py writes them)"
    return out


def structural(schema):
    """A CRD's openAPIV3Schema as JSON Schema with the API server's rules: an object that lists its properties
    takes no other field (unless x-kubernetes-preserve-unknown-fields), `nullable` admits null."""
    if isinstance(schema, list):
        return [structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[key] = structural(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def crd_errors(obj: dict) -> list[str]:
    """What the pinned CRD's schema finds wrong with custom resource `obj` ([] = valid)."""
    schema = structural(crd_schemas()[(obj["apiVersion"], obj["kind"])]["openAPIV3Schema"])
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI 3.0's schema objects are JSON Schema draft 4's
    return [f"{obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, e.absolute_path)) or '(root)'}: "
            f"{e.message}" for e in validator.iter_errors(obj)]


def core_errors(objs: list[dict]) -> list[str]:
    """kubernetes-validate --strict over `objs`: its errors, and any object it has no schema for."""
    if not objs:
        return []
    out = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"],
                   stdin=yaml.safe_dump_all(objs)).stdout
    problems = [line for line in out.splitlines() if line.startswith(("ERROR", "FATAL"))]
    problems += [f"no schema for {kind} {version}: a custom resource? pin its CRD in k8s/crds/pins.yaml"
                 for kind, version in re.findall(r"Couldn't find schema for kind (\S+) with api version (\S+)", out)]
    return problems


def check(objs: list[dict]) -> tuple[list[str], int]:
    """(problems, how many objects went through a CRD schema) for a list of rendered objects."""
    custom = [o for o in objs if (o["apiVersion"], o["kind"]) in crd_schemas()]
    core = [o for o in objs if (o["apiVersion"], o["kind"]) not in crd_schemas()]
    return [p for o in custom for p in crd_errors(o)] + core_errors(core), len(custom)
