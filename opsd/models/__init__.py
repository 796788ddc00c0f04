"""Model backends behind one interface (generate / score / branch / load_weights), chosen by ``model.backend``.

"hf": transformers (opsd/models/hf.py), CPU or one GPU, also the trainer's model.
"vllm": a vLLM engine (opsd/models/vllm.py), imported only when selected, so
the default install does not need vLLM.
"""

from __future__ import annotations

from opsd.config import ModelSection
from opsd.models.hf import Generation, HFBackend, NonFiniteLogitsError, ensure_model, served_dtype, token_logprobs
from opsd.models.hub import ModelUnavailableError, ResolvedModel, resolve_model
from opsd.models.trust import UntrustedModelError, check_weight_files, remote_code_refused

__all__ = ["Generation", "HFBackend", "ModelUnavailableError", "NonFiniteLogitsError", "ResolvedModel", "check_teacher_model",
           "UntrustedModelError", "ensure_model", "load_backend", "load_engine", "resolve_device", "resolve_model",
           "served_dtype", "token_logprobs"]


def resolve_device(cfg: ModelSection) -> str:
    """The torch device of ``cfg.device``: "auto" is "cuda" when torch sees a GPU, else "cpu"."""
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(cfg: ModelSection, device: str | None = None, backend: str | None = None, weights_dtype=None):
    """Build the backend named by `backend` (default ``cfg.backend``) on `device` (default `resolve_device`).

    The trainer passes backend="hf": it needs the transformers model, and weights_dtype=torch.float32: its
    master weights (`HFBackend`; None = the served dtype, bf16 with ``cfg.dtype: bfloat16``). vLLM holds
    the weights in its own ``cfg.dtype`` and takes no weights_dtype. Raises
    ValueError for an unknown backend name; ImportError (naming the install
    target) for "vllm" without vLLM installed.
    """
    name = backend or cfg.backend
    if name == "hf":
        return HFBackend(cfg, device=device or resolve_device(cfg), weights_dtype=weights_dtype)
    if name == "vllm":
        from opsd.models.vllm import VLLMBackend

        return VLLMBackend(cfg)
    raise ValueError(f"unknown model backend {name!r} (available: hf, vllm)")


def load_engine(backend, max_batch: int, kv_cache_bytes: int):
    """The Engine (opsd/models/engine.py) that serves `backend`'s requests from many threads at once.

    The vLLM backend is one itself (its async engine); a transformers backend
    gets an `HFEngine` (batched waves of at most `max_batch` rows, episodes'
    KV kept in `kv_cache_bytes`). The caller closes an HFEngine it no longer needs.
    """
    if hasattr(backend, "submit"):
        return backend
    from opsd.models.hf_engine import HFEngine

    return HFEngine(backend, max_batch=max_batch, kv_cache_bytes=kv_cache_bytes)


def check_teacher_model(student: ModelSection, teacher: ModelSection) -> None:
    """Refuse an external teacher (teacher.source: model) that cannot score the student's token ids.

    The teacher scores the student's exact ids, so both must map every
    string to the same ids: same vocabulary (added tokens included), same
    special ids (bos, eos, pad, unk, the template's end of turn) and the same chat
    template (the privileged prompt is built with the student's). Its model
    must also take every id and position the student's can: config
    vocab_size and max_position_embeddings at least the student's (a larger,
    padded embedding is fine), and its weights must be safetensors files
    (never pickle-only: `opsd.models.trust.check_weight_files`), under plain
    names (not a LoRA run's checkpoint/). Loads both
    tokenizers and configs (resolving each model, `opsd.models.hub.resolve_model`:
    a packaged one is converted once), each with its own ``trust_remote_code``:
    a directory that needs its own code while that setting is false is
    refused (UntrustedModelError, a ValueError, naming the setting), its code never run.
    Raises ValueError with one line naming ``teacher.model`` (or ``model``) and the first
    problem (whatever transformers raises reading a malformed directory included) (ModelUnavailableError, a ValueError, for a Hub model that cannot
    be had; FileNotFoundError for a name that is no model); cross-tokenizer
    distillation is out of scope.
    """
    from transformers import AutoConfig

    from opsd.chat import ChatFormat
    from opsd.models.tokenizer import load_tokenizer

    what = f"teacher.model {teacher.name!r}"
    tail = "cross-tokenizer distillation is not supported: pick a teacher of the student's model family"
    paths, toks, confs = [], [], []
    for m, who, section in ((student, f"model {student.name!r}", "model"), (teacher, what, "teacher.model")):
        try:
            path = resolve_model(m, section).path
            paths.append(path)
            # Each model's own trust_remote_code: the teacher's section decides for the teacher.
            setting = f"{section}.trust_remote_code"
            toks.append(load_tokenizer(m, path, setting))
            with remote_code_refused(path, m.trust_remote_code, setting):
                confs.append(AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=m.trust_remote_code))
        except ModelUnavailableError:
            raise  # already one line naming the model, its revision and the command that fetches it
        except UntrustedModelError as e:
            raise UntrustedModelError(f"{who}: {e}") from e
        except Exception as e:  # noqa: BLE001 - a boundary check: a config.json that is a list is a TypeError, a
            # tokenizer_config.json that is one an AttributeError, a field of the wrong type huggingface_hub's own error
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{who}: cannot load its tokenizer and config ({first})") from e
    check_weight_files(paths[1], what)  # a pickle-only teacher would pass here and fail only at load
    from opsd.lora import has_peft_names

    if has_peft_names(paths[1]):  # would load as a half-random model: its weights are under peft's names
        raise ValueError(f"{what}: {paths[1]} holds LoRA adapters under peft's names (a LoRA run's checkpoint/); "
                         "use that run's final_model/ (the merged policy, written when it finishes)")
    what += f" does not share the student's tokenizer ({student.name!r})"
    vocab = [t.get_vocab() for t in toks]
    if vocab[0] != vocab[1]:
        differ = sorted(set(vocab[0].items()) ^ set(vocab[1].items()), key=lambda kv: kv[1])
        tok, _ = differ[0]
        raise ValueError(f"{what}: vocabularies of {len(vocab[0])} vs {len(vocab[1])} tokens, {tok!r} is "
                         f"{vocab[0].get(tok)} vs {vocab[1].get(tok)}; {tail}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = (getattr(t, name) for t in toks)
        if a != b:
            raise ValueError(f"{what}: {name} {a} vs {b}; {tail}")
    if toks[0].chat_template != toks[1].chat_template:
        raise ValueError(f"{what}: the chat templates differ; {tail}")
    a, b = (ChatFormat(t, "action", template_kwargs=m.chat_template_kwargs).end_of_turn_id
            for t, m in zip(toks, (student, teacher)))
    if a != b:
        raise ValueError(f"{what}: the chat template's end of turn is id {a} vs {b}; {tail}")
    for key, why in (("vocab_size", "the student samples ids it has no logits for"),
                     ("max_position_embeddings", "it could not score the student's longest sequences")):
        s, t = (getattr(c, key, None) for c in confs)
        if s is not None and t is not None and t < s:
            raise ValueError(f"teacher.model {teacher.name!r}: {key} {t} < the student's {s}: {why}")
