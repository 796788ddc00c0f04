"""An HFBackend's weights in: the model from its directory, a state dict, a LoRA adapter, each checked first.

`load_pretrained` loads a model directory with transformers and refuses one
whose weight files and config.json disagree; `load_state_strict` copies a
full state dict into a live model (the trainer's checkpoints and EMA use it
too); `merge_adapter` writes base + LoRA delta into the targeted weights
(`HFBackend.load_weights` keeps the base and the adapter state).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from opsd.config import ModelSection


def load_pretrained(cfg: ModelSection, path: Path, weights_dtype: torch.dtype):
    """The causal LM of the model directory `path` (model `cfg`), its weights in `weights_dtype`, on the CPU.

    Raises opsd.models.trust.UntrustedModelError (a ValueError) for a directory that needs its own Python code
    while ``cfg.trust_remote_code`` is false or has pickle weights only; ValueError when its weight files and
    config.json disagree (`_check_loading_info`)."""
    from transformers import AutoModelForCausalLM

    from opsd.models.trust import check_weight_files, remote_code_refused

    check_weight_files(path, f"model {cfg.name!r}")
    # ignore_mismatched_sizes: a wrong shape comes back in `info` (refused below) instead of a RuntimeError that
    # reads as an outage; transformers' multi-line report of the same keys is left out of the role's log.
    with remote_code_refused(path, cfg.trust_remote_code), _load_report_dropped():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=weights_dtype, local_files_only=True, trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True, output_loading_info=True, ignore_mismatched_sizes=True,
        )
    _check_loading_info(info, f"model {cfg.name!r} ({path})")
    return model


@contextlib.contextmanager
def _load_report_dropped():
    """Drop transformers' "LOAD REPORT" warning (a table of the keys `_check_loading_info` refuses in one line)."""
    log = logging.getLogger("transformers.modeling_utils")
    def drop(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _check_loading_info(info: dict, what: str) -> None:
    """Refuse a checkpoint whose weight files and config.json disagree: weights the architecture needs but the
    files lack (transformers initialises them at random, with only a log line) or tensors the architecture has
    no place for (left out: e.g. a config with fewer layers than the weights). `info` is from_pretrained's
    `output_loading_info`; tied and ignorable keys are already left out of it. Raises ValueError."""
    for key, why in (("missing_keys", "missing from its weight files (they would be initialised at random)"),
                     ("unexpected_keys", "in its weight files but not in its config's architecture (they would be dropped)"),
                     ("mismatched_keys", "of another shape in its weight files than its config says")):
        names = sorted(k if isinstance(k, str) else str(k[0]) for k in info.get(key) or ())  # mismatched: (key, ...)
        if names:
            raise ValueError(f"{what}: {len(names)} weights {why}, e.g. {', '.join(names[:3])}: "
                             f"config.json and the weights are not the same model")


def load_state_strict(model: torch.nn.Module, loaded: dict[str, torch.Tensor], source: str) -> None:
    """Copy the tensors `loaded` into `model` in place, checking everything before touching a weight.

    `loaded` must hold every parameter/buffer of the model with the same
    shape and dtype, finite values, and no other key; a tied tensor (LM head = embedding) may be stored
    once under either name, or under both with equal values. Raises KeyError
    (missing/unexpected keys) or ValueError (shape, dtype or tie mismatch, NaN/inf), naming
    `source`; the model is then unchanged.
    """
    own = model.state_dict()
    unexpected = sorted(set(loaded) - set(own))
    # Names sharing storage in the live model (tied weights) form one group.
    groups: dict[int, list[str]] = {}
    for name, t in own.items():
        groups.setdefault(t.data_ptr(), []).append(name)
    full: dict[str, torch.Tensor] = {}
    missing = []
    for names in groups.values():
        present = [n for n in names if n in loaded]
        if not present:
            missing.extend(names)
            continue
        for n in present[1:]:
            if not torch.equal(loaded[n], loaded[present[0]]):
                raise ValueError(f"{source}: tied tensors {present[0]} and {n} differ")
        for n in names:
            full[n] = loaded[present[0]]
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing}, unexpected {unexpected}")
    bad = [n for n, t in full.items() if t.shape != own[n].shape]
    if bad:
        raise ValueError(f"{source}: shape mismatch for {bad}")
    # load_state_dict would cast an int or half file silently, and a NaN weight poisons every answer.
    bad = [n for n, t in full.items() if t.dtype != own[n].dtype]
    if bad:
        raise ValueError(f"{source}: dtype differs from the model's for {bad[:5]} ({full[bad[0]].dtype} vs {own[bad[0]].dtype})")
    from opsd.weights_io import all_finite

    bad = [n for n, t in full.items() if not all_finite(t)]
    if bad:
        raise ValueError(f"{source}: non-finite values in {bad[:5]}")
    model.load_state_dict(full, strict=True)  # copies in place: ties survive


def merge_adapter(adapter, base: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> None:
    """Write base + adapter (or the base alone when `adapter` is None) into `params`, weight by weight."""
    from opsd.lora import merge_one

    for name, w0 in base.items():
        p = params[name]
        if adapter is None:
            p.copy_(w0)
            continue
        m = name[: -len(".weight")]
        p.copy_(merge_one(w0.to(p.device), adapter.tensors[m + ".lora_A.weight"], adapter.tensors[m + ".lora_B.weight"],
                          adapter.scale))
