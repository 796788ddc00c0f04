"""The model's tokenizer as every role loads it: its chat template (or `model.chat_template`'s file) and the
ids that end a sampled turn (the template's end of turn and the model's eos ids, issue 34)."""

from __future__ import annotations

import json
from pathlib import Path

from opsd.config import ModelSection
from opsd.models.trust import MODEL_SETTING, UntrustedModelError, check_weight_files, remote_code_refused


def load_tokenizer(cfg: ModelSection, path: Path, setting: str = MODEL_SETTING):
    """The tokenizer of the local model directory `path` (a resolved ``cfg.name``), with the chat template
    of ``cfg.chat_template`` (a Jinja file) in place of its own when set.

    Raises OSError when the tokenizer files cannot be read, ValueError (one line, naming model.chat_template)
    for a template file that cannot be read, is not UTF-8 text or is empty, or a template given inline,
    opsd.models.trust.UntrustedModelError (one line naming `setting`, ``cfg.trust_remote_code``'s name) for a
    tokenizer that needs the directory's own code while that setting is false.
    """
    from transformers import AutoTokenizer

    with remote_code_refused(path, cfg.trust_remote_code, setting):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
    if cfg.chat_template:
        if "{{" in cfg.chat_template or "{%" in cfg.chat_template:
            raise ValueError("model.chat_template is the path of a Jinja file; this looks like the template itself: "
                             "write it to a file and give its path")
        file = Path(cfg.chat_template).expanduser()
        try:
            template = file.read_text(encoding="utf-8")
        except OSError as e:  # missing, a directory, unreadable: name the setting, not only the errno
            raise ValueError(f"model.chat_template {str(file)!r} cannot be read: {e.strerror or e}") from e
        except UnicodeDecodeError as e:  # its own message names neither the file nor the setting
            raise ValueError(f"model.chat_template {str(file)!r} is not a UTF-8 text file ({e.reason} at byte "
                             f"{e.start})") from e
        if not template.strip():  # else refused later as "the tokenizer has no chat template"
            raise ValueError(f"model.chat_template {str(file)!r} is empty")
        tokenizer.chat_template = template
    return tokenizer


def generation_eos_ids(path: Path) -> list[int]:
    """The eos ids of `path`/generation_config.json (an int or a list of ints there); [] without that file, key
    or with null there.

    Raises ValueError (one line) for a file that is not a JSON object or an eos_token_id of another type: read
    by GenerationConfig, a malformed file was skipped as if absent, and 2.7 or true became id 2 or 1.
    """
    file = Path(path) / "generation_config.json"
    if not file.exists():  # the tokenizer's eos decides
        return []
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # a directory, unreadable, not UTF-8, not JSON
        raise ValueError(f"{file} cannot be read as JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids


def turn_stop_ids(cfg: ModelSection, tokenizer, path: Path) -> tuple[int, list[int]]:
    """(end_of_turn_id, stop_ids): the id the chat template closes an assistant turn with, and every id that
    ends a sampled turn (sorted ints).

    By default the stop ids are the template's end of turn plus the eos ids of
    the model's generation_config.json, or the tokenizer's eos when that file
    names none; when generation_config.json names eos ids they must include the
    template's end of turn (else the model would run past the end of its
    turns: Gemma 3's ``<end_of_turn>`` is not its tokenizer's ``<eos>``).
    ``cfg.stop_token_ids`` replaces the default and must hold the template's end of turn. A tokenizer
    without a chat template (a benchmark's stand-in; `check_chat_model` refuses it for a run) ends turns at its eos. Raises ValueError (one
    line) for an id outside the vocabulary (model.stop_token_ids or
    generation_config.json's), a disagreement, a generation_config.json that
    cannot be read, or a template that cannot be served (ChatTemplateError).
    """
    from opsd.chat import ChatFormat

    vocab = len(tokenizer)
    if getattr(tokenizer, "chat_template", None):
        end = ChatFormat(tokenizer, "action", template_kwargs=cfg.chat_template_kwargs).end_of_turn_id
    elif tokenizer.eos_token_id is not None:  # no template (a benchmark's stand-in): nothing to chat, eos ends
        end = int(tokenizer.eos_token_id)
    else:
        raise ValueError("the tokenizer has neither a chat template nor an eos token: set model.chat_template")
    name = tokenizer.convert_ids_to_tokens(end)
    if cfg.stop_token_ids:
        bad = [i for i in cfg.stop_token_ids if i >= vocab]
        if bad:
            raise ValueError(f"model.stop_token_ids {bad} are outside the tokenizer's {vocab} ids")
        stops = sorted(set(cfg.stop_token_ids))
        if end not in stops:  # the model would write past the end of its turn into the next one
            raise ValueError(f"model.stop_token_ids {cfg.stop_token_ids} lack the chat template's end of turn {name!r} "
                             f"(id {end}): add it")
        return end, stops
    eos = generation_eos_ids(path)
    bad = [i for i in eos if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"generation_config.json's eos_token_id {bad} are outside the tokenizer's {vocab} ids")
    if eos and end not in eos:
        raise ValueError(
            f"the chat template ends a turn with {name!r} (id {end}) but generation_config.json's eos_token_id is "
            f"{eos}: the model may not stop at the end of a turn; set model.stop_token_ids (e.g. {sorted({end, *eos})})")
    if not eos and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    return end, sorted({end, *eos})


def check_chat_model(cfg: ModelSection, env_cfg, path: Path) -> None:
    """Refuse, before any role starts, a model whose tokenizer, chat template (for `env_cfg`'s prompt format and
    action tags) or stop ids opsd cannot serve, that needs its own Python code while model.trust_remote_code is
    false, or whose weights are no safetensors files (`opsd.models.trust`). Loads the tokenizer and the config
    from the local model directory `path`.

    Raises ValueError with one line: ``model 'NAME': <the first problem>`` (UntrustedModelError, a ValueError,
    for the directory's own code or pickle weights: its code never runs).
    """
    from transformers import AutoConfig

    from opsd.chat import ChatFormat

    setting = "model.trust_remote_code"
    try:
        tokenizer = load_tokenizer(cfg, path, setting)
        with remote_code_refused(path, cfg.trust_remote_code, setting):  # the architecture's code, before any role
            AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        check_weight_files(path)
        ChatFormat.for_env(tokenizer, env_cfg, cfg)
        turn_stop_ids(cfg, tokenizer, path)
    except Exception as e:  # a boundary check: whatever transformers or the template raise becomes one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise (UntrustedModelError if isinstance(e, UntrustedModelError) else ValueError)(
            f"model {cfg.name!r}: {first}") from e
