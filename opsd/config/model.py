"""`model:` (and an external teacher's `teacher.model:`): which model, its backend, precision and chat template."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from opsd.config.base import _Section


class VLLMSection(_Section):
    """Engine settings of the vLLM backend (model.backend: vllm); ignored by the transformers backend."""

    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)  # share of GPU memory per engine (weights + KV cache)
    kv_cache_gib: int = Field(1, ge=1)  # CPU builds: KV cache size (VLLM_CPU_KVCACHE_SPACE, whole GiB); GPU builds ignore it
    max_num_seqs: int = Field(64, ge=1)  # sequences scheduled together
    enforce_eager: bool = True  # no CUDA graphs / torch.compile: starts in seconds instead of minutes
    tensor_parallel_size: int = Field(1, ge=1)


def _revision(value: str | None) -> str | None:
    if value is not None and not (0 < len(value) <= 255 and not any(c.isspace() for c in value)):
        raise ValueError("a Hub revision is a branch, tag or commit: 1 to 255 characters, no whitespace")
    return value


Revision = Annotated[str | None, AfterValidator(_revision)]


_APPLY_CHAT_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ModelSection(_Section):
    # a packaged model (opsd.models.packaged.PACKAGED_MODELS), "tiny-random" (a tiny random Llama for tests and
    # simulated compute, opsd.models.packaged.TINY_RANDOM), a local HF dir, or a Hugging Face Hub id ("org/name",
    # resolved as from_pretrained resolves it: opsd/models/hub.py). An existing local dir wins over a Hub id.
    name: str = Field("smollm2-135m-instruct", min_length=1, max_length=4096)
    # A Hub id's branch, tag or commit (None: "main"). `opsd run` pins it to the resolved 40-hex commit in the
    # run's config.yaml, so every role (and a resume) loads the same snapshot. A packaged model or a local dir
    # has no revisions: refused with them rather than ignored, so no record shows a pin that was not applied.
    revision: Revision = None
    # Run the model repo's own Python code (a custom architecture or tokenizer) when loading it: only for a repo
    # you trust. An external teacher's own section decides for the teacher; it does not inherit the student's.
    trust_remote_code: bool = False
    # Rollout and teacher generate/score with this backend: "hf" (transformers, CPU or one GPU) or
    # "vllm" (vLLM engine; `make install-vllm` on CPU). The trainer always uses transformers.
    backend: Literal["hf", "vllm"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # transformers backend and trainer; auto = cuda when available
    vllm: VLLMSection = VLLMSection()
    # The forward passes' precision, shared by sampler, teacher and trainer (their log-probs must agree).
    # "bfloat16": bf16 weights on workers (rollout, teacher; half the memory: a 7B model ~15 GB, not ~30) and the
    # weights files published in bf16; fp32 master weights + AdamW state + bf16 compute in the trainer (autocast in
    # one process, FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) across GPUs); checkpoints keep
    # the fp32 master weights, so a resume is exact. "float32": fp32 everywhere (the CPU default: bf16 matmuls on a
    # CPU are correct but slow). An external teacher's section decides its own weights' dtype.
    dtype: Literal["float32", "bfloat16"] = "float32"
    cache_dir: str | None = None  # default: $OPSD_CACHE or ~/.cache/opsd
    max_model_len: int = Field(2048, ge=64, le=1 << 20)
    # torch threads per role process (0 = torch default). On a few shared cores, 1 per
    # role was 4-5x faster than torch's default (threads spin while others compute).
    threads: int = Field(0, ge=0)
    # The ids that end a sampled turn. None = the chat template's end-of-turn token plus the eos ids of the
    # model's generation_config.json (or the tokenizer's eos without one), which must include that token.
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=64)
    # A Jinja chat template file that replaces the tokenizer's own (e.g. a base model without one).
    chat_template: str | None = Field(None, min_length=1, max_length=4096)
    # Extra arguments of every apply_chat_template call, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, bool | int | float | str] = Field(default_factory=dict, max_length=32)

    @model_validator(mode="after")
    def _template_kwargs_are_template_variables(self) -> "ModelSection":
        # apply_chat_template's own arguments: opsd sets them (tokenize, add_generation_prompt) or they are no
        # template variable; passed on they fail as "got multiple values" or change what is rendered.
        own = sorted(set(self.chat_template_kwargs) & _APPLY_CHAT_TEMPLATE_ARGS)
        if own:
            raise ValueError(f"model.chat_template_kwargs {own} are arguments of apply_chat_template, not template "
                             "variables (the template file is model.chat_template)")
        return self
