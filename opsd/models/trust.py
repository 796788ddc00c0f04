"""What a model directory may make opsd run.

Its own Python code (a custom architecture, tokenizer or sentence-transformers module, named by auto_map or
modules.json) runs only when the config says so: every load passes ``trust_remote_code`` explicitly (a
section's setting, False by default), so transformers never asks "[y/N]" on a terminal, and its refusal
becomes one line naming the setting (`remote_code_refused`). Weights load only from safetensors files:
unpickling a pytorch_model.bin or *.pt file can run code (`check_weight_files`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

# The setting that decides for a ModelSection (a load that does not know which section it serves names both).
MODEL_SETTING = "model.trust_remote_code (teacher.model.trust_remote_code for an external teacher)"
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class UntrustedModelError(ValueError):
    """A model directory that needs what opsd was not told to trust: its own Python code, or pickle weights.

    One line; a restart cannot fix it (the config or the directory must change)."""


@contextlib.contextmanager
def remote_code_refused(path, trusted: bool, setting: str = MODEL_SETTING):
    """Run a transformers / sentence-transformers load of the model directory `path` whose trust_remote_code
    is `trusted`; when it is False, their refusal to run the directory's own code becomes one line naming
    `setting` (e.g. "embedder.trust_remote_code").

    Raises UntrustedModelError from that refusal (a ValueError of theirs that asks for
    ``trust_remote_code=True``); any other error passes unchanged.
    """
    try:
        yield
    except ValueError as e:
        if trusted or "trust_remote_code" not in str(e) or isinstance(e, UntrustedModelError):
            raise
        raise UntrustedModelError(
            f"{path} needs its own Python code to load (a custom architecture, tokenizer or module: auto_map or "
            f"modules.json) and {setting} is false: refused, nothing of it ran; set it to true only for a model "
            "whose code you have read and trust") from e


def check_weight_files(path: Path, what: str | None = None) -> None:
    """Refuse the model directory `path` unless its weights are safetensors files (*.safetensors at its top
    level, as from_pretrained reads them); `what` starts the message when given (e.g. "teacher.model 'x'").

    Raises UntrustedModelError when its weights are pickle files only (PICKLE_WEIGHTS: loading one unpickles
    it, which can run code), ValueError when it holds no weight file at all or one whose header does not read
    (empty, truncated, not safetensors: only the header is read). One line each.
    """
    from safetensors import safe_open

    path, lead = Path(path), f"{what}: " if what else ""
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with safe_open(f, "pt") as weights:
                weights.keys()
        except Exception as e:  # noqa: BLE001 - SafetensorError is no OSError; a directory or dangling link is one
            raise ValueError(f"{lead}{f} is not a readable safetensors file ({f.stat().st_size if f.is_file() else 0} "
                             f"bytes: empty, truncated or another format): {str(e).splitlines()[0][:200]}") from None
    if files:
        return
    pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
    if pickles:
        raise UntrustedModelError(
            f"{lead}{path} holds its weights as pickle files only ({', '.join(pickles[:3])}): opsd loads "
            "safetensors only (unpickling can run code); convert them to safetensors where you trust them "
            "(save_pretrained writes model.safetensors)")
    raise ValueError(f"{lead}no weight files (*.safetensors) in {path}")
