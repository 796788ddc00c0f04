"""LoRA for the policy (`trainer.lora`): the trainer trains adapters with peft, workers merge them.

Adapter file ("opsd-lora", safetensors; the trainer publishes it at the
version's usual `opsd.weights.weights_path`):
  tensors   "<module>.lora_A.weight" [r, in_features] and "<module>.lora_B.weight"
            [out_features, r], float32, for every adapted module. <module> is the
            module's path in the transformers model, so its base weight is
            "<module>.weight" (e.g. model.layers.0.self_attn.q_proj.weight).
  metadata  format "opsd-lora", rank (int), alpha (float), target_modules (JSON
            list of plain module names), policy_version (int); all strings.

Every module of the model named in target_modules is in the file (a file
missing one is refused, not half-applied). The merged weight is peft's merge:
W = W0 + (B @ A) * (alpha / rank), always on top of the ORIGINAL base W0 (the
model at version 0), never on a previous version's merged weight.

peft is imported only by `apply_lora` (the trainer): workers merge without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "opsd-lora"
_A, _B = ".lora_A.weight", ".lora_B.weight"
_PEFT_ADAPTER = "default"  # peft's name of the one adapter get_peft_model creates


class AdapterError(ValueError):
    """An adapter file that cannot be applied: bad metadata, names, shapes, dtypes or values."""


@dataclass
class Adapter:
    """A validated adapter file.

    rank: r >= 1; alpha: > 0 (scale = alpha / rank); target_modules: plain
    module names; policy_version: the version it was published as;
    tensors: "<module>.lora_A.weight" float [r, in] and "<module>.lora_B.weight"
    float [out, r] (CPU), both present for every module in `modules`; digest: the content digest of the
    tensors as read (`opsd.weights_io.iter_tensors`, checked against the file's record), None when not read
    from a file.
    """

    rank: int
    alpha: float
    target_modules: list[str]
    policy_version: int
    tensors: dict[str, torch.Tensor]
    digest: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        """Adapted module paths, sorted."""
        return sorted(k[: -len(_A)] for k in self.tensors if k.endswith(_A))


# ---------------------------------------------------------------------------
# Trainer side


def apply_lora(model: torch.nn.Module, section) -> torch.nn.Module:
    """Add LoRA adapters (peft) to `model` IN PLACE; returns the peft wrapper (`peft.PeftModel`).

    `section` is an `opsd.config.LoRASection`. Every nn.Linear whose module
    name (last part of its path) is in section.target_modules gets A [r, in]
    (peft's Kaiming init, from the global torch RNG) and B [out, r] = 0, so the
    model computes exactly what it did. Afterwards only A and B require grad;
    `model` itself (not the wrapper) stays what the trainer trains and
    checkpoints: its state dict holds "<module>.base_layer.weight" and
    "<module>.lora_{A,B}.default.weight" instead of "<module>.weight".
    Raises ValueError when a target name matches no module, matches a module
    that is not an nn.Linear, or a weight tied to another parameter (a merge
    would change both), or when the model already has adapters.
    """
    import peft  # heavy (seconds): only the trainer with LoRA on needs it

    if is_lora_model(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    targets = set(section.target_modules)
    found = {t: 0 for t in targets}
    ptrs: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        ptrs[p.data_ptr()] = ptrs.get(p.data_ptr(), 0) + 1
    for name, mod in model.named_modules():
        last = name.rpartition(".")[2]
        if last not in targets:
            continue
        if type(mod) is not torch.nn.Linear:
            raise ValueError(f"apply_lora: {name} is a {type(mod).__name__}, only nn.Linear modules can be targeted")
        if ptrs[mod.weight.data_ptr()] > 1:
            raise ValueError(f"apply_lora: {name}.weight is tied to another parameter; it cannot take an adapter")
        found[last] += 1
    unused = sorted(t for t, n in found.items() if n == 0)
    if unused:
        raise ValueError(f"apply_lora: target_modules {unused} match no module of the model")
    config = peft.LoraConfig(
        r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=sorted(targets),
        bias="none", use_rslora=False, init_lora_weights=True,
    )
    return peft.get_peft_model(model, config)


def is_lora_model(model: torch.nn.Module) -> bool:
    """True when `model` holds peft LoRA layers (checked by attribute: no peft import)."""
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(mod: torch.nn.Module) -> bool:
    return hasattr(mod, "base_layer") and isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict)


def adapter_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int, float, list[str]]:
    """The adapter of a model prepared by `apply_lora`: (tensors, rank, alpha, target_modules).

    tensors: "<module>.lora_A.weight" / "<module>.lora_B.weight" (the file's
    names, module paths relative to `model`), detached float32 CPU copies.
    Raises ValueError when the model has no adapters, or layers disagree on
    rank or alpha (opsd never configures per-layer ranks).
    """
    tensors: dict[str, torch.Tensor] = {}
    ranks, alphas, targets = set(), set(), set()
    for name, mod in model.named_modules():
        if not _is_lora_layer(mod):
            continue
        ranks.add(int(mod.r[_PEFT_ADAPTER]))
        alphas.add(float(mod.lora_alpha[_PEFT_ADAPTER]))
        targets.add(name.rpartition(".")[2])
        for key, holder in ((_A, mod.lora_A), (_B, mod.lora_B)):
            tensors[name + key] = holder[_PEFT_ADAPTER].weight.detach().to("cpu", torch.float32, copy=True).contiguous()
    if not tensors:
        raise ValueError("adapter_state_dict: the model has no LoRA adapters")
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"adapter_state_dict: layers disagree on rank {sorted(ranks)} or alpha {sorted(alphas)}")
    return tensors, ranks.pop(), alphas.pop(), sorted(targets)


def save_adapter(model: torch.nn.Module, path: Path, policy_version: int) -> None:
    """Write the adapter of `model` (see `adapter_state_dict`) as an opsd-lora file at `path`, atomically.

    Written by `opsd.weights_io.write_weights` (temp file + rename: a reader
    sees the old file or the complete new one; the metadata records the
    tensors' content digest, `opsd.weights.DIGEST_KEY`). Raises ValueError
    (no adapters) or OSError (write failure; no temp file is left).
    """
    from opsd.weights_io import write_weights

    tensors, rank, alpha, targets = adapter_state_dict(model)
    meta = {"format": FORMAT, "rank": str(rank), "alpha": repr(alpha), "target_modules": json.dumps(targets),
            "policy_version": str(int(policy_version))}
    write_weights(tensors, Path(path), meta)


# ---------------------------------------------------------------------------
# Reading and merging (workers; no peft)


def read_adapter(ref) -> Adapter:
    """Read and check the opsd-lora file `ref` (a path or `opsd.weights_io.open_weights` ref) on its own.

    See `adapter_from_stream` for what is checked. Raises FileNotFoundError
    (missing file), opsd.weights_io.WeightsError (a ValueError) for a file that is no weights file at all
    (empty, a bad header: not an adapter problem), or AdapterError naming the file and problem.
    """
    from opsd.weights_io import open_weights, read_header

    with open_weights(ref) as stream:
        return adapter_from_stream(stream, read_header(stream, str(ref)), str(ref))


def adapter_from_stream(stream, header, source: str) -> Adapter:
    """The adapter whose header `read_header` just read from `stream`; reads its tensors (`iter_tensors`).

    Checked: metadata (format, rank >= 1, finite alpha > 0, target_modules a
    non-empty list of plain names, policy_version >= 0) before any tensor is
    read; tensor names (only "<module>.lora_A.weight" /
    "<module>.lora_B.weight", both for every module, the module's last name
    in target_modules); floating dtypes, shapes A [rank, in], B [out, rank];
    finite values and the recorded digest (`iter_tensors`). Raises
    AdapterError naming `source` and the problem.
    """
    from opsd.weights_io import WeightsError, iter_tensors

    meta = header.metadata

    def bad(what: str) -> AdapterError:
        return AdapterError(f"{source}: {what}")

    if meta.get("format") != FORMAT:
        raise bad(f"metadata format is {meta.get('format')!r}, not {FORMAT!r}")
    missing = [k for k in ("rank", "alpha", "target_modules", "policy_version") if k not in meta]
    if missing:
        raise bad(f"metadata lacks {missing}")
    try:
        rank, alpha, version = int(meta["rank"]), float(meta["alpha"]), int(meta["policy_version"])
        targets = json.loads(meta["target_modules"])
    except ValueError as e:
        raise bad(f"unparsable metadata {meta}: {e}") from e
    if rank < 1 or not (math.isfinite(alpha) and alpha > 0) or version < 0:
        raise bad(f"metadata rank {rank} (>= 1), alpha {alpha} (finite, > 0), policy_version {version} (>= 0) out of range")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t.isidentifier() for t in targets)):
        raise bad(f"metadata target_modules must be a non-empty list of plain module names, got {targets!r}")
    reader = iter_tensors(stream, header, source)
    try:
        tensors = dict(reader)
    except WeightsError as e:
        raise AdapterError(str(e)) from e
    if not tensors:
        raise bad("holds no tensors")
    modules = set()
    for name in tensors:
        if not name.endswith((_A, _B)):
            raise bad(f"tensor {name!r} is not '<module>.lora_A.weight' or '<module>.lora_B.weight'")
        modules.add(name[: -len(_A)])
    for m in sorted(modules):
        if m + _A not in tensors or m + _B not in tensors:
            raise bad(f"module {m} lacks lora_A or lora_B")
        if m.rpartition(".")[2] not in targets:
            raise bad(f"module {m} is not among target_modules {targets}")
        a, b = tensors[m + _A], tensors[m + _B]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise bad(f"module {m}: non-floating dtypes {a.dtype}, {b.dtype}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise bad(f"module {m}: lora_A {list(a.shape)} / lora_B {list(b.shape)} are not [{rank}, in] / [out, {rank}]")
    return Adapter(rank, alpha, targets, version, tensors, reader.digest)


def targeted_weights(names, target_modules) -> list[str]:
    """The names among `names` (parameter names) of weights an adapter with `target_modules` must cover, sorted.

    A weight "<module>.weight" is targeted when <module>'s last name is in target_modules.
    """
    targets = set(target_modules)
    return sorted(n for n in names if n.endswith(".weight") and n[: -len(".weight")].rpartition(".")[2] in targets)


def check_against(adapter: Adapter, shapes: dict[str, torch.Size], source: str = "adapter") -> list[str]:
    """Check that `adapter` fits a model whose parameter shapes are `shapes` (HF names); returns the targeted weight names.

    The adapter's modules must be exactly the modules targeted in `shapes`
    (`targeted_weights`), each a 2-D weight [out, in] with lora_A [r, in]
    and lora_B [out, r]. Raises AdapterError naming `source`.
    """
    want = targeted_weights(shapes, adapter.target_modules)
    have = [m + ".weight" for m in adapter.modules]
    if set(want) != set(have):
        raise AdapterError(
            f"{source}: adapted weights differ from the model's targeted ones: missing {sorted(set(want) - set(have))[:8]}, "
            f"unexpected {sorted(set(have) - set(want))[:8]}"
        )
    for name in want:
        m = name[: -len(".weight")]
        shape, a, b = shapes[name], adapter.tensors[m + _A], adapter.tensors[m + _B]
        if len(shape) != 2 or a.shape[1] != shape[1] or b.shape[0] != shape[0]:
            raise AdapterError(f"{source}: {name} is {list(shape)} but lora_A is {list(a.shape)} and lora_B {list(b.shape)}")
    return want


def merge_one(base_W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """base_W [out, in] + (B [out, r] @ A [r, in]) * scale, computed in float32 on base_W's device; base_W's dtype.

    The order of operations is peft's merge (`merge_and_unload`), so the
    result equals it to rounding. base_W is not modified.
    """
    dev = base_W.device
    delta = (B.to(dev, torch.float32) @ A.to(dev, torch.float32)) * scale
    return (base_W.to(torch.float32) + delta).to(base_W.dtype)


def merged_weights(base_state: dict[str, torch.Tensor], adapter_path: Path) -> dict[str, torch.Tensor]:
    """The merged weights of an adapter file as a dict (the reference for the streamed merge of opsd.models.vllm_worker).

    base_state: the ORIGINAL base weights (version 0), HF parameter names
    (e.g. "model.layers.0.self_attn.q_proj.weight" -> [out, in]); it must
    hold every targeted weight (`targeted_weights(base_state, targets)`,
    i.e. pass the whole base state dict or at least all linear weights of the
    targeted modules). Other entries are ignored; nothing in it is modified.
    Returns {"<module>.weight": W0 + (B @ A) * alpha / rank} for exactly the
    targeted weights (base dtype and device, computed in float32); every
    other weight of the model stays the base weight.
    Raises FileNotFoundError (missing file), opsd.weights_io.WeightsError (no weights file: empty, bad
    header) or AdapterError (a bad adapter, or it does not fit base_state: missing/extra modules, wrong
    shapes), before any merge.
    """
    adapter = read_adapter(adapter_path)
    names = check_against(adapter, {k: v.shape for k, v in base_state.items()}, str(adapter_path))
    out = {}
    for name in names:
        m = name[: -len(".weight")]
        out[name] = merge_one(base_state[name], adapter.tensors[m + _A], adapter.tensors[m + _B], adapter.scale)
    return out


def save_merged(model: torch.nn.Module, tokenizer, directory: Path, trust_remote_code: bool = False) -> None:
    """Save the policy of a LoRA model as a plain transformers model directory (base + adapters merged).

    `model` is prepared by `apply_lora` (peft names: "<m>.base_layer.weight",
    "<m>.lora_{A,B}.default.weight"); the directory holds safetensors weights
    under the model's own names ("<m>.weight" = W0 + (B @ A) * alpha / rank,
    as workers serve it), its config and `tokenizer`, so
    `AutoModelForCausalLM.from_pretrained(directory)` loads the trained policy.
    `model` is not modified. Written aside and renamed (never half a directory). `trust_remote_code`:
    model.trust_remote_code, as the model was loaded (a custom architecture is built again from its config).
    Raises ValueError when the model has no adapters; OSError on write failure.
    """
    import shutil

    from transformers import AutoModelForCausalLM

    adapters, rank, alpha, _ = adapter_state_dict(model)
    state = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if name.endswith(".weight"):
                t = merge_one(t, adapters[module + _A], adapters[module + _B], alpha / rank)
        state[name] = t
    plain = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype,
                                             trust_remote_code=trust_remote_code)
    plain.load_state_dict(state, strict=False)  # a tied LM head is absent from `state` by name only
    missing = set(plain.state_dict()) - set(state) - ({"lm_head.weight"} if plain.config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"save_merged: weights not found in the LoRA model: {sorted(missing)[:5]}")
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def has_peft_names(model_dir: Path) -> bool:
    """True when the dir's weights carry peft's LoRA names (a LoRA run's checkpoint/): not a plain model.

    Reads the key names of the first safetensors file only. Raises ValueError for an unreadable one.
    """
    from safetensors import safe_open

    files = [model_dir / "model.safetensors"] if (model_dir / "model.safetensors").is_file() else \
        sorted(model_dir.glob("model-*.safetensors"))
    for f in files[:1]:
        try:
            with safe_open(str(f), "pt") as st:
                return any(".lora_" in k or ".base_layer." in k for k in st.keys())
        except Exception as e:  # safetensors' SafetensorError: a truncated or half-written file
            raise ValueError(f"{f} is not a readable safetensors file (half-written?): {e}") from e
    return False
