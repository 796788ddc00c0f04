"""The image builds behind a mirror and `make compose-check`, checked without a Docker engine.

What the real build and run found (scripts/compose_check.py does them, docs/how-to/deploy-compose.md) is pinned here
where a test can fail without Docker: the build args' stages (nothing from ghcr.io or GitHub with
PYTHON_SOURCE=system), deploy/docker/index-env.sh (which index, wheel locations and CA each install step
gets; torch from a local wheel without its dependencies), the Debian override for Redis and Prometheus,
and the check's own config, settings and dashboard queries.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opsd.config import RunConfig
from tests.deploy_tools import ROOT, run_tool, tool
from tests.test_deploy_containers import ROLES, dockerfile, instructions, load

sys.path.insert(0, str(ROOT / "scripts"))
import compose_check  # noqa: E402

INDEX_ENV = ROOT / "deploy" / "docker" / "index-env.sh"
DEBIAN = ROOT / "docker-compose.debian.yml"


# ---------------------------------------------------------------- which stages a build reaches


def reached_stages(path: Path, values: dict[str, str]) -> list[dict]:
    """The stages the final one needs for the global ARG `values` (BuildKit builds only those, and pulls
    only their images): [{name, image, body}], each with its FROM and COPY --from resolved."""
    args: dict[str, str] = {}
    stages: list[dict] = []
    for keyword, rest in instructions(path):
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = values.get(name, default.strip('"'))
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            stages.append({"name": words[2] if len(words) == 3 else None, "image": image, "body": []})
        else:
            stages[-1]["body"].append((keyword, rest))
    by_name = {s["name"]: s for s in stages if s["name"]}
    needed, todo = [], [stages[-1]]
    while todo:
        stage = todo.pop()
        if stage in needed:
            continue
        needed.append(stage)
        deps = [stage["image"]] + [m.group(1) for k, r in stage["body"] if k == "COPY" and (m := re.search(r"--from=(\S+)", r))]
        todo += [by_name[d] for d in deps if d in by_name]
    return needed


@pytest.mark.parametrize("role", ROLES)
def test_a_mirror_build_reaches_no_registry_but_its_base(role):
    """PYTHON_SOURCE=system: no uv image (ghcr.io), no `uv python install` (GitHub); the bases are the
    build arg's. The real build failed on both before these build args existed."""
    local = {"CPU_BASE": "opsd-debian:bookworm", "PYTHON_SOURCE": "system"}
    needed = reached_stages(dockerfile(role), local)
    images = {s["image"] for s in needed} - {s["name"] for s in needed}
    assert images == {"opsd-debian:bookworm"}, images
    text = json.dumps([s["body"] for s in needed])
    assert "ghcr.io" not in text and "uv python install" not in text
    # The default build is unchanged for users with internet access: uv's image and its CPython.
    default = reached_stages(dockerfile(role), {})
    assert "ghcr.io/astral-sh/uv:0.13.9" in {s["image"] for s in default}
    assert "uv python install 3.11" in json.dumps([s["body"] for s in default])


@pytest.mark.parametrize("role", ROLES)
def test_every_install_step_gets_the_index_settings_and_the_ca_secret(role):
    """Each RUN that installs packages sources index-env.sh and mounts the ca_bundle secret: a step
    without them reaches PyPI's default with the tool's own CA roots (fails behind a TLS proxy)."""
    for keyword, rest in instructions(dockerfile(role)):
        if keyword == "RUN" and re.search(r"\b(uv|pip) (pip )?install\b", rest) and "uv python install" not in rest:
            assert ". /usr/local/lib/opsd/index-env.sh" in rest, rest[:200]
            assert "--mount=type=secret,id=ca_bundle" in rest, rest[:200]
        if "--mount=type=secret" in rest:  # a secret is mounted, never copied
            assert "COPY" != keyword
    text = dockerfile(role).read_text()
    assert "SSL_CERT_FILE=/run/secrets" not in text  # set in the RUN's shell only, never as an image ENV


@pytest.mark.parametrize("role", ROLES)
def test_bind_mount_sources_exist_in_the_build_context(role):
    """`RUN --mount=type=bind,source=deploy/docker/wheels` fails the build when the folder is missing from the
    context: it is in git (with its README) and not left out by .dockerignore."""
    from tests.test_deploy_containers import dockerignore_rules, ignored

    rules = dockerignore_rules()
    sources = {m.group(1) for _, rest in instructions(dockerfile(role))
               for m in re.finditer(r"--mount=type=bind,source=([^,\s]+)", rest)}
    assert sources == {"deploy/docker/wheels"}
    for source in sources:
        assert (ROOT / source).is_dir()
        assert not ignored(source + "/README.md", rules) and not ignored(source + "/torch-2.13.0+cpu-x.whl", rules)
    tracked = subprocess.run(["git", "ls-files", "deploy/docker/wheels"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.returncode != 0 or "deploy/docker/wheels/README.md" in tracked.stdout


# ---------------------------------------------------------------- deploy/docker/index-env.sh


def fake_uv(tmp_path: Path) -> Path:
    """A `uv` that records its arguments and the settings it would see."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    uv = bin_dir / "uv"
    uv.write_text('#!/bin/sh\nprintf "%s|" "$@" >> "$UV_LOG"; printf "\\n" >> "$UV_LOG"\n')
    uv.chmod(uv.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def source_index_env(tmp_path: Path, script: str, **env: str) -> dict:
    """Source index-env.sh under `sh` (dash on Debian, as in the image) with build args `env`, run `script`,
    and return the exported settings and the uv calls."""
    bin_dir = fake_uv(tmp_path)
    log = tmp_path / "uv.log"
    log.write_text("")
    names = ("SSL_CERT_FILE", "PIP_CERT", "NETRC", "UV_INDEX_URL", "PIP_INDEX_URL", "UV_EXTRA_INDEX_URL",
             "PIP_EXTRA_INDEX_URL", "UV_FIND_LINKS", "PIP_FIND_LINKS", "UV_PYTHON_INSTALL_MIRROR")
    show = " ".join(f'echo "{n}=${{{n}:-}}";' for n in names)
    p = subprocess.run(["sh", "-c", f". {INDEX_ENV} && {script} && {show}"], capture_output=True, text=True,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "UV_LOG": str(log), **env}, timeout=30)
    assert p.returncode == 0, p.stderr
    settings = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line and not line.startswith("index-env"))
    return {"env": settings, "uv": [line.rstrip("|").split("|") for line in log.read_text().splitlines()], "out": p.stdout}


def test_torch_from_a_local_wheel_is_installed_alone_then_its_dependencies_from_the_index(tmp_path):
    """The real build's first failure: `uv pip install --no-index --find-links /wheels torch==2.13.0` cannot
    resolve torch's own dependencies (filelock, ...) from a folder holding only torch. Now torch alone
    (--no-deps); its dependencies come with the requirements that follow, from the index."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    r = source_index_env(tmp_path, "opsd_install_cpu_torch torch==2.13.0", OPSD_WHEELS=str(wheels),
                         TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert r["uv"] == [["pip", "install", "--no-index", "--no-deps", "--find-links", str(wheels), "torch==2.13.0"]]
    assert r["env"]["UV_FIND_LINKS"] == str(wheels) and r["env"]["PIP_FIND_LINKS"] == str(wheels)


def test_torch_without_a_local_wheel_comes_from_the_cpu_index_never_from_pypi(tmp_path):
    r = source_index_env(tmp_path, "opsd_install_cpu_torch torch==2.13.0", OPSD_WHEELS=str(tmp_path / "none"),
                         TORCH_INDEX_URL="https://mirror.example/pytorch-cpu", INDEX_URL="https://mirror.example/pypi")
    assert r["uv"] == [["pip", "install", "--index-url", "https://mirror.example/pytorch-cpu", "torch==2.13.0"]]
    r = source_index_env(tmp_path, "opsd_install_cpu_torch torch==2.13.0", OPSD_WHEELS=str(tmp_path / "none"),
                         TORCH_INDEX_URL="none", FIND_LINKS="https://mirror.example/wheels/")
    assert r["uv"] == [["pip", "install", "--no-index", "--no-deps", "torch==2.13.0"]]
    assert r["env"]["UV_FIND_LINKS"] == "https://mirror.example/wheels/"


def test_index_args_and_secrets_become_pip_and_uv_settings(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"")
    r = source_index_env(tmp_path, "true", OPSD_WHEELS=str(wheels), INDEX_URL="https://m.example/simple",
                         EXTRA_INDEX_URL="https://a.example/simple https://b.example/simple",
                         FIND_LINKS="https://w.example/a/ https://w.example/b/", PYTHON_INSTALL_MIRROR="https://p.example/")
    env = r["env"]
    assert env["UV_INDEX_URL"] == env["PIP_INDEX_URL"] == "https://m.example/simple"
    assert env["UV_EXTRA_INDEX_URL"] == env["PIP_EXTRA_INDEX_URL"] == "https://a.example/simple https://b.example/simple"
    assert env["PIP_FIND_LINKS"] == f"{wheels} https://w.example/a/ https://w.example/b/"
    assert env["UV_FIND_LINKS"] == f"{wheels},https://w.example/a/,https://w.example/b/"  # uv: comma-separated
    assert env["UV_PYTHON_INSTALL_MIRROR"] == "https://p.example/"
    # No build args, no secrets: the tools' defaults (PyPI, their own CA roots), nothing set to "".
    r = source_index_env(tmp_path, "true", OPSD_WHEELS=str(tmp_path / "none"))
    assert all(v == "" for v in r["env"].values()), r["env"]


def test_the_ca_bundle_secret_is_used_where_buildkit_mounts_it():
    text = INDEX_ENV.read_text()
    assert "if [ -s /run/secrets/ca_bundle ]" in text  # BuildKit's mount point for --secret id=ca_bundle
    assert "SSL_CERT_FILE=/run/secrets/ca_bundle" in text and "PIP_CERT=/run/secrets/ca_bundle" in text


# ---------------------------------------------------------------- the Debian override


@pytest.mark.parametrize("name", ["redis.Dockerfile", "prometheus.Dockerfile"])
def test_debian_dockerfiles_pass_hadolint(name):
    run_tool([tool("hadolint"), "--failure-threshold", "warning", str(ROOT / "deploy" / "debian" / name)])


def test_the_debian_override_matches_compose_spec_and_compose_accepts_it(tmp_path):
    run_tool([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(DEBIAN)])
    run_tool([tool("yamllint"), "--strict", "-d", "{extends: relaxed, rules: {line-length: disable}}", str(DEBIAN)])
    env = tmp_path / "compose.env"
    env.write_text("REDIS_PASSWORD=x-0123456789abcdef\nOPSD_API_TOKEN=x-0123456789abcdef0123456789\n"
                   "GRAFANA_ADMIN_PASSWORD=x-0123456789abcdef\n")
    run_tool([tool("docker-compose"), "--env-file", str(env), "-f", str(ROOT / "docker-compose.yml"), "-f", str(DEBIAN),
              "config", "-q"])


def test_the_debian_images_give_what_the_base_compose_file_asks_of_them():
    """Redis: the base file's command runs `redis-server` and `redis-cli` under `sh` as user `redis`, on
    /data; Prometheus: the base file's `command` is flags for the prometheus binary, storage on /prometheus;
    the Redis exporter: its binary as the entrypoint, configured by the base file's environment."""
    base, override = load(ROOT / "docker-compose.yml")["services"], load(DEBIAN)["services"]
    assert set(override) == {"redis", "redis-exporter", "prometheus", "grafana"}
    assert override["grafana"]["profiles"]  # not started: no image without a registry
    redis = (ROOT / "deploy" / "debian" / "redis.Dockerfile").read_text()
    assert base["redis"]["user"] == "redis" and "redis-server=" in redis and "chown redis:redis /data" in redis
    prom = (ROOT / "deploy" / "debian" / "prometheus.Dockerfile").read_text()
    assert all(flag.startswith("--") for flag in base["prometheus"]["command"])
    assert 'ENTRYPOINT ["/usr/bin/prometheus"]' in prom and "chown prometheus:prometheus /prometheus" in prom
    assert "--storage.tsdb.path=/prometheus" in base["prometheus"]["command"]
    exporter = (ROOT / "deploy" / "debian" / "redis-exporter.Dockerfile").read_text()
    assert 'ENTRYPOINT ["/usr/bin/prometheus-redis-exporter"]' in exporter and "command" not in base["redis-exporter"]
    assert set(base["redis-exporter"]["environment"]) >= {"REDIS_ADDR", "REDIS_PASSWORD"}
    for name in ("redis", "redis-exporter", "prometheus"):
        build = override[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        assert "debian:12.12-slim" in build["args"]["BASE"] and "OPSD_DEBIAN_BASE" in build["args"]["BASE"]
        assert "/" not in override[name]["image"]  # a local name: nothing compose would try to pull


# ---------------------------------------------------------------- scripts/compose_check.py


def test_the_checks_config_is_valid_and_small(tmp_path):
    path = tmp_path / "compose-check.yaml"
    path.write_text(yaml.safe_dump(compose_check.check_config()))
    cfg = RunConfig.load(path)
    assert cfg.model.name == "tiny-random"
    assert cfg.env.num_games >= 2 * cfg.groups_in_flight("rollout")  # work for each of two rollout replicas
    assert cfg.run.steps >= 4 and cfg.redis.reclaim_idle_ms <= 15_000
    assert cfg.run.method == "alignopsd"  # every role, the embedder included, has work


def test_mirror_build_args_come_from_pips_settings_without_local_paths(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    bundle = tmp_path / "ca.crt"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = {"index-url": "https://m.example/simple", "extra-index-url": "file:///opt/pypi/simple https://x.example/simple",
                "find-links": f"{wheels} https://w.example/", "cert": str(bundle)}
    assert compose_check.cpu_torch_wheel(settings) == wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    joined = " ".join(compose_check.build_args(settings))
    assert "INDEX_URL=https://m.example/simple" in joined
    assert "EXTRA_INDEX_URL=https://x.example/simple" in joined and "file://" not in joined  # a container cannot read it
    assert "FIND_LINKS=https://w.example/" in joined and str(wheels) not in joined
    assert f"id=ca_bundle,src={bundle}" in joined
    assert "PYTHON_SOURCE=system" in joined and f"CPU_BASE={compose_check.BASE_IMAGE}" in joined
    assert compose_check.cpu_torch_wheel({"find-links": str(tmp_path / "nothing")}) is None


def test_every_dashboard_query_is_substituted_for_prometheus():
    queries = compose_check.dashboard_queries()
    assert len(queries) >= 30
    for title, expr in queries:
        assert not re.search(r"\$(?!\d)", expr), (title, expr)  # only label_replace's $1 (a capture group) stays
    assert any("$1" in expr for _, expr in queries)
    assert any("[1m]" in expr for _, expr in queries)  # $__rate_interval at a 15 s scrape interval


def test_memory_sizes_parse():
    assert compose_check.parse_size("8g") == 8 << 30 and compose_check.parse_size("512m") == 512 << 20
    with pytest.raises(ValueError):
        compose_check.parse_size("lots")


def test_the_check_table_marks_failures():
    rows = [compose_check.Row("a", True, 1.0, "x"), compose_check.Row("bb", False, 2.0, "y"), compose_check.Row("c", None, 0, "")]
    text = compose_check.table(rows)
    assert re.search(r"^a\s+pass\s+1\s+x$", text, re.M) and re.search(r"^bb\s+FAIL\s+2\s+y$", text, re.M)


def test_make_compose_check_runs_the_script():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-check:.*\n\t.*scripts/compose_check\.py", makefile, re.M)
    assert os.access(ROOT / "scripts" / "compose_check.py", os.R_OK)


# ---------------------------------------------------------------- the trainer's books, as the check reads them


def test_the_books_command_says_why_it_cannot_count(tmp_path, monkeypatch, capsys):
    """`python -m services.trainer.books` (run in the trainer container by the check): exit 2 with the reason
    when there is no REDIS_URL or no checkpoint, never a traceback or a report that passes."""
    from services.trainer import books

    monkeypatch.delenv("REDIS_URL", raising=False)
    assert books.main(["--run-dir", str(tmp_path)]) == 2
    assert "REDIS_URL" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(compose_check.check_config()))
    monkeypatch.setenv("REDIS_URL", "redis://:pw-0123456789@127.0.0.1:1/0")
    assert books.main(["--run-dir", str(tmp_path / "run"), "--config", str(config)]) == 2
    assert "trainer_state.json" in capsys.readouterr().err


def test_builds_use_a_docker_cli_that_has_buildkit(tmp_path):
    """Found on the real machine: its docker CLI 28 has no buildx plugin, so `DOCKER_BUILDKIT=1 docker build`
    stops ("BuildKit is enabled but the buildx component is missing"), and the legacy builder cannot do
    RUN --mount. Debian's docker.io CLI (20.10) builds with BuildKit itself: the check picks a CLI that can."""
    def cli(name: str, version: str, buildx: bool) -> str:
        path = tmp_path / name
        path.write_text("#!/bin/sh\n"
                        f'if [ "$1" = buildx ]; then exit {0 if buildx else 1}; fi\n'
                        f'if [ "$1" = version ]; then echo {version}; fi\n')
        path.chmod(0o755)
        return str(path)

    new_without_buildx = cli("docker28", "28.2.2", False)
    old = cli("docker20", "20.10.24+dfsg1", False)
    with_buildx = cli("docker28x", "28.2.2", True)
    assert compose_check.build_cli([new_without_buildx, old]) == old
    assert compose_check.build_cli([with_buildx, old]) == with_buildx
    assert compose_check.build_cli([new_without_buildx, str(tmp_path / "absent")]) is None


def test_a_no_data_reason_must_hold_in_the_runs_records():
    """The Privileged signal panel had no data in the real run: the trainer sets the gauge only for a step
    with turns that played the hint's next command, which the tiny random model never does. The check
    accepts that reason only where metrics.jsonl shows it."""
    holds = compose_check.REASON_HOLDS["opsd_privileged_signal"]
    assert holds([{"privileged_signal": None, "hint_match_turns": 0, "hint_other_turns": 12}] * 3)
    assert not holds([{"privileged_signal": None, "hint_match_turns": 0}, {"privileged_signal": 0.2, "hint_match_turns": 1}])
    assert not holds([])  # no records: nothing shows the reason
    assert set(compose_check.REASON_HOLDS) <= set(compose_check.NO_DATA_REASONS)
