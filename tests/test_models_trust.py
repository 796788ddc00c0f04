"""What a model directory may make opsd run (opsd/models/trust.py, issue 37): its own Python code only with
trust_remote_code, never through a "[y/N]" prompt; its weights only from safetensors, never a pickle file.

The untrusting directories are real: the tiny random model with a config that names an unknown architecture
and a Python file (auto_map) that writes a marker file when it is imported, and the packaged encoder with a
sentence-transformers module of its own. Every load answers with one line naming the setting and leaves no
marker; with the setting true the same directory's code does run (the probe is live).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opsd.config import ModelSection
from opsd.models.hf import ensure_model

ROOT = Path(__file__).resolve().parents[1]
# Imported (transformers copies it to its modules cache first), it writes MARKER into the model directory.
EVIL_CONFIG = """\
from pathlib import Path

Path(MARKER).write_text("the directory's own code ran")

from transformers import PretrainedConfig


class EvilConfig(PretrainedConfig):
    model_type = "opsdevil"
"""
EVIL_POOLING = """\
from pathlib import Path

Path(MARKER).write_text("the directory's own code ran")

import torch


class EvilPooling(torch.nn.Module):
    pass
"""


def _plant(directory: Path, module: str) -> None:
    (directory / "evil.py").write_text(module.replace("MARKER", repr(str(directory / "RAN"))))


@pytest.fixture(scope="module")
def evil_dir(tmp_path_factory) -> Path:
    """The tiny random model whose config.json asks for its own code (auto_map, unknown model_type)."""
    d = tmp_path_factory.mktemp("evil") / "model"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), d)
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="opsdevil", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (d / "config.json").write_text(json.dumps(config))
    _plant(d, EVIL_CONFIG)
    return d


@pytest.fixture(scope="module")
def evil_encoder(tmp_path_factory) -> Path:
    """The packaged all-MiniLM-L6-v2 whose modules.json names a pooling module of its own (evil.py)."""
    from opsd.encoder import encoder_path

    src, d = encoder_path("all-MiniLM-L6-v2"), tmp_path_factory.mktemp("evil-encoder") / "encoder"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "model.safetensors").symlink_to(src / "model.safetensors")  # 90 MB: linked, not copied
    modules = json.loads((d / "modules.json").read_text())
    modules[1]["type"] = "evil.EvilPooling"
    (d / "modules.json").write_text(json.dumps(modules))
    _plant(d, EVIL_POOLING)
    return d


# Every load of an untrusting directory, with the default settings, in a process whose stdin answers "y" to
# any prompt: transformers asked "[y/N]" wherever trust_remote_code was left unset (footprint's config read,
# on `opsd run`'s path), and a "y" ran the directory's code.
PROBE = """\
import json, sys
from pathlib import Path
from opsd.config import EnvSection, ModelSection, RunConfig
model, encoder = Path(sys.argv[1]), Path(sys.argv[2])
out = {}

def attempt(name, call):
    try:
        call()
        out[name] = "loaded"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
    out[name + " ran code"] = (model / "RAN").exists() or (encoder / "RAN").exists()

def footprint():
    from opsd.footprint import run_disk_peak
    run_disk_peak(RunConfig.model_validate({"model": {"name": str(model)}}), model)

def chat():
    from opsd.models.tokenizer import check_chat_model
    check_chat_model(ModelSection(name=str(model)), EnvSection(), model)

def teacher():
    from opsd.models import check_teacher_model
    check_teacher_model(ModelSection(name="tiny-random"), ModelSection(name=str(model)))

def backend():
    from opsd.models import load_backend
    load_backend(ModelSection(name=str(model)), device="cpu")

def embedder():
    from opsd.encoder import Encoder
    Encoder(str(encoder), "cpu")

for name, call in [("footprint", footprint), ("chat", chat), ("teacher", teacher), ("backend", backend),
                   ("embedder", embedder)]:
    attempt(name, call)
from opsd.footprint import model_config
attempt("trusted", lambda: model_config(model, trust_remote_code=True))
print()  # the result on a line of its own, whatever a prompt left on the last one
print(json.dumps(out))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    """This environment without REDIS_URL, transformers' copies of a directory's code under `tmp_path`."""
    return {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "OMP_NUM_THREADS": "1",
            "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}


def test_a_directory_needing_its_own_code_is_refused_in_one_line_and_never_prompts(evil_dir, evil_encoder, tmp_path):
    from opsd.models.trust import MODEL_SETTING

    proc = subprocess.run([sys.executable, "-c", PROBE, str(evil_dir), str(evil_encoder)], input="y\n" * 50,
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env(tmp_path))
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    settings = {"footprint": "model.trust_remote_code", "chat": "model.trust_remote_code",
                "teacher": "teacher.model.trust_remote_code", "backend": MODEL_SETTING,
                "embedder": "embedder.trust_remote_code"}
    for name, setting in settings.items():
        assert out[name].startswith("UntrustedModelError: "), (name, out[name])
        assert "needs its own Python code to load" in out[name] and f"and {setting} is false" in out[name], out[name]
        assert "\n" not in out[name] and out[f"{name} ran code"] is False, (name, out)
    assert out["teacher"].startswith(f"UntrustedModelError: teacher.model '{evil_dir}': ")
    # The probe is live: with the setting true, the same directory's code runs.
    assert out["trusted"] == "loaded" and out["trusted ran code"] is True, out
    (evil_dir / "RAN").unlink()


def test_opsd_run_refuses_a_model_needing_its_own_code_before_anything_starts(evil_dir, tmp_path):
    """`opsd run` asked "[y/N]" (its disk-peak estimate read the config without trust_remote_code) and, answered
    "y", ran the directory's code. Now it stops at its model check: one line, exit 2, no run directory."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    config["model"] = {"name": str(evil_dir)}
    path, runs = tmp_path / "config.yaml", tmp_path / "runs"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(runs)],
                          input="y\n" * 50, capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env(tmp_path))
    # transformers' own warning about the unknown model type may follow: its logger, not opsd's answer.
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip() and
             not line.startswith("[transformers]")]
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: model '{evil_dir}': ") and "model.trust_remote_code is false" in lines[0]
    assert not (evil_dir / "RAN").exists() and not runs.exists()


def _pickle_only(tmp_path: Path) -> Path:
    """The tiny random model with its weights as pytorch_model.bin (a torch.save pickle) instead of safetensors."""
    import torch
    from safetensors.torch import load_file

    d = tmp_path / "pickled"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), d)
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    return d


def test_pickle_only_weights_are_refused_by_the_teacher_check_and_at_load(tmp_path):
    from opsd.config import EnvSection
    from opsd.models import HFBackend, UntrustedModelError, check_teacher_model
    from opsd.models.tokenizer import check_chat_model

    d = _pickle_only(tmp_path)
    line = f"{d} holds its weights as pickle files only (pytorch_model.bin): opsd loads safetensors only"
    with pytest.raises(UntrustedModelError) as e:  # it passed, and failed only when the teacher loaded it
        check_teacher_model(ModelSection(name="tiny-random"), ModelSection(name=str(d)))
    assert str(e.value).startswith(f"teacher.model '{d}': {line}"), e.value
    with pytest.raises(UntrustedModelError, match="^" + re.escape(f"model '{d}': {line}")):
        check_chat_model(ModelSection(name=str(d)), EnvSection(), d)
    with pytest.raises(UntrustedModelError, match="pickle files only"):
        HFBackend(ModelSection(name=str(d)))
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no weight files"):
        check_teacher_model(ModelSection(name="tiny-random"), ModelSection(name=str(d)))


MALFORMED = {  # file -> contents, and what transformers / tokenizers / safetensors raised reading it
    "config.json": "[]",  # TypeError
    "tokenizer_config.json": "[]",  # AttributeError
    "model.safetensors": "",  # safetensors' SafetensorError (not an OSError)
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_model_directory_is_one_fatal_line_never_a_traceback(tmp_path, capsys, name):
    """A role started by compose or k8s (no `opsd run` check before it) on a model directory whose file is
    malformed: the load's TypeError / AttributeError / SafetensorError escaped the role's start as a traceback
    (exit 1, restarted to fail the same way); and the teacher check let the first two out of `opsd run`'s
    one-line path. Now: FATAL_EXIT with one line, and the teacher check's ValueError naming teacher.model."""
    from opsd.models import check_teacher_model
    from opsd.service import FATAL_EXIT, load_worker_backend

    d = tmp_path / "odd"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), d)
    (d / name).write_text(MALFORMED[name])
    with pytest.raises(SystemExit) as exit_:
        load_worker_backend("rollout", None, ModelSection(name=str(d), device="cpu"))
    assert exit_.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert err.startswith("rollout: cannot start: ") and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError) as e:
        check_teacher_model(ModelSection(name="tiny-random"), ModelSection(name=str(d)))
    assert str(d) in str(e.value) and "\n" not in str(e.value), e.value


# -- every load says trust_remote_code; nothing prompts ------------------------------------------------------

# Calls that may import a model directory's own code: each must pass trust_remote_code explicitly.
LOADER_METHODS = {"from_pretrained"}  # on any class
AUTO_METHODS = {"from_config"}  # on an Auto* class (a concrete class has no remote code to resolve)
LOADER_FUNCTIONS = {
    "transformers.pipeline", "sentence_transformers.SentenceTransformer", "vllm.LLM",
    "vllm.engine.arg_utils.AsyncEngineArgs", "vllm.engine.arg_utils.EngineArgs", "datasets.load_dataset",
}
# Calls that read a terminal: a role has none, and an answer typed there must never decide what runs.
PROMPTS = {"input", "getpass.getpass", "huggingface_hub.login", "huggingface_hub.notebook_login",
           "huggingface_hub.interpreter_login"}


def loader_calls(source: str, filename: str = "<snippet>") -> tuple[list[str], list[str]]:
    """(every model-loading call in `source` as "file:line: name", the ones among them without a
    trust_remote_code keyword plus every prompting call). Names are resolved through the file's imports."""
    tree = ast.parse(source, filename)
    origin: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            origin.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                           for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            origin.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    loads, bad = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute):
            receiver = f.value.id if isinstance(f.value, ast.Name) else ""
            is_load = f.attr in LOADER_METHODS or (f.attr in AUTO_METHODS and receiver.startswith("Auto"))
            name = f"{receiver}.{f.attr}"
            if isinstance(f.value, ast.Name) and f"{origin.get(receiver, receiver)}.{f.attr}" in PROMPTS:
                bad.append(f"{filename}:{node.lineno}: {name}() prompts")
        elif isinstance(f, ast.Name):
            name = origin.get(f.id, f.id)
            is_load = name in LOADER_FUNCTIONS
            if name in PROMPTS:
                bad.append(f"{filename}:{node.lineno}: {name}() prompts")
        else:
            continue
        if is_load:
            loads.append(f"{filename}:{node.lineno}: {name}")
            if not any(kw.arg == "trust_remote_code" for kw in node.keywords):
                bad.append(f"{filename}:{node.lineno}: {name}() without trust_remote_code")
    return loads, bad


PLANTED = """\
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, pipeline as pl
from sentence_transformers import SentenceTransformer
import getpass, huggingface_hub as hh
c = AutoConfig.from_pretrained(path)
m = AutoModelForCausalLM.from_config(c)
p = pl("text-generation", model=path)
s = SentenceTransformer(path)
answer = input("run it? ")
pw = getpass.getpass()
hh.login()
ok = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
fine = LlamaForCausalLM.from_config(c)
client.pipeline(transaction=True)
"""


def test_the_scanner_finds_every_planted_load_without_the_setting_and_every_prompt():
    loads, bad = loader_calls(PLANTED)
    assert [int(x.split(":")[1]) for x in loads] == [4, 5, 6, 7, 11]
    assert [int(x.split(":")[1]) for x in bad] == [4, 5, 6, 7, 8, 9, 10], bad


def test_every_model_load_in_opsd_and_services_passes_trust_remote_code_and_nothing_prompts():
    files = [p for d in ("opsd", "services") for p in sorted((ROOT / d).rglob("*.py"))]
    found = [loader_calls(p.read_text(), str(p.relative_to(ROOT))) for p in files]
    loads = [x for f, _ in found for x in f]
    # Not vacuous: the tokenizer, the config (teacher check, vLLM, footprint, chat check), the model, the
    # packaged conversions, the encoder, vLLM's engine, the merged LoRA policy.
    assert len(loads) >= 12, loads
    assert {"AutoTokenizer.from_pretrained", "AutoConfig.from_pretrained", "AutoModelForCausalLM.from_pretrained",
            "AutoModelForCausalLM.from_config", "sentence_transformers.SentenceTransformer",
            "vllm.engine.arg_utils.AsyncEngineArgs"} <= {x.split(": ")[1] for x in loads}, loads
    assert [x for _, b in found for x in b] == []


@pytest.mark.parametrize("change, why", [({"num_hidden_layers": 3}, "missing from its weight files"),
                                         ({"num_hidden_layers": 1}, "not in its config's architecture"),
                                         ({"intermediate_size": 40}, "of another shape")])
def test_a_config_that_does_not_match_its_weights_is_refused(tmp_path, capsys, change, why):
    """config.json saying more layers than the weights hold loaded with those layers at random, and fewer layers
    loaded a truncated model: transformers only logged either (and a wrong shape was a RuntimeError, which a role
    takes for an outage and restarts on). Now one fatal line naming what disagrees."""
    from opsd.service import FATAL_EXIT, load_worker_backend

    d = tmp_path / "odd"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), d)
    config = json.loads((d / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["intermediate_size"] != 40  # the tiny model's
    (d / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SystemExit) as exit_:
        load_worker_backend("teacher", None, ModelSection(name=str(d), device="cpu"))
    assert exit_.value.code == FATAL_EXIT
    err = capsys.readouterr().err
    assert why in err and "config.json and the weights are not the same model" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("content", [b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", b"not safetensors at all"])
def test_a_weights_file_whose_header_does_not_read_is_refused_before_any_role_starts(tmp_path, content):
    """An empty or truncated model.safetensors passed `opsd prepare` / `opsd run` (only the name was checked)
    and every role then failed on it. The header is now read where the name was checked: one line."""
    from opsd.models import check_teacher_model
    from opsd.models.trust import check_weight_files

    d = tmp_path / "odd"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), d)
    check_weight_files(d)  # the intact copy passes
    (d / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="is not a readable safetensors file") as e:
        check_weight_files(d)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        check_teacher_model(ModelSection(name="tiny-random"), ModelSection(name=str(d)))
