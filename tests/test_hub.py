"""Hugging Face Hub ids as model names (opsd/models/hub.py), offline: a tiny model laid out in a temporary HF_HOME
exactly as huggingface_hub's cache holds a download (tests/hub_cache.py), resolved by huggingface_hub itself.

huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so every resolution runs in a subprocess
with the test's environment. The Hub's answers (no such repository or revision, gated, down) come from a
stand-in HTTP server at HF_ENDPOINT: huggingface_hub's own client and error mapping run unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from opsd.config import ModelSection, RunConfig, config_hash, hashed_config
from tests.hub_cache import cache_model

REPO = Path(__file__).resolve().parents[1]
ID = "opsd-test/tiny-random"
MAIN = hashlib.sha1(b"main").hexdigest()  # refs/main
OLD = hashlib.sha1(b"v1.0").hexdigest()  # refs/v1.0, a tag
SHADOWED = "opsd-test/shadowed"  # in the cache and also a local directory of that name
NO_WEIGHTS = "opsd-test/no-weights"
DANGLING = "opsd-test/dangling"  # its model.safetensors links to a blob that is gone


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A HF_HOME whose hub cache holds ID at MAIN (refs/main) and OLD (refs/v1.0, a tag), SHADOWED, and
    NO_WEIGHTS (config and tokenizer only): the packaged tiny-random model's files (~13 MB)."""
    from opsd.models.hf import ensure_model

    home = tmp_path_factory.mktemp("hf-home")
    src = ensure_model(ModelSection(name="tiny-random"))
    cache_model(home, ID, src, MAIN, refs=("main",))
    cache_model(home, ID, src, OLD, refs=("v1.0",))
    cache_model(home, SHADOWED, src, MAIN, refs=("main",))
    cache_model(home, NO_WEIGHTS, src, MAIN, refs=("main",), files=("config.json", "tokenizer.json", "tokenizer_config.json"))
    snapshot = cache_model(home, DANGLING, src, MAIN, refs=("main",))
    (snapshot / "model.safetensors").resolve().unlink()
    return home


def hub_env(hf_home: Path, offline: bool = True, **extra: str) -> dict[str, str]:
    """os.environ with HF_HOME set to `hf_home`, HF_HUB_OFFLINE=1 (or unset), no HF_HUB_CACHE or HF_TOKEN of the
    machine's, and this checkout first on PYTHONPATH (the subprocesses may run in another directory)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                        "HF_ENDPOINT", "REDIS_URL")}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **extra,
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


RESOLVE = """
import json, os, sys
from opsd.config import ModelSection
from opsd.models.hub import resolve_model
print(json.dumps({"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE")}))  # after importing opsd.models
for line in sys.stdin:
    case = json.loads(line)
    try:
        print(json.dumps({"ok": resolve_model(ModelSection(**case["model"]), case["what"]).record()}))
    except (ValueError, OSError) as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def resolve_all(cases: list[dict], env: dict[str, str], cwd: Path = REPO) -> tuple[str | None, list[dict]]:
    """resolve_model of each ModelSection field dict in `cases` (with "what": the section's name in messages,
    default "model"), in one subprocess with `env`: (its HF_HUB_OFFLINE after importing opsd.models,
    [{"ok": record} or {"error": class name, "message": str}] in order)."""
    stdin = "".join(json.dumps({"model": {k: v for k, v in c.items() if k != "what"}, "what": c.get("what", "model")})
                    + "\n" for c in cases)
    proc = subprocess.run([sys.executable, "-c", RESOLVE], input=stdin, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, *rest = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rest) == len(cases), proc.stdout + proc.stderr[-3000:]
    return first["HF_HUB_OFFLINE"], rest


def one_line_refusal(result: dict, name: str, revision: str, why: str, kind: str = "ModelUnavailableError") -> str:
    """The message of a refused resolution, checked: its class, one line, the id, the revision, the reason and
    the command that fetches it."""
    assert result.get("error") == kind, result
    message = result["message"]
    assert "\n" not in message, message
    assert f"'{name}' revision '{revision}'" in message and why in message, message
    assert f"hf download {name} --revision {revision}` (or run `opsd prepare CONFIG` online" in message, message
    return message


def test_a_hub_id_resolves_from_the_cache_offline(hf_home, tmp_path):
    snapshots = hf_home / "hub" / f"models--{ID.replace('/', '--')}" / "snapshots"
    local = tmp_path / SHADOWED  # a local directory wins over the Hub id of the same name, as in from_pretrained
    local.mkdir(parents=True)
    (local / "config.json").write_text((snapshots / MAIN / "config.json").read_text())
    offline, results = resolve_all([
        {"name": ID, "revision": MAIN}, {"name": ID}, {"name": ID, "revision": "v1.0"},
        {"name": SHADOWED}, {"name": SHADOWED, "revision": "main"},
        {"name": "tiny-random"}, {"name": "tiny-random", "revision": "main"}, {"name": "no-such-model"},
    ], hub_env(hf_home), cwd=tmp_path)
    assert offline == "1"
    pinned, default, tag, shadowed, shadowed_rev, packaged, packaged_rev, nothing = results
    assert pinned == {"ok": {"name": ID, "revision": MAIN, "commit": MAIN, "path": str(snapshots / MAIN)}}
    assert default == {"ok": {"name": ID, "revision": "main", "commit": MAIN, "path": str(snapshots / MAIN)}}
    assert tag == {"ok": {"name": ID, "revision": "v1.0", "commit": OLD, "path": str(snapshots / OLD)}}
    assert shadowed == {"ok": {"name": SHADOWED, "revision": None, "commit": None, "path": SHADOWED}}
    # A revision cannot be applied to a local directory or a packaged model: refused, not silently ignored.
    assert shadowed_rev["error"] == "ValueError" and "drop model.revision" in shadowed_rev["message"], shadowed_rev
    assert packaged["ok"]["commit"] is None and packaged["ok"]["revision"] is None
    assert Path(packaged["ok"]["path"]).name == "tiny-random-v1" and Path(packaged["ok"]["path"], "config.json").is_file()
    assert packaged_rev["error"] == "ValueError" and "is a packaged model" in packaged_rev["message"], packaged_rev
    assert nothing["error"] == "FileNotFoundError" and "nor a Hugging Face Hub id (org/name)" in nothing["message"]


def test_what_cannot_be_had_offline_is_one_line_naming_id_revision_and_fetch_command(hf_home):
    _, results = resolve_all([
        {"name": ID, "revision": "v9"}, {"name": ID, "revision": "0" * 40}, {"name": "opsd-test/absent"},
        {"name": NO_WEIGHTS}, {"name": "opsd-test/absent", "what": "teacher.model"}, {"name": DANGLING},
    ], hub_env(hf_home))
    missing_rev, missing_commit, missing_repo, no_weights, teacher, dangling = results
    cache = f"({hf_home / 'hub'})"
    why = f"HF_HUB_OFFLINE is set and the revision is not in the Hugging Face cache {cache}"
    message = one_line_refusal(missing_rev, ID, "v9", why + " (it holds main, v1.0)")
    assert "fetch it with `HF_HUB_OFFLINE=0 hf download opsd-test/tiny-random --revision v9` (or run `opsd prepare" in message
    one_line_refusal(missing_commit, ID, "0" * 40, why)
    one_line_refusal(missing_repo, "opsd-test/absent", "main", why)
    message = one_line_refusal(no_weights, NO_WEIGHTS, "main", "has no safetensors weights (*.safetensors; pickle "
                               "weights such as pytorch_model*.bin are never loaded)")
    assert "fetch it with `HF_HUB_OFFLINE=0 hf download" in message, message
    # A snapshot link whose blob is gone is refused here, not when a role loads the weights.
    one_line_refusal(dangling, DANGLING, "main", "links model.safetensors to a missing file")
    # The teacher's section names itself.
    assert teacher["message"].startswith("teacher.model 'opsd-test/absent' revision 'main' is not available"), teacher


class StandinHub(BaseHTTPRequestHandler):
    """The Hub's error answers, by repository: missing (404 RepoNotFound), gated (403 GatedRepo), revision v9
    of any repository (404 RevisionNotFound); anything else 501 (a server error huggingface_hub does not retry
    with backoff, unlike 500: the test takes a second, not half a minute)."""

    requests: list[str] = []  # every path asked for, in order

    def do_GET(self) -> None:
        self.requests.append(self.path)
        if "/opsd-test/missing" in self.path:
            status, code = 404, "RepoNotFound"
        elif "/opsd-test/gated" in self.path:
            status, code = 403, "GatedRepo"
        elif "/revision/v9" in self.path:
            status, code = 404, "RevisionNotFound"
        else:
            status, code = 501, None
        body = b'{"error": "stand-in"}'
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def standin_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandinHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_hubs_refusals_map_to_one_line_and_a_down_hub_falls_back_to_the_cache(hf_home, standin_hub):
    offline, results = resolve_all([
        {"name": ID}, {"name": ID, "revision": MAIN}, {"name": ID, "revision": "v9"}, {"name": "opsd-test/missing"},
        {"name": "opsd-test/gated"}, {"name": "opsd-test/down"},
    ], hub_env(hf_home, offline=False, HF_ENDPOINT=standin_hub))
    assert offline is None  # opsd no longer forces HF_HUB_OFFLINE: it is the user's to set
    cached, pinned, missing_rev, missing_repo, gated, down = results
    assert cached["ok"]["commit"] == pinned["ok"]["commit"] == MAIN  # the Hub failed: the cache serves
    one_line_refusal(missing_rev, ID, "v9", "the repository has no revision 'v9'")
    one_line_refusal(missing_repo, "opsd-test/missing", "main", "the Hub has no such repository")
    one_line_refusal(gated, "opsd-test/gated", "main", "gated: accept its terms on its Hub page, then set HF_TOKEN")
    one_line_refusal(down, "opsd-test/down", "main", "no answer from the Hub (HfHubHTTPError: Server error '501 Not Implemented'")


def test_a_pinned_commit_in_the_cache_asks_the_hub_nothing(hf_home, standin_hub):
    """Every role of a run loads its pinned commit: with the snapshot complete in the cache, no role waits on a
    Hub call (online, where a main or a tag is still asked for, as from_pretrained asks)."""
    StandinHub.requests.clear()
    _, (pinned,) = resolve_all([{"name": ID, "revision": MAIN}], hub_env(hf_home, offline=False, HF_ENDPOINT=standin_hub))
    assert pinned["ok"]["commit"] == MAIN and StandinHub.requests == []
    _, (tag,) = resolve_all([{"name": ID, "revision": "v1.0"}], hub_env(hf_home, offline=False, HF_ENDPOINT=standin_hub))
    assert tag["ok"]["commit"] == OLD and StandinHub.requests  # asked (501), then served from the cache


def test_only_what_a_model_needs_is_fetched():
    """The download patterns, through huggingface_hub's own filter: config, tokenizer, template, code and
    safetensors weights; never pickle weights (.bin: unpickling can run code), GGUF, ONNX, subfolders or
    consolidated copies."""
    from huggingface_hub.utils import filter_repo_objects

    from opsd.models.hub import MODEL_FILES, SAFETENSORS, SKIPPED

    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "modeling_custom.py",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.safetensors", "model.gguf",
             "onnx/model.onnx", "original/consolidated.00.pth", "gguf/model.safetensors", "README.md", ".gitattributes"]

    def fetched(patterns):
        return set(filter_repo_objects(files, allow_patterns=MODEL_FILES + patterns, ignore_patterns=SKIPPED))

    common = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "modeling_custom.py"}
    assert fetched(SAFETENSORS) == common | {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                             "model.safetensors.index.json"}


def test_revision_and_trust_remote_code_settings():
    from pydantic import ValidationError

    cfg = RunConfig.model_validate({"model": {"name": ID, "revision": "v1.0", "trust_remote_code": True},
                                    "teacher": {"source": "model", "model": {"name": ID}}, "env": {"privileged": "none"}})
    # The teacher's own section decides: it does not inherit the student's trust_remote_code (or revision).
    assert cfg.model.trust_remote_code and not cfg.teacher.model.trust_remote_code and cfg.teacher.model.revision is None
    assert ModelSection().revision is None and ModelSection().trust_remote_code is False
    for bad in ("", "v 1", "main\n", "x" * 256):
        with pytest.raises(ValidationError, match="branch, tag or commit"):
            ModelSection(name=ID, revision=bad)
    assert ModelSection(name=ID, revision="x" * 255).revision == "x" * 255
    # Left out of the resume hash at their defaults (runs from before they existed still resume) in model: and
    # teacher.model: alike; a pinned commit is part of the run's identity.
    plain = RunConfig.model_validate({"teacher": {"source": "model", "model": {"name": "tiny-random"}},
                                      "env": {"privileged": "none"}})
    assert "revision" not in hashed_config(plain)["model"] and "trust_remote_code" not in hashed_config(plain)["teacher"]["model"]
    pinned = plain.model_copy(update={"model": plain.model.model_copy(update={"revision": MAIN})})
    assert config_hash(hashed_config(pinned)) != config_hash(hashed_config(plain))


def test_metrics_readers_take_a_first_line_with_model_records(tmp_path):
    """metrics.jsonl's first line holds dicts (`model`, `teacher_model`): the step line, `opsd inspect`'s series,
    metrics.png and the learning benchmark's reader all take it."""
    from benchmarks.learning import training_records
    from opsd.progress import format_line
    from opsd.inspect.data import metric_series, read_metrics
    from services.trainer.report import append_metrics, plot_metrics

    model = {"name": ID, "revision": "main", "commit": MAIN, "path": "/x"}
    append_metrics(tmp_path, {"step": 0, "model": model, "teacher_model": {**model, "path": None}, "success_rate": 0.5,
                              "loss": 0.1})
    append_metrics(tmp_path, {"step": 1, "success_rate": 1.0, "loss": 0.2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert format_line(lines[0]) == "step 0  success 0.50  loss +0.1000"
    records, bad = read_metrics(tmp_path)
    assert bad == 0 and metric_series(records) == {"success_rate": [[0.0, 0.5], [1.0, 1.0]], "loss": [[0.0, 0.1], [1.0, 0.2]]}
    assert plot_metrics(tmp_path).stat().st_size > 1000
    assert [r["step"] for r in training_records(tmp_path)] == [0, 1]


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opsd.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("where", ["offline", "hub unreachable"])
def test_prepare_and_run_refuse_a_model_that_cannot_be_had_in_one_line(hf_home, tmp_path, where):
    config = tmp_path / "absent.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": "opsd-test/absent", "revision": "v2"}}))
    env = hub_env(hf_home, offline=where == "offline", HF_ENDPOINT="http://127.0.0.1:9")  # port 9: refused
    for command in (["prepare", str(config)], ["run", str(config), "--output-dir", str(tmp_path / "runs")]):
        proc = run_cli(command, env, tmp_path)
        out = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == 2 and len(out.splitlines()) == 1, out
        assert out.startswith("error: model 'opsd-test/absent' revision 'v2' is not available: ")
        assert "Traceback" not in out and "hf download opsd-test/absent --revision v2` (or run `opsd prepare CONFIG` online" in out, out
        if where == "hub unreachable":
            assert "no answer from the Hub (ConnectError" in out, out
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made, let alone a role started


def test_prepare_resolves_a_tag_to_its_commit(hf_home, tmp_path):
    config = tmp_path / "tag.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": ID, "revision": "v1.0"}, "env": {"game_pool": 2}}))
    proc = run_cli(["prepare", str(config)], hub_env(hf_home), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model {ID} revision v1.0: commit {OLD}" in proc.stdout, proc.stdout


@pytest.mark.e2e
def test_a_run_on_a_hub_id_pins_its_commit_for_every_role(hf_home, tmp_path):
    """`opsd run` on `model.name: org/name`, revision main, offline from the cache: the four services run a step
    on that snapshot; config.yaml pins the commit; model.json and metrics.jsonl's first line record it."""
    cfg = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    cfg["model"].update(name=ID, revision="main")
    config = tmp_path / "hub.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["run", str(config), "--output-dir", str(tmp_path / "runs")], hub_env(hf_home), REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    snapshot = str(hf_home / "hub" / f"models--{ID.replace('/', '--')}" / "snapshots" / MAIN)
    record = {"name": ID, "revision": "main", "commit": MAIN, "path": snapshot}
    assert RunConfig.load(run_dir / "config.yaml").model.revision == MAIN
    assert json.loads((run_dir / "model.json").read_text()) == {"model": record}
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["model"] == record and "teacher_model" not in first
    assert json.loads((run_dir / "run_summary.json").read_text())["metrics_answered"] == {
        "embedder": True, "rollout": True, "teacher": True, "trainer": True}
