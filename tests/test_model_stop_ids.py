"""Stop ids, template overrides and the check before anything starts (issue 34), on real tokenizer files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import GenerationConfig

from opsd.config import EnvSection, ModelSection
from opsd.models.hf import ensure_model
from opsd.models.tokenizer import check_chat_model, load_tokenizer, turn_stop_ids
from tests.tokenizer_families import family_or_skip

ROOT = Path(__file__).resolve().parents[1]


def _model_dir(tmp_path: Path, eos) -> Path:
    """A directory holding only a generation_config.json with these eos ids (all turn_stop_ids reads there)."""
    GenerationConfig(eos_token_id=eos).save_pretrained(tmp_path)
    return tmp_path


def test_gemma3_stops_at_end_of_turn_and_eos(tmp_path):
    tok = family_or_skip("gemma3")
    end, stops = turn_stop_ids(ModelSection(), tok, _model_dir(tmp_path, [1, 106]))
    assert (end, stops) == (106, [1, 106])  # <end_of_turn>, not only the tokenizer's <eos>


def test_a_generation_config_without_the_end_of_turn_is_refused(tmp_path):
    tok = family_or_skip("gemma3")
    with pytest.raises(ValueError, match=r"ends a turn with '<end_of_turn>' \(id 106\).*\[1\].*stop_token_ids"):
        turn_stop_ids(ModelSection(), tok, _model_dir(tmp_path, 1))
    # The user confirms the ids: accepted as given.
    end, stops = turn_stop_ids(ModelSection(stop_token_ids=[106, 1]), tok, tmp_path)
    assert (end, stops) == (106, [1, 106])


def test_llama3_stop_ids_from_generation_config(tmp_path):
    tok = family_or_skip("llama3.1")
    # Llama-3.1-8B-Instruct's generation_config: <|end_of_text|>, <|eom_id|>, <|eot_id|>.
    end, stops = turn_stop_ids(ModelSection(), tok, _model_dir(tmp_path, [128001, 128008, 128009]))
    assert (end, stops) == (128009, [128001, 128008, 128009])


def test_stop_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    tok = family_or_skip("smollm2")
    with pytest.raises(ValueError, match="outside the tokenizer's 49152 ids"):
        turn_stop_ids(ModelSection(stop_token_ids=[2, 10**6]), tok, tmp_path)


def test_chat_template_file_replaces_the_tokenizers(tmp_path):
    phi = family_or_skip("phi3.5")
    template = tmp_path / "phi.jinja"
    template.write_text(phi.chat_template)
    src = ensure_model(ModelSection())  # SmolLM2's tokenizer, rendered with Phi-3.5's template
    cfg = ModelSection(name=str(src), chat_template=str(template))
    tok = load_tokenizer(cfg, src)
    assert tok.chat_template == phi.chat_template
    # <|end|> is not a token of SmolLM2's vocabulary: the template cannot end a turn with a special token.
    with pytest.raises(ValueError, match=r"^model '.*': assistant turns must end with a special token"):
        check_chat_model(cfg, EnvSection(), src)


@pytest.mark.parametrize("command", ["prepare", "run"])
def test_prepare_and_run_refuse_a_model_they_cannot_serve_in_one_line(tmp_path, command):
    """`opsd prepare` / `opsd run` on a model whose template has no end-of-turn special token: one line, exit 2,
    and `opsd run` leaves no run directory."""
    model = tmp_path / "model"
    shutil.copytree(ensure_model(ModelSection(name="tiny-random")), model)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant: {% endif %}")
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    config["model"] = {"name": str(model), "chat_template": str(bad)}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    runs = tmp_path / "runs"
    extra = ["--output-dir", str(runs)] if command == "run" else []
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", command, str(path), *extra], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: model '{model}'"), out
    assert "assistant turns must end with a special token" in lines[0]
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot be read as JSON"),
    ("", "cannot be read as JSON"),  # an empty file
    ("[1, 2]", "is not a JSON object"),
    ('{"eos_token_id": "2"}', "must be a token id or a list of them"),
    ('{"eos_token_id": [[2, 1]]}', "must be a token id or a list of them"),
    ('{"eos_token_id": true}', "must be a token id or a list of them"),  # was id 1
    ('{"eos_token_id": 2.7}', "must be a token id or a list of them"),  # was id 2
    ('{"eos_token_id": [2, -1]}', r"eos_token_id \[-1\] are outside the tokenizer's 49152 ids"),  # was a stop id
    ('{"eos_token_id": [2, 99999999]}', r"eos_token_id \[99999999\] are outside"),
])
def test_a_bad_generation_config_is_refused_in_one_line(tmp_path, text, match):
    """A malformed generation_config.json was skipped as if absent (its eos ids lost); odd eos values became ids."""
    tok = family_or_skip("smollm2")
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        turn_stop_ids(ModelSection(), tok, tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": null}')  # null: the tokenizer's eos
    assert turn_stop_ids(ModelSection(), tok, tmp_path) == (2, [2])


@pytest.mark.parametrize("data, match", [
    (b"\xff\xfe{{ messages }}", r"model.chat_template '.*bad.jinja' is not a UTF-8 text file"),
    (b"", r"model.chat_template '.*bad.jinja' is empty"),  # was "the tokenizer has no chat template"
    (b" \n", r"model.chat_template '.*bad.jinja' is empty"),
])
def test_an_unusable_chat_template_file_is_named(tmp_path, data, match):
    template = tmp_path / "bad.jinja"
    template.write_bytes(data)
    src = ensure_model(ModelSection())
    cfg = ModelSection(name=str(src), chat_template=str(template))
    with pytest.raises(ValueError, match="^model '.*': " + match):
        check_chat_model(cfg, EnvSection(), src)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "chat_template", "messages"])
def test_chat_template_kwargs_cannot_be_apply_chat_template_arguments(key):
    with pytest.raises(ValueError, match=rf"chat_template_kwargs \['{key}'\] are arguments of apply_chat_template"):
        ModelSection(chat_template_kwargs={key: "x"})
    kwargs = {"enable_thinking": False}  # a template variable (Qwen3's)
    assert ModelSection(chat_template_kwargs=kwargs).chat_template_kwargs == kwargs


@pytest.mark.parametrize("setting, match", [
    ("{{ 'missing' }}", r"model.chat_template is the path of a Jinja file; this looks like the template itself"),
    ("missing.jinja", r"model.chat_template '.*missing.jinja' cannot be read: No such file or directory"),
    (".", r"model.chat_template '.' cannot be read: Is a directory"),
])
def test_a_chat_template_setting_that_is_no_readable_file_is_named(tmp_path, monkeypatch, setting, match):
    monkeypatch.chdir(tmp_path)
    src = ensure_model(ModelSection())
    with pytest.raises(ValueError, match="^model '.*': " + match):
        check_chat_model(ModelSection(name=str(src), chat_template=setting), EnvSection(), src)


def test_stop_token_ids_must_hold_the_templates_end_of_turn(tmp_path):
    tok = family_or_skip("smollm2")
    with pytest.raises(ValueError, match=r"stop_token_ids \[0\] lack the chat template's end of turn '<\|im_end\|>' "
                                         r"\(id 2\): add it"):
        turn_stop_ids(ModelSection(stop_token_ids=[0]), tok, tmp_path)
    assert turn_stop_ids(ModelSection(stop_token_ids=[0, 2]), tok, tmp_path) == (2, [0, 2])


def test_a_relative_chat_template_path_is_made_absolute_for_every_role(tmp_path, monkeypatch):
    from opsd.config import RunConfig
    from opsd.models.hub import resolve_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "own.jinja").write_text("x")
    cfg = RunConfig.model_validate({"model": {"name": "tiny-random", "chat_template": "own.jinja"}})
    resolve_run(cfg)
    assert cfg.model.chat_template == str(tmp_path / "own.jinja")
