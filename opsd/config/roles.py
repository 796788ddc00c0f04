"""`rollout:`, `teacher:` and `embedder:`: the worker roles' sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opsd.config.base import _Section
from opsd.config.model import ModelSection
from opsd.types import MAX_GROUP_SIZE


class RolloutSection(_Section):
    group_size: int = Field(4, ge=1, le=MAX_GROUP_SIZE)  # the wire refuses bigger TaskGroups
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(24, ge=1, le=1 << 20)
    batch_size: int = Field(16, ge=1)  # episodes generated together (with groups in flight: rows per transformers wave)
    # TaskGroups a worker plays at once, every episode on its own (services/rollout/inflight.py); 1 = one group at
    # a time in lockstep, reproducible bit for bit. None: 1 on transformers, 16 on vLLM (RunConfig.groups_in_flight).
    max_groups_in_flight: int | None = Field(None, ge=1, le=256)
    kv_cache_mb: int = Field(1024, ge=0)  # transformers backend, groups in flight: episodes' KV kept between turns
    metrics_port: int = 0  # 0 = pick a free port


class TeacherSection(_Section):
    # "self": the live policy (the rollout's own policy version) with privileged context; "model": the frozen
    # model of `model` below (a packaged model, a local HF dir, or an opsd run's final_model/ or checkpoint/),
    # never reloaded on policy versions. Its tokenizer must be the student's (`opsd.models.check_teacher_model`).
    source: Literal["self", "model"] = "self"
    model: ModelSection | None = None  # source "model" only; its cache_dir defaults to the student's
    # Which policy a self teacher scores a group of version v with: "live" (v itself), "frozen" (the initial
    # policy, version 0, never reloaded), "lag:K" (version max(0, v - K): the trainer keeps K more versions'
    # files) or "ema:D" (an exponential moving average of the policy over versions, decay D in [0, 1), kept and
    # published by the trainer: services/trainer/ema.py). An external teacher (source model) is frozen by
    # nature and takes "live" or "frozen" alike.
    version: str = Field("live", pattern=r"^(live|frozen|lag:[1-9][0-9]{0,3}|ema:0\.[0-9]{1,6})$")
    thinking_max_new_tokens: int = Field(24, ge=1, le=1 << 20)
    score_batch_size: int = Field(8, ge=1)
    embedder_timeout_s: float = Field(30.0, gt=0)  # one /correspond attempt
    # Connection errors, timeouts and 5xx from the embedder are retried with exponential backoff
    # (no count cap) until this many seconds have passed; then the group is scored with identity
    # views only (counted in opsd_embedder_fallbacks_total). A 4xx is not retried.
    embedder_deadline_s: float = Field(120.0, gt=0)
    metrics_port: int = 0
    # RolloutGroups scored at once (services/teacher). None: 1 on transformers, 8 on vLLM (RunConfig.groups_in_flight).
    max_groups_in_flight: int | None = Field(None, ge=1, le=64)


class EmbedderSection(_Section):
    encoder: str = "all-MiniLM-L6-v2"  # a packaged encoder or a local sentence-transformers dir
    # The bind address of every role is OPSD_BIND_HOST (loopback unless set, e.g. 0.0.0.0 in a container).
    port: int = 0
    max_texts: int = Field(4096, ge=1)  # per request
    max_text_chars: int = Field(8192, ge=1)
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)  # larger bodies get 413
    # The encoder's torch device (embeddings, corpus index builds); auto = cuda when torch sees a GPU.
    # The vectors are float32 and L2-normalized on either.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Run the encoder directory's own Python code (a custom sentence-transformers module or architecture) when
    # loading it: only for a directory you trust. Off, such a directory is refused with one line.
    trust_remote_code: bool = False
