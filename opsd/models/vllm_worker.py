"""Runs inside vLLM's worker processes: in-place weight updates (loaded via `worker_extension_cls`).

vLLM mixes this class into its Worker, so the engine's ``collective_rpc("opsd_load_weights", ...)``
(``AsyncLLM.collective_rpc``, reached through `VLLMBackend.collective_rpc`)
calls the method on every worker with plain arguments (strings): no
pickled callables cross the process boundary. Each worker reads the weights
file itself, once, as a stream (`opsd.weights_io`), and feeds vLLM's
layer-wise in-place reload tensor by tensor: no staged copy, no temp directory.

What vLLM 0.32's layer-wise reload needs (vllm/model_executor/model_loader/reload/layerwise.py):
a layer is re-processed once the elements it received reach its size; a
layer that received SOME of its weights (e.g. q but not k, v of a fused
qkv_proj) is re-materialized from empty memory at the end, its other parts
garbage; a layer that received none keeps its old tensors. So every weight
of a layer must be sent: a LoRA adapter is served as the whole initial model
with its targeted weights merged, never the targeted weights alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

_HEAD = "lm_head.weight"
_FLOATS = ("F16", "BF16", "F32", "F64")  # safetensors' floating dtypes
_SERVED = {"float32": "F32", "bfloat16": "BF16"}  # model.dtype -> the safetensors dtype of a published version


def initial_specs(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype e.g. "F32")} of the model's `*.safetensors` files in `model_dir` (headers only)."""
    from safetensors import safe_open

    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            specs.update({k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()})
    return specs


def engine_weights(stream, source: str, model_dir: str, device: str | torch.device = "cpu", served: str | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Check the weights file on `stream` against the initial model in `model_dir`; returns what the engine loads.

    Everything that can be checked before a tensor reaches the engine is
    checked here, before the iterator is returned. A full file
    (`opsd.weights_io`): every name of the initial model (a tied LM head
    may be stored under either name, or under both with equal values), the
    same shapes and dtypes; the iterator then checks each tensor's values
    (finite) and the recorded digest before the last tensor (`iter_tensors`),
    a floating weight in `served` (the dtype the trainer publishes in, "float32" or "bfloat16":
    `opsd.models.served_dtype`; None: the initial checkpoint's, which a bf16 hub checkpoint served in fp32
    does not share) and an integer one as the checkpoint holds it,
    and a head stored twice against its embedding. An opsd-lora adapter:
    read whole and checked (`opsd.lora.adapter_from_stream`,
    `check_against`); the iterator yields every initial weight (read one at
    a time from `model_dir`), the targeted ones merged, W0 + B @ A * scale,
    on `device`. Raises KeyError (missing/unexpected names), ValueError
    (shapes, dtypes, tie; opsd.weights_io.WeightsError, opsd.lora.AdapterError).
    Yields (vLLM checkpoint name, tensor); a tied head under the embedding's name.
    """
    from opsd import lora
    from opsd.weights_io import read_header

    specs = initial_specs(model_dir)
    header = read_header(stream, source)
    if header.metadata.get("format") == lora.FORMAT:
        adapter = lora.adapter_from_stream(stream, header, source)
        lora.check_against(adapter, {k: shape for k, (shape, _) in specs.items()}, source)
        return _merged(model_dir, adapter, device)
    have = {e.name: (e.shape, e.dtype) for e in header.entries}
    twin = None
    if _HEAD in have and _HEAD not in specs:  # a tied head: vLLM reads it from the embedding's name only
        twins = [k for k in specs if specs[k][0] == have[_HEAD][0]]  # the embedding [vocab, hidden]
        if len(twins) != 1:
            raise ValueError(f"{source}: {_HEAD} {have[_HEAD][0]} is tied to the embedding but differs "
                             f"from it in shape (or the tie is ambiguous: {twins})")
        twin = twins[0]
        have.setdefault(twin, have[_HEAD])
        del have[_HEAD]
    missing, unexpected = sorted(set(specs) - set(have)), sorted(set(have) - set(specs))
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing}, unexpected {unexpected}")
    # Every floating weight arrives in the served dtype (vLLM would cast any other silently: a file of mixed
    # or foreign dtypes is a wrong file), whatever dtype the initial checkpoint was stored in.
    if served is not None:
        specs = {k: (shape, _SERVED[served] if dt in _FLOATS else dt) for k, (shape, dt) in specs.items()}
    bad = sorted(k for k in have if have[k] != specs[k])
    if bad:
        raise ValueError(f"{source}: shape or dtype differs from the model for {bad[:5]} "
                         f"(e.g. {have[bad[0]]} instead of {specs[bad[0]]})")
    return _streamed(stream, header, source, twin)


def _streamed(stream, header, source: str, twin: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as `iter_tensors` checks them, a tied head renamed to `twin` (dropped when stored twice,
    after checking it equals the embedding: whichever comes second is compared before it could be yielded)."""
    from opsd.weights_io import iter_tensors

    both = twin is not None and twin in {e.name for e in header.entries}
    pair: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(stream, header, source):
        if both and name in (_HEAD, twin):
            pair[name] = t
            if len(pair) == 2 and not torch.equal(pair[_HEAD], pair[twin]):
                raise ValueError(f"{source}: {_HEAD} is tied to {twin} but differs from it")
            if name == _HEAD:
                continue
        yield (twin if name == _HEAD else name), t


def _merged(model_dir: str, adapter, device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the initial model's files, one at a time (safetensors mmap), the adapter's targets merged."""
    from safetensors import safe_open

    from opsd.lora import merge_one

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt", device="cpu") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                m = name[: -len(".weight")]
                if name.endswith(".weight") and m + ".lora_A.weight" in adapter.tensors:
                    w = merge_one(w.to(device), adapter.tensors[m + ".lora_A.weight"],
                                  adapter.tensors[m + ".lora_B.weight"], adapter.scale)
                yield name, w


class WeightSync:
    """Worker mixin: stream a weights file into the running model in place and re-tie the LM head."""

    def opsd_load_weights(self, ref: str, model_dir: str, served: str | None = None) -> dict:
        """Load the weights file `ref` (`opsd.weights_io.open_weights`) into the running model, in place.

        model_dir: the initial model's directory (the reference for names,
        shapes and integer dtypes; an adapter's base); served: the dtype
        floating weights arrive in (`engine_weights`). Checked as `engine_weights`
        says, then fed to vLLM's layer-wise reload (weights re-processed into
        the kernels' layouts). A failure while tensors stream in puts every
        layer that received nothing back as it was (vLLM's finalize) and
        leaves the engine holding a mix: the caller must not serve it.
        That reload skips a tied LM head and puts its OLD kernel tensors
        back, so with ``tie_word_embeddings`` the head is tied to the new
        embedding again and re-processed here.

        Returns {"params": parameter count, "delivered": tensors the engine
        received}, plus "error" ("KeyError" or "ValueError") and "message"
        when the file was refused (a plain dict: the caller raises it).
        Other errors (device, engine) propagate.
        """
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        from opsd.weights_io import open_weights

        runner = self.model_runner  # type: ignore[attr-defined]  (the Worker we are mixed into)
        model = runner.get_model()
        delivered = 0

        def counted(weights):
            nonlocal delivered
            for item in weights:
                delivered += 1  # handed over: the engine's layer may hold it from here on
                yield item

        try:
            with open_weights(ref) as stream:
                weights = engine_weights(stream, ref, model_dir, runner.device, served)
                try:
                    runner.reload_weights(weights_iterator=counted(weights), is_checkpoint_format=True)
                except BaseException:
                    finalize_layerwise_reload(model, runner.vllm_config.model_config)
                    raise
        except (KeyError, ValueError) as e:
            kind = "KeyError" if isinstance(e, KeyError) else "ValueError"
            return {"params": 0, "delivered": delivered, "error": kind, "message": str(e.args[0] if e.args else e)}
        finally:
            self._opsd_retie(model)
        return {"params": sum(p.numel() for p in model.parameters()), "delivered": delivered}

    @staticmethod
    def _opsd_retie(model) -> None:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", False):
            head, embed = model.lm_head, model.model.embed_tokens
            head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)

    def opsd_weight_checksum(self) -> list[float]:
        """Sum of |w| of the embedding and of the LM head's effective weight (tests: the tie survived)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        embed = model.model.embed_tokens.weight
        probe = torch.eye(embed.shape[1], dtype=embed.dtype, device=embed.device)[:4]
        logits = model.lm_head.quant_method.apply(model.lm_head, probe)
        return [float(embed.abs().sum()), float(logits.abs().sum())]
