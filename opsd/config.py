"""One typed run config with a section per role, loaded from YAML (configs/*.yaml).

Unknown keys are errors (a typo must not silently fall back to a default), and
so are NaN and infinite floats (YAML `.nan`/`.inf`, JSON `NaN`/`Infinity`): no
hyper-parameter has a meaningful non-finite value, and one would surface as
NaN advantages or weights mid-run. A boolean where a number belongs is refused too
(`kl_coef: true` would be 1.0; `stop_token_ids: [true]` would be [1]), and so is a YAML mapping that repeats a key (a
second `trainer:` block would silently replace the first).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from opsd.types import MAX_GROUP_SIZE, MAX_GROUP_TURNS

# The credit methods a run may name: opsd/credit registers one estimator under each and refuses any other name,
# so this module validates run.method without importing the estimators (which import this module).
CREDIT_METHODS = ("agentopsd", "alignopsd", "ex_opd", "fire_opd", "gc_opd", "grpo", "grpo_opd", "grpo_opsd", "opd",
                  "opsd", "power_opd", "uni_opd")
# The longest wait between two tries of a Redis command a role retries through an outage (the trainer's Backoff;
# opsd.service.retry_redis waits at most 10 s): liveness must not read that wait as a hang (ProbesSection).
REDIS_RETRY_WAIT_MAX_S = 30.0


def _alternatives(annotation) -> list:
    """`annotation`'s alternatives: Optional, Union and Annotated unwrapped (list[int] and Literal[...] kept whole)."""
    out, stack = [], [annotation]
    while stack:
        t = stack.pop()
        origin = typing.get_origin(t)
        if origin is Annotated:
            stack.append(typing.get_args(t)[0])
        elif origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(t))
        else:
            out.append(t)
    return out


def _bool_for_a_number(annotation, value) -> bool:
    """True when `value` is a bool where `annotation` takes an int or a float but not a bool (pydantic would read
    true as 1), or a list or dict holding one where the annotation's items do (`stop_token_ids: [true, 2]`)."""
    kinds = _alternatives(annotation)
    if isinstance(value, bool):
        return any(k in (int, float) for k in kinds) and bool not in kinds
    if not isinstance(value, (list, dict)):
        return False
    # list[X] -> X, dict[K, X] -> X: what each of the value's items must be
    items = [typing.get_args(k)[-1] for k in kinds if typing.get_origin(k) is type(value) and typing.get_args(k)]
    return bool(items) and any(all(_bool_for_a_number(t, v) for t in items)
                               for v in (value if isinstance(value, list) else value.values()))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info: ValidationInfo):
        if _bool_for_a_number(cls.model_fields[info.field_name].annotation, value):
            got = json.dumps(value) if isinstance(value, bool) else f"a boolean in {json.dumps(value, default=str)[:80]}"
            raise ValueError(f"expects a number, got {got} (YAML reads true/false/yes/no/on/off as booleans)")
        return value


class RunSection(_Section):
    # One path component under output_dir (no "/", no leading "."): "../x" or an absolute name would put the run
    # directory anywhere on the machine.
    name: str = Field("quickstart", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    steps: int = Field(3, ge=1)
    seed: int = 0
    output_dir: str = "runs"  # the run directory is output_dir/<name>-<timestamp>
    method: str = "alignopsd"  # one of CREDIT_METHODS (each a registered estimator, opsd.credit), checked on load
    step_timeout_s: float = Field(1800.0, gt=0)  # a step waiting this long re-issues its missing groups once; twice this long fails the run
    # 0 = synchronous (step n+1's tasks are issued after step n's update); k >= 1 = k-step-off:
    # tasks of steps n+1..n+k are in flight (sampled with older policies) while step n trains,
    # and a group more than k policy versions older than the trainer is dropped and counted.
    max_staleness: int = Field(0, ge=0, le=16)
    max_restarts: int = Field(3, ge=0)  # `opsd run` restarts a role that died at most this many times (per role)
    # Experiment trackers the trainer logs to (opsd/tracking.py; settings in `tracking:`): any of wandb,
    # tensorboard, mlflow. Each is an optional extra (pip install 'opsd[wandb]'); a missing one is refused at start.
    report_to: list[Literal["wandb", "tensorboard", "mlflow"]] = []

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice: {value}")
        return value


class RedisSection(_Section):
    url: str | None = None  # None and no REDIS_URL env: start a local redis-server
    stream_prefix: str | None = None  # default: "opsd:<run id>"
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    block_ms: int = Field(2000, ge=1)
    # Pending entries idle this long are re-claimed by a live worker (a running job's heartbeat, every
    # third of this, keeps it fresh): how soon the job of a dead worker, or a failed job, runs again.
    reclaim_idle_ms: int = Field(60_000, ge=1000)
    max_deliveries: int = Field(3, ge=1)  # then an entry goes to the dead-letter stream
    # Backpressure: a producer waits while the stream it writes to holds more than this many
    # entries not yet delivered to their consumer group (work streams are never trimmed).
    max_stream_lag: int = Field(64, ge=1)
    # The embedded redis-server (no url) keeps an append-only file under <run_dir>/redis/
    # (fsync always): a restarted server, or `opsd run --resume`, loses no acknowledged work.
    appendonly: bool = True


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


ENV_NAMES = ("textworld", "twx", "scienceworld", "alfworld", "search", "webshop", "reasoning_gym", "evidence")


class TWXSection(_Section):
    """TextWorld-Express (opsd/envs/twx.py): games drawn round-robin from `games`."""

    games: list[Literal["coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder"]] = Field(
        ["coin"], min_length=1
    )
    # TWX's own parameter string ("" = the game's defaults), or one per game {game: string}. A shared
    # string's keys that a game does not know are dropped for that game (mapreader: maxDistanceApart < numLocations).
    game_params: str | dict[str, str] = "numLocations=1,includeDoors=0"
    # Deadline (s) for each call into the JVM (reset/step: ms); past it the JVM is killed and the episode errors.
    step_timeout_s: float = Field(60.0, gt=0)


class ScienceWorldSection(_Section):
    """ScienceWorld (opsd/envs/scienceworld.py): tasks round-robin from `tasks`, each on its train
    variations (pool: game_pool) or its dev variations (eval_pool)."""

    tasks: list[str] = Field(["find-living-thing"], min_length=1)  # ScienceWorld task names
    simplifications: str = "easy"  # comma-separated: easy, teleportAction, openDoors, openContainers, ...
    # Deadline (s) for each call into the JVM (load up to ~5 s, step 0.1-3 s); past it the JVM is killed.
    step_timeout_s: float = Field(60.0, gt=0)


class AlfWorldSection(_Section):
    """ALFWorld (opsd/envs/alfworld.py) on the `alfworld` package's engine."""

    # A directory holding the real ALFWorld game files (json_2.1.1/...: game.tw-pddl + traj_data.json);
    # None = tasks built offline from the PDDL domain, grammar and layouts the package ships.
    data_dir: str | None = None
    eval_split: Literal["valid_seen", "valid_unseen"] = "valid_seen"  # data_dir's folder the eval split plays
    # Categories to play (reported per category): subset of pick, look, clean, heat, cool, pick2.
    task_types: list[Literal["pick", "look", "clean", "heat", "cool", "pick2"]] = Field(
        ["pick", "look", "clean", "heat", "cool", "pick2"], min_length=1)


class SearchSection(_Section):
    """Search-QA (opsd/envs/search.py), Search-R1 protocol; retrieval by the embedder over `corpus`."""

    corpus: str | None = None  # JSONL {"id", "contents"}; None = the small corpus shipped in opsd/envs/data/search/
    questions: str | None = None  # JSONL {"id", "question", "golden_answers", "data_source"}; None = the shipped set
    # Eval questions in their own file (e.g. Search-R1's test split); None = a deterministic third of `questions`
    eval_questions: str | None = None
    top_k: int = Field(3, ge=1, le=50)
    max_passage_chars: int = Field(600, ge=16)


class WebShopSection(_Section):
    """WebShop (opsd/envs/webshop.py): a client for a running WebShop server (its text env over HTTP).

    Setup and the goal-index conventions: opsd/envs/WEBSHOP.md. Goals 0-499 are
    WebShop's test goals; train from 500+ (WebShop's own baseline: 500-1499 dev, 1500+ train).
    """

    url: str = "http://127.0.0.1:3000"  # the WebShop Flask app (python -m web_agent_site.app serves port 3000)
    goals: list[int] = list(range(500, 600))  # goal (session fixed_<i>) indices to train on; the first game_pool
    eval_goals: list[int] = list(range(0, 100))  # the first eval_pool are evaluated; must not meet `goals`
    timeout_s: float = Field(30.0, gt=0)  # deadline of one HTTP request (redirects and body included)
    max_page_bytes: int = Field(4_000_000, gt=0)  # a larger page body is a server failure (WebShopError)

    @model_validator(mode="after")
    def _check(self) -> "WebShopSection":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"env.webshop.url must be an http(s) URL, got {self.url!r}")
        if any(g < 0 for g in [*self.goals, *self.eval_goals]):
            raise ValueError("env.webshop goal indices must be >= 0")
        return self


class ReasoningGymSection(_Section):
    """Single-turn verifiable tasks from reasoning-gym (opsd/envs/reasoning_gym.py)."""

    datasets: list[str] = Field(["basic_arithmetic"], min_length=1)  # reasoning_gym.factory.DATASETS names
    # Items generated per dataset and split (indices 0..size-1); the pools draw from them round-robin.
    size: int = Field(64, ge=1, le=1_000_000)
    # Wall-clock bound on one answer's scoring in the sandboxed verifier process; a timeout scores 0.
    verifier_timeout_s: float = Field(5.0, gt=0, le=600)
    # Datasets whose verifier evaluates the answer as code (eval / sympy parse_expr: spiral_matrix,
    # countdown, ...) are refused unless this is set (they still run in the sandboxed verifier process).
    allow_code_eval_verifiers: bool = False


# Characters per SmolLM2 token of the evidence env's generated text, per kind (measured with SmolLM2's tokenizer:
# tests/test_env_evidence.py checks the documents' token counts against their targets).
EVIDENCE_CHARS_PER_TOKEN = {"tables": 2.05, "retrieval": 3.05}


def evidence_observation_chars(tokens: int) -> int:
    """An upper bound on an evidence observation's characters for a target of `tokens`: the document stops
    within a table or passage of its target, plus the question twice."""
    return int(tokens * max(EVIDENCE_CHARS_PER_TOKEN.values())) + 2000


class EvidenceSection(_Section):
    """Long-context evidence aggregation generated from seeds (opsd/envs/evidence.py)."""

    kinds: list[Literal["tables", "retrieval"]] = Field(["tables", "retrieval"], min_length=1)
    # Target document lengths in tokens; each is a category (length bucket). SmolLM2's context is 8192.
    prompt_tokens: list[int] = Field([1024, 2048, 4096], min_length=1)

    @model_validator(mode="after")
    def _lengths(self) -> "EvidenceSection":
        if len(set(self.kinds)) != len(self.kinds) or len(set(self.prompt_tokens)) != len(self.prompt_tokens):
            raise ValueError("evidence.kinds and evidence.prompt_tokens must not repeat a value")
        if not all(64 <= n <= 131072 for n in self.prompt_tokens):
            raise ValueError(f"evidence.prompt_tokens must be in [64, 131072], got {self.prompt_tokens}")
        return self


class EnvSection(_Section):
    name: Literal[ENV_NAMES] = "textworld"  # type: ignore[valid-type]
    num_games: int = Field(2, ge=1, le=4096)  # distinct games (task groups) per step
    game_pool: int = Field(8, ge=1, le=1_000_000)  # tasks in the training pool (textworld: seeds seed..seed+game_pool-1)
    eval_pool: int = Field(16, ge=1, le=1_000_000)  # tasks `opsd eval` plays (the env's validation split where it has one)
    seed: int = 1234
    world_size: int = Field(1, ge=1)  # textworld: rooms
    nb_objects: int = Field(3, ge=1)  # textworld
    quest_length: int = Field(1, ge=1)  # textworld
    max_turns: int = Field(4, ge=1, le=MAX_GROUP_TURNS)
    prompt_format: Literal["action", "think"] = "action"
    list_admissible: bool = True
    one_shot: bool = True
    invalid_feedback: str = (
        "Invalid response. Reply with exactly one command inside <action></action>."
    )
    max_observation_chars: int = Field(2000, ge=16)
    # What the teacher's privileged context holds (spec section 0): the SkillBank's skills
    # (opsd/skills/<env>/), the environment's walkthrough / gold path where it has one, or both;
    # "remaining": per turn, the gold path left from the state the turn acted in (the env's
    # policy_commands; one teacher view per turn), "skills+remaining": the skills plus that; "none": no
    # privileged context, the teacher sees the student's exact prompt (plain OPD with an external teacher).
    privileged: Literal["skills", "walkthrough", "both", "remaining", "skills+remaining", "none"] = "both"
    twx: TWXSection = TWXSection()
    scienceworld: ScienceWorldSection = ScienceWorldSection()
    alfworld: AlfWorldSection = AlfWorldSection()
    search: SearchSection = SearchSection()
    webshop: WebShopSection = WebShopSection()
    reasoning_gym: ReasoningGymSection = ReasoningGymSection()
    evidence: EvidenceSection = EvidenceSection()

    @model_validator(mode="after")
    def _evidence_fits_the_observation(self) -> "EnvSection":
        if self.name == "evidence":  # a cut document would lose evidence, not just text
            need = evidence_observation_chars(max(self.evidence.prompt_tokens))
            if self.max_observation_chars < need:
                raise ValueError(f"env.max_observation_chars {self.max_observation_chars} would cut the evidence "
                                 f"documents of evidence.prompt_tokens up to {max(self.evidence.prompt_tokens)}; "
                                 f"set it to at least {need}")
        return self

    @model_validator(mode="after")
    def _per_turn_hint_needs_a_gold_path(self) -> "EnvSection":
        if self.privileged in ("remaining", "skills+remaining") and self.name in ("search", "webshop"):
            # These envs report no policy_commands: the teacher would see no hint, and no error would say so.
            raise ValueError(f"env.privileged {self.privileged!r} needs an env that reports its remaining gold path "
                             f"(textworld, twx, scienceworld, alfworld, reasoning_gym), not {self.name!r}")
        return self


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


class AlignSection(_Section):
    """AlignOPSD hyper-parameters (spec 4.1-4.5); defaults = alfworld-3b profile."""

    similarity_threshold: float = Field(0.65, ge=-1, lt=1)  # gamma_H (a cosine; (H - gamma)/(1 - gamma) needs < 1)
    top_k: int = Field(2, ge=1)
    source_rollout_cap: int = Field(1, ge=1)
    aggregation_temperature: float = Field(0.10, gt=0)
    aggregation_mode: Literal["probability_mixture", "log_mean"] = "probability_mixture"
    alpha_max: float = Field(0.8, ge=0, le=1)
    action_filter_enabled: bool = True
    action_filter_threshold: float = Field(0.80, ge=-1, le=1)
    webshop_symbolic_checks: bool = False
    profile_temperature: float = Field(0.10, gt=0)
    segmentation_quantile: float = Field(0.80, ge=0, le=1)
    segmentation_threshold_min: float = Field(0.01, ge=0, le=1)  # a JSD in [0, 1]
    segmentation_threshold_max: float = Field(0.10, ge=0, le=1)
    min_segment_turns: int = Field(2, ge=1)
    max_segment_turns: int = Field(8, ge=1)
    credit_temperature: float = Field(0.5, gt=0)  # T
    mixing_coefficient: float = Field(0.5, ge=0, le=1)  # eta
    density_upper_bound: float = Field(4.0, ge=1)  # d_max; the box [0, d_max] must hold the mean density 1
    weighting_mode: Literal["legacy", "bounded"] = "legacy"
    multiplier_band: float = Field(0.2, ge=0, lt=1)
    # Ablations (spec 4.4): A no_rectification (alpha_max = 0), B token_level allocation,
    # C turn_level allocation without spans, D random_spans (seeded by ablation_seed).
    ablation: Literal["none", "no_rectification", "token_level", "turn_level", "random_spans"] = "none"
    ablation_seed: int = 0

    @model_validator(mode="after")
    def _spans(self) -> "AlignSection":
        if self.max_segment_turns < 2 * self.min_segment_turns - 1:
            raise ValueError("alignopsd: max_segment_turns must be >= 2*min_segment_turns - 1")
        if self.segmentation_threshold_min > self.segmentation_threshold_max:
            raise ValueError("alignopsd: segmentation_threshold_min must be <= segmentation_threshold_max")
        return self


class AgentOPSDSection(_Section):
    """AgentOPSD recursive belief revision (spec 2).

    variant "paper" (default): gamma 0.95, B_0 = clip(success rate S/G), A_seq
    from credit.grpo_scope. variant "reference" (released code): gamma 1.0,
    B_0 = mean first-row reward clipped, A_seq from the turn scope.
    """

    variant: Literal["paper", "reference"] = "paper"
    granularity: Literal["turn", "token"] = "turn"
    gamma: float | None = Field(None, gt=0, le=1)  # None: 0.95 (paper) / 1.0 (reference)
    mult_lambda: float = Field(0.5, ge=0, le=1)  # lambda
    mult_band: float = Field(0.2, ge=0, lt=1)  # b
    eps: float = Field(1e-6, gt=0, le=0.1)

    @property
    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return 0.95 if self.variant == "paper" else 1.0


class GCOPDSection(_Section):
    """GC-OPD group-calibrated residual + RACA (spec 3); a trajectory is one response."""

    residual_beta: float = Field(0.10, ge=-100, le=100)  # beta; 0 = vanilla OPD, < 0 the paper's negative-RACA ablation
    credit_mode: Literal["raca", "uniform", "teacher_abs", "relative_teacher_support", "relative_opd_leverage"] = "raca"
    credit_cap: float = Field(5.0, ge=1, le=1e6)  # c_max (>= 1: the neutral credit 1 must fit)
    min_group_std: float = Field(1e-6, ge=0)  # tau_G
    min_token_std: float = Field(1e-6, ge=0)  # tau_T
    adv_clip: float = Field(10.0, ge=0, le=1e6)  # a_max; 0 disables clipping


class UniOPDSection(_Section):
    margin_delta: float = Field(0.4, ge=0, le=100)  # delta (nats)
    max_logprob_diff: float = Field(10.0, gt=0, le=1e6)  # tokens with |current - teacher| >= this get advantage 0


class PowerOPDSection(_Section):
    alpha: float = Field(100.0, ge=1e-3, le=1e4)


class ExOPDSection(_Section):
    lam: float = Field(1.25, ge=-10, le=10)  # target = lam * teacher + (1 - lam) * base
    base: Literal["initial", "old"] = "initial"  # base log-probs: the initial policy's, or pi_old's


class FiReOPDSection(_Section):
    skip_percentile: float = Field(20.0, ge=0, le=100)  # rows below this percentile of mean teacher log-prob are dropped
    entropy_alpha: float = Field(1.0, ge=0)
    entropy_beta: float = Field(1.0, ge=0)


class SDARSection(_Section):
    """SDAR auxiliary loss (ALFWorld-3B profile): coef * token-mean(sigmoid(beta (teacher - sg(student))) (teacher - log pi))."""

    coef: float = Field(0.0, ge=0, le=100)  # 0 = off
    beta: float = Field(5.0, gt=0, le=1e4)


# The released launchers (spec 4.5), applied under a config's own keys by `credit.profile`.
_ALIGN_COMMON = {"aggregation_temperature": 0.10, "profile_temperature": 0.10, "source_rollout_cap": 1}
ALIGNOPSD_PROFILES: dict[str, dict] = {
    "alfworld-3b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1, "sdar": {"coef": 0.01, "beta": 5.0},
        "alignopsd": {"similarity_threshold": 0.65, "top_k": 2, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": True, "webshop_symbolic_checks": False},
    },
    "alfworld-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "search-3b": {
        "grpo_scope": "trajectory", "invalid_action_penalty_coef": 0.01,
        "alignopsd": {"similarity_threshold": 0.70, "top_k": 3, "aggregation_mode": "log_mean", "alpha_max": 0.2,
                      "credit_temperature": 1.0, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "search-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.01,
        "alignopsd": {"similarity_threshold": 0.70, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "webshop-3b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.2, "action_filter_enabled": True, "webshop_symbolic_checks": True},
    },
    "webshop-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 2, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
}
for _p in ALIGNOPSD_PROFILES.values():
    _p["alignopsd"] = {**_ALIGN_COMMON, **_p["alignopsd"]}
# What the same launchers set in the trainer (spec 5): the k3 KL to the reference, 0.01 (0.001 for Search), and the
# entropy bonus 0.001 of the AlignOPSD/AgentOPSD recipes. Applied under the config's own `trainer` keys.
PROFILE_TRAINER: dict[str, dict] = {
    name: {"kl_coef": 0.001 if name.startswith("search") else 0.01, "kl_estimator": "k3", "entropy_coef": 0.001}
    for name in ALIGNOPSD_PROFILES
}


def _under(preset: dict, own: dict) -> dict:
    """`own` over `preset`, recursively for sub-dicts (a config's explicit keys win)."""
    out = dict(preset)
    for k, v in own.items():
        out[k] = _under(preset[k], v) if isinstance(v, dict) and isinstance(preset.get(k), dict) else v
    return out


class CreditSection(_Section):
    # A named launcher profile (spec 4.5): its values apply under this section's own keys.
    profile: Literal["alfworld-3b", "alfworld-7b", "search-3b", "search-7b", "webshop-3b", "webshop-7b"] | None = None
    grpo_scope: Literal["trajectory", "turn"] = "turn"
    norm_adv_by_std: bool = True
    # A GRPO group of one row (opsd/credit/grpo.py): "zero" = advantage 0 (no sibling to compare), "reference" = the
    # released code's raw reward / (1 + 1e-6). null = the method's default ("zero"; agentopsd's reference variant
    # "reference").
    grpo_singleton: Literal["zero", "reference"] | None = None
    opd_coef: float = Field(1.0, ge=-100, le=100)  # grpo_opd: A = A_grpo + opd_coef * (teacher - student)
    use_invalid_action_penalty: bool = True
    invalid_action_penalty_coef: float = Field(0.1, ge=0)
    # A teacher worse than its student (opsd/credit/guard.py): per step, the share of groups whose teacher scores
    # the winning trajectories below the student is reported ("report"); "downweight" scales those groups'
    # teacher-student gap by teacher_guard_weight before credit, "skip" sets it to 0 (no distillation term).
    teacher_guard: Literal["report", "downweight", "skip"] = "report"
    teacher_guard_weight: float = Field(0.5, ge=0, le=1)
    # Teacher-verifier disagreement per prompt-length bucket (opsd/credit/diagnostics.py): bucket edges in tokens.
    diagnostic_prompt_buckets: list[int] = Field(default_factory=lambda: [1024, 2048, 4096, 8192])
    alignopsd: AlignSection = AlignSection()
    agentopsd: AgentOPSDSection = AgentOPSDSection()
    gc_opd: GCOPDSection = GCOPDSection()
    uni_opd: UniOPDSection = UniOPDSection()
    power_opd: PowerOPDSection = PowerOPDSection()
    ex_opd: ExOPDSection = ExOPDSection()
    fire_opd: FiReOPDSection = FiReOPDSection()
    sdar: SDARSection = SDARSection()

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data):
        if isinstance(data, dict) and isinstance(data.get("profile"), str) and data["profile"] in ALIGNOPSD_PROFILES:
            return _under(ALIGNOPSD_PROFILES[data["profile"]], data)
        return data

    @model_validator(mode="after")
    def _buckets(self) -> "CreditSection":
        b = self.diagnostic_prompt_buckets
        if len(b) > 16 or any(x <= 0 for x in b) or any(hi <= lo for lo, hi in zip(b, b[1:])):
            raise ValueError(f"credit.diagnostic_prompt_buckets must be at most 16 positive token counts in increasing "
                             f"order, got {b}")
        return self


class LoRASection(_Section):
    """LoRA (opsd/lora.py): the trainer trains low-rank adapters on these modules, workers merge them.

    Each targeted weight W [out, in] becomes W + (alpha / r) * B @ A with A [r, in], B [out, r]
    (peft, B = 0 at start: version 0 is the base model). Only A and B train and are published.
    """

    r: int = Field(16, ge=1, le=4096)  # rank
    alpha: float = Field(32.0, gt=0)  # scale = alpha / r
    # Dropout on the adapter's input while training. 0 by default: with dropout the PPO ratio of
    # the first epoch is no longer 1 (the sampler and pi_old see the undropped model).
    dropout: float = Field(0.0, ge=0, lt=1)
    # Plain module names (the last part of a module path, e.g. q_proj); every nn.Linear of the
    # model with that name is adapted. Default: the attention and MLP projections of Llama-style models.
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )

    @model_validator(mode="after")
    def _plain_names(self) -> "LoRASection":
        bad = [t for t in self.target_modules if not t.isidentifier()]
        if bad:
            raise ValueError(f"lora.target_modules must be plain module names like q_proj, got {bad}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules repeats a name: {self.target_modules}")
        return self


# verl's and TRL's names for what opsd calls otherwise: a config written for them is told the opsd key to write.
FOREIGN_TRAINER_KEYS = {
    "use_kl_loss": "kl_coef (> 0 turns the KL term on)", "kl_loss_coef": "kl_coef", "beta": "kl_coef",
    "kl_loss_type": "kl_estimator (k1, k2, k3 = low_var_kl)", "loss_agg_mode": "loss_agg",
    "loss_type": "loss_agg (TRL grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm, dapo = token-mean)",
    "importance_sampling_level": "importance_level", "entropy_coeff": "entropy_coef",
    "clip_ratio": "clip_ratio_low and clip_ratio_high", "epsilon": "clip_ratio_low", "epsilon_high": "clip_ratio_high",
    "num_iterations": "ppo_epochs", "max_grad_norm": "grad_clip", "learning_rate": "lr",
    "rollout_is": "truncated_is: true and tis_level", "rollout_is_threshold": "tis_cap",
    "vllm_importance_sampling_correction": "truncated_is", "vllm_importance_sampling_mode": "tis_level and tis_mode",
    "vllm_importance_sampling_clip_max": "tis_cap", "vllm_importance_sampling_clip_min": "tis_cap_low",
}
KL_ESTIMATOR_NAMES = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}  # verl's names of the same estimators


class TrainerSection(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    clip_ratio_low: float = Field(0.2, gt=0)
    clip_ratio_high: float = Field(0.2, gt=0)
    # Dual-clip constant c (spec 5): a negative advantage's loss is capped at -A c. null = plain clipped PPO.
    clip_ratio_c: float | None = Field(3.0, gt=1)
    entropy_coef: float = Field(0.001, ge=0)
    # KL to the reference policy (the run's initial policy, frozen; services/trainer/reference.py), added to each
    # loss token as kl_coef * estimator (spec 5: k3, coef 0.01; 0.001 for Search). 0 = off: no reference is held.
    kl_coef: float = Field(0.0, ge=0, le=100)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k3 = verl's low_var_kl (clamped); k1 = log-ratio; k2 = half its square
    # How the per-token loss becomes the mini-batch's loss (opsd.credit.policy_loss.ppo_loss): token-mean (spec 5),
    # seq-mean-token-mean (TRL grpo), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: / (sequences x
    # loss_agg_norm_tokens)). Over the whole mini-batch, never per micro-batch, in every mode.
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    # Dr. GRPO's constant; null = the run's response budget per trajectory: env.max_turns x rollout.max_new_tokens.
    loss_agg_norm_tokens: int | None = Field(None, ge=1)
    # "sequence" = GSPO: one ratio per trajectory, exp(mean over its loss tokens of (log pi - log pi_old)).
    importance_level: Literal["token", "sequence"] = "token"
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(2, ge=1)  # trajectories per forward/backward
    threads: int = Field(0, ge=0)  # torch threads for the trainer (0 = model.threads): it computes alone
    # Truncated importance sampling against the sampler (spec 5): each token's policy-gradient
    # term is weighted by min(exp(clip(old - sampler, -20, 20)), tis_cap).
    truncated_is: bool = False
    tis_cap: float = Field(5.0, gt=0)
    tis_cap_low: float | None = Field(None, ge=0)  # a lower bound too (null = none)
    # token: one weight per token; sequence: exp(sum over the trajectory's loss tokens of (old - sampler)) for all of
    # them. truncate: the weight is clamped to [tis_cap_low, tis_cap]; mask: outside it the weight is 0 (TRL's
    # *_mask modes: at sequence level the whole trajectory drops out of the policy-gradient term).
    tis_level: Literal["token", "sequence"] = "token"
    tis_mode: Literal["truncate", "mask"] = "truncate"
    # Steps between checkpoints (the resume point; the last step always saves). "auto": every step below 1e9
    # parameters, every 10 steps from 1e9 (opsd.footprint.checkpoint_interval: a 7B fp32 + AdamW checkpoint
    # is ~91 GB, written in the background while the next step's groups are awaited).
    checkpoint_every: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # Complete checkpoints kept: the newest in <run_dir>/checkpoint/, older ones as checkpoint-<step:05d>/.
    keep_checkpoints: int = Field(1, ge=1)
    # A finished run's checkpoint/ keeps the optimizer state (AdamW: twice the model, 1.1 GB for SmolLM2 fp32)
    # so it can be resumed with more run.steps; false drops it once the run is DONE (the policy stays, for
    # `opsd eval` and as a teacher or a new run's model) and such a run can no longer be resumed.
    keep_optimizer_state: bool = True
    # Keep the published weights of every Nth policy version in <run_dir>/snapshots/ (version 0 too when it is
    # published: run.max_staleness >= 1), for learning curves (benchmarks/learning.py evaluates them);
    # 0 = keep none. ~540 MB each for SmolLM2 fp32.
    snapshot_every: int = Field(0, ge=0)
    dump_credit: bool = False  # write each step's credit inputs to <run_dir>/credit/ (replay: opsd credit check)
    # LoRA (opsd/lora.py): None = full fine-tuning; set = train and publish adapters only.
    lora: LoRASection | None = None
    metrics_port: int = 0
    # Under torchrun with several ranks (services/trainer/distributed.py): "auto" = FSDP2 (sharded) on CUDA,
    # DDP (replicated) on CPU; "fsdp2" / "ddp" force one. Ignored by a single process.
    data_parallel: Literal["auto", "fsdp2", "ddp"] = "auto"
    # `opsd run` starts the trainer as `torchrun --nproc-per-node N` when N > 1 (one rank per GPU).
    nproc_per_node: int = Field(1, ge=1, le=64)
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    # non-reentrant gradient checkpointing): less activation memory for about one more forward pass of compute.
    # Changes memory and time, not what is trained.
    gradient_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _foreign_keys(cls, data):
        if isinstance(data, dict):
            named = [f"trainer.{k} is not opsd's: write trainer.{FOREIGN_TRAINER_KEYS[k]}" for k in data
                     if k in FOREIGN_TRAINER_KEYS]
            if named:
                raise ValueError("; ".join(named) + " (docs/policy-loss.md)")
        return data

    @field_validator("kl_estimator", mode="before")
    @classmethod
    def _kl_estimator_name(cls, value):
        return KL_ESTIMATOR_NAMES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _loss_settings(self) -> "TrainerSection":
        if self.tis_cap_low is not None and self.tis_cap_low >= self.tis_cap:
            raise ValueError(f"trainer.tis_cap_low ({self.tis_cap_low:g}) must be below trainer.tis_cap ({self.tis_cap:g})")
        # A setting that would change nothing is refused, not ignored: the run would not be the one the config says.
        # importance_level and the dual clip act from the second epoch: the first one's pi_old is its own forward pass,
        # so every ratio is exactly 1 (one optimizer step per epoch over the whole step; no mini-batch split).
        off_policy = self.ppo_epochs > 1
        idle = [k for k, on, default in (
            ("tis_level", self.truncated_is, "token"), ("tis_mode", self.truncated_is, "truncate"),
            ("tis_cap", self.truncated_is, 5.0), ("tis_cap_low", self.truncated_is, None),
            ("kl_estimator", self.kl_coef > 0, "k3"),
            ("loss_agg_norm_tokens", self.loss_agg == "seq-mean-token-sum-norm", None),
            ("importance_level", off_policy, "token"), ("clip_ratio_c", off_policy, 3.0),
        ) if not on and getattr(self, k) != default]
        if idle:
            raise ValueError(f"trainer.{', trainer.'.join(idle)} set without effect: tis_* need truncated_is: true, "
                             "kl_estimator needs kl_coef > 0, loss_agg_norm_tokens needs loss_agg: seq-mean-token-sum-norm, "
                             "importance_level and clip_ratio_c need ppo_epochs > 1 (the first epoch's ratio is exactly 1)")
        return self


class EvalSection(_Section):
    """`opsd eval` (services/rollout/evaluate.py): the eval split of the env at the papers' validation temperature."""

    temperature: float = Field(0.4, gt=0)
    episodes_per_task: int = Field(1, ge=1, le=64)
    # Tasks played together (one batched generate call per turn, up to rollout.batch_size episodes); their
    # envs are open at once (a TextWorld-Express or ScienceWorld env is a JVM of a few hundred MB).
    parallel_tasks: int = Field(8, ge=1, le=256)
    bootstrap_samples: int = Field(1000, ge=100)  # resamples for the 95% intervals
    seed: int = 0


class SimulateSection(_Section):
    """Simulated compute (benchmarks/overlap.py): every role runs for real on a tiny model and holds each job
    for a configured compute time, so the pipeline's overlap is measured without the cost of a real model.

    Off unless `enabled: true`, and then only with `model.name: tiny-random` (opsd/models/hf.py: a 2-layer,
    hidden-64 random Llama with SmolLM2's tokenizer) on the hf backend: it cannot slow down a real run by
    accident. Everything else is real: Redis streams, message encoding and validation, the environment,
    credit assignment, the PPO update, checkpoints, weight publishing, metrics. A job's real work counts
    toward its compute time and the role sleeps the rest (nothing when the work took longer: the overrun
    shows in the stage's seconds), so each stage takes its configured time:
    rollout_s: seconds per group (the rollout of its G episodes); teacher_s: seconds per group (scoring);
    trainer_s: seconds per step (credit assignment + PPO update; the checkpoint and weight publishing come on
    top, as they are). Every role logs "simulated compute" at start; each metrics.jsonl line carries
    `simulated_compute: true`. Changes only timing, never what is trained (not part of the config hash).
    """

    enabled: bool = False
    rollout_s: float = Field(0.0, ge=0, le=3600)
    teacher_s: float = Field(0.0, ge=0, le=3600)
    trainer_s: float = Field(0.0, ge=0, le=3600)


def base_url(url: str, what: str = "weights.url") -> str:
    """`url` checked as an http(s) base URL such as http://trainer:8000 (scheme lower-cased); raises ValueError
    naming `what` for anything else: no or another scheme, no host, a port outside 1-65535, whitespace, a query or
    fragment."""
    bad = ValueError(f"{what} {url!r} is not an http(s) base URL such as http://trainer:8000")
    if not isinstance(url, str) or any(c.isspace() for c in url):
        raise bad
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or parts.query or parts.fragment:
        raise bad
    return urllib.parse.urlunsplit(parts)


class WeightsSection(_Section):
    """How rollout and teacher get the weights the trainer publishes (opsd/weights.py). Changes only how bytes
    travel, never what is trained (not part of the config hash).

    transport "file": from <run_dir>/weights/, which they must share with the trainer (one machine, or a
    shared volume). "http": from the trainer's HTTP API (GET /weights/<file>, services/trainer/weights_api.py,
    bearer token OPSD_API_TOKEN), so they need no weights volume. url: the trainer's base URL (e.g.
    http://trainer:8000); None = read from the trainer's port file in the run dir (`opsd run` on one box). The
    environment variables OPSD_WEIGHTS_TRANSPORT and OPSD_WEIGHTS_URL, when set, win over them (compose and k8s
    set them beside the volumes they mount: docker-compose.http.yml, k8s/components/weights-http).
    """

    transport: Literal["file", "http"] = "file"
    url: Annotated[str, AfterValidator(base_url)] | None = None


class WandbSection(_Section):
    """Weights & Biases (run.report_to: [wandb]). None: the WANDB_* variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE,
    WANDB_API_KEY, WANDB_BASE_URL for a server of your own), else W&B's default (project "opsd")."""

    project: str | None = Field(None, min_length=1, max_length=128)
    entity: str | None = Field(None, min_length=1, max_length=128)
    group: str | None = Field(None, min_length=1, max_length=128)
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = []
    mode: Literal["online", "offline", "disabled"] | None = None  # offline: files only, `wandb sync` later
    dir: str | None = None  # where wandb/ is written (default: the run directory)
    init_timeout_s: float = Field(90.0, gt=0, le=3600)  # wandb.init's wait for the service (a server down: then counted)


class MlflowSection(_Section):
    """MLflow (run.report_to: [mlflow]). tracking_uri None: MLFLOW_TRACKING_URI, else a SQLite store in the run
    directory (sqlite:///<run_dir>/mlflow.db); experiment_name None: MLFLOW_EXPERIMENT_NAME, else "opsd"."""

    tracking_uri: str | None = Field(None, min_length=1)
    experiment_name: str | None = Field(None, min_length=1, max_length=256)


class TensorBoardSection(_Section):
    """TensorBoard (run.report_to: [tensorboard]): event files in log_dir (default <run_dir>/tensorboard)."""

    log_dir: str | None = Field(None, min_length=1)


class TrackingSection(_Section):
    """What the experiment trackers of run.report_to receive besides metrics.jsonl's values (opsd/tracking.py).

    name: the tracker run's name (default: the run directory's name). trajectories_per_step: rows of the
    per-step trajectory table (0: none); table_chars: the longest text cell (a task, the actions), cut
    beyond; histogram_bins: bins of the advantage, teacher-student gap and span-length histograms.
    Reporting only (not part of the config hash): a resumed run may add or drop a tracker.
    """

    name: str | None = Field(None, min_length=1, max_length=128)
    trajectories_per_step: int = Field(4, ge=0, le=64)
    table_chars: int = Field(500, ge=20, le=10_000)
    histogram_bins: int = Field(64, ge=2, le=1024)
    wandb: WandbSection = WandbSection()
    mlflow: MlflowSection = MlflowSection()
    tensorboard: TensorBoardSection = TensorBoardSection()


class ProbesSection(_Section):
    """Readiness and liveness: every role's GET /readyz and /livez (opsd/probes.py, opsd/service.py). Limits in
    seconds, sized for a 7-8B model on real GPUs: a limit too short restarts a healthy worker mid-job, so they err
    long. Changes only when a hang is declared, never what is trained (not part of the config hash).

    beat_s: the longest a role's work loop may go without a beat while no guarded call runs. A healthy loop
    beats at least every redis.block_ms (a blocking read), on every Redis retry (waits of up to 30 s), while it
    waits for room downstream or for a step's groups; a job or a trainer stage runs under a guard of its own: at
    least twice the longest of those waits.
    generate_s: one engine call: a generate of a batch (one turn of every episode in flight, queued behind the
    engine's other requests), one teacher scoring pass, a policy version's load, the embedder's work on one
    request.
    job_s: one rollout or teacher group in all (every turn of its episodes, its environment steps and embedder
    calls, waiting for a version switch); at least generate_s.
    update_s: each trainer stage of a step: credit assignment and the PPO update with its collectives (FSDP2),
    gathering and publishing the new version, waiting for a checkpoint write (a 7B fp32 + AdamW checkpoint is
    ~91 GB).
    """

    beat_s: float = Field(300.0, gt=0)
    generate_s: float = Field(1800.0, gt=0)
    job_s: float = Field(7200.0, gt=0)
    update_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _job_holds_its_calls(self) -> "ProbesSection":
        if self.job_s < self.generate_s:
            raise ValueError(f"probes.job_s ({self.job_s:g}) must be at least probes.generate_s ({self.generate_s:g}): "
                             "a job makes engine calls")
        return self


class RunConfig(_Section):
    run: RunSection = RunSection()
    redis: RedisSection = RedisSection()
    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    teacher: TeacherSection = TeacherSection()
    embedder: EmbedderSection = EmbedderSection()
    credit: CreditSection = CreditSection()
    trainer: TrainerSection = TrainerSection()
    eval: EvalSection = EvalSection()
    simulate: SimulateSection = SimulateSection()
    weights: WeightsSection = WeightsSection()
    probes: ProbesSection = ProbesSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="before")
    @classmethod
    def _profile_trainer(cls, data):
        """The recipes' trainer coefficients under `trainer`'s own keys (a config's explicit keys win): gc_opd's
        entropy_coef 0 (spec 5), then `credit.profile`'s PROFILE_TRAINER."""
        if not isinstance(data, dict):
            return data

        def field(section: str, name: str):
            value = data.get(section)
            return value.get(name) if isinstance(value, dict) else getattr(value, name, None)

        trainer = data.get("trainer", {})
        if isinstance(trainer, TrainerSection):  # its explicitly set fields win, like a dict's keys
            trainer = trainer.model_dump(include=trainer.model_fields_set)
        if not isinstance(trainer, dict):
            return data
        if field("run", "method") == "gc_opd":
            trainer = _under({"entropy_coef": 0.0}, trainer)
        if field("credit", "profile") in PROFILE_TRAINER:
            trainer = _under(PROFILE_TRAINER[field("credit", "profile")], trainer)
        return {**data, "trainer": trainer}

    def teacher_version(self, policy_version: int) -> int:
        """The policy version the teacher scores a group of `policy_version` with (teacher.version); 0 for an
        external teacher (its one frozen version)."""
        mode = self.teacher.version
        if self.teacher.source == "model" or mode == "frozen":
            return 0
        if mode.startswith("lag:"):
            return max(0, policy_version - int(mode[4:]))
        return policy_version

    def _self_teacher_arg(self, kind: str) -> str | None:
        """The argument of teacher.version `<kind>:<arg>` when a self teacher runs with it, else None."""
        mode = self.teacher.version
        if self.needs_teacher and self.teacher.source == "self" and mode.startswith(f"{kind}:"):
            return mode[len(kind) + 1 :]
        return None

    @property
    def teacher_lag(self) -> int:
        """Versions the teacher may look back beyond a group's own (lag:K -> K, else 0): the trainer keeps their files."""
        return int(self._self_teacher_arg("lag") or 0)

    @property
    def teacher_ema(self) -> float | None:
        """The decay D of teacher.version ema:D for a run with a self teacher, else None (no average kept)."""
        decay = self._self_teacher_arg("ema")
        return None if decay is None else float(decay)

    @property
    def teacher_model(self) -> ModelSection:
        """The model the teacher role serves: teacher.model for an external teacher, else the policy's."""
        return self.teacher.model if self.teacher.source == "model" else self.model

    def groups_in_flight(self, role: Literal["rollout", "teacher"]) -> int:
        """How many groups a `role` worker holds at once: its section's max_groups_in_flight, or by default 1
        on transformers (one group at a time, bit-reproducible) and several on vLLM (rollout 16, teacher 8),
        whose async engine batches the requests of every group in flight."""
        value = getattr(self, role).max_groups_in_flight
        if value is not None:
            return value
        backend = (self.teacher_model if role == "teacher" else self.model).backend
        return {"rollout": 16, "teacher": 8}[role] if backend == "vllm" else 1

    @model_validator(mode="after")
    def _teacher_source(self) -> "RunConfig":
        t = self.teacher
        if t.source == "model" and t.model is None:
            raise ValueError("teacher.source: model needs a teacher.model section (at least its name: a packaged model, "
                             "a local HF directory or a run's final_model/ or checkpoint/)")
        if t.source == "self" and t.model is not None:
            raise ValueError("teacher.model is set but teacher.source is self (the live policy): set teacher.source: model "
                             "to score with that model, or drop teacher.model")
        if t.version.startswith("ema:") and self.trainer.lora is not None and self.needs_teacher:
            raise ValueError(f"teacher.version {t.version} averages the whole policy; with trainer.lora the trainer "
                             "publishes adapters only: use live, frozen or lag:K")
        if t.source == "model" and t.version.startswith(("lag:", "ema:")):
            raise ValueError(f"teacher.version {t.version} needs the live policy's versions (teacher.source: self); "
                             "an external teacher is frozen")
        # ema:0.0 (any number of zeros) averages nothing: it is the live policy under another spelling.
        live = t.version == "live" or (t.version.startswith("ema:") and float(t.version[4:]) == 0.0)
        if self.needs_teacher and t.source == "self" and live and self.env.privileged == "none":
            raise ValueError(f"env.privileged none with the live policy as teacher (teacher.version {t.version}): the "
                             "teacher would be the student "
                             "itself and every teacher-student gap 0; set teacher.source: model, or teacher.version "
                             "frozen, lag:K or ema:D, or give the teacher privileged context")
        if t.model is not None and t.model.cache_dir is None and self.model.cache_dir is not None:
            t.model = t.model.model_copy(update={"cache_dir": self.model.cache_dir})
        return self

    @model_validator(mode="after")
    def _quiet_loops_beat(self) -> "RunConfig":
        # The longest a healthy loop is silent outside a guard (ProbesSection): a blocking Redis read or a Redis
        # retry's wait. Twice that leaves room for a loaded machine.
        quiet = max(self.redis.block_ms / 1000, REDIS_RETRY_WAIT_MAX_S)
        if self.probes.beat_s < 2 * quiet:
            raise ValueError(f"probes.beat_s ({self.probes.beat_s:g}) must be at least {2 * quiet:g} s: twice the longest "
                             f"a healthy loop waits without a beat (redis.block_ms, the {REDIS_RETRY_WAIT_MAX_S:g} s Redis "
                             "retry wait), or a busy worker is restarted as hung")
        return self

    @model_validator(mode="after")
    def _wire_limits(self) -> "RunConfig":
        # What a step makes must pass the wire's checks (opsd.types), or the run fails mid-way with a WireError.
        for what, size in (("rollout.group_size", self.rollout.group_size), ("eval.episodes_per_task",
                                                                               self.eval.episodes_per_task)):
            turns = size * self.env.max_turns
            if turns > MAX_GROUP_TURNS:
                raise ValueError(f"{what} x env.max_turns = {turns} turns a group: at most {MAX_GROUP_TURNS} "
                                 f"(the wire's bound on a group's turns)")
        return self

    @model_validator(mode="after")
    def _known_method(self) -> "RunConfig":
        if self.run.method not in CREDIT_METHODS:
            raise ValueError(f"run.method {self.run.method!r} is not a credit method; known: {', '.join(CREDIT_METHODS)}")
        return self

    @model_validator(mode="after")
    def _distillation_temperature(self) -> "RunConfig":
        # The teacher scores at T = 1 and the gap subtracts the sampler's log-probs:
        # both must use one temperature convention (bad-input case 7).
        if self.needs_teacher and self.rollout.temperature != 1.0:
            raise ValueError(
                f"run.method={self.run.method} distills against sampler log-probs taken at the rollout temperature; "
                f"it must be 1.0 (got {self.rollout.temperature}); only method grpo may sample at another temperature"
            )
        return self

    @model_validator(mode="after")
    def _simulated_compute(self) -> "RunConfig":
        teacher = self.teacher.model
        if self.simulate.enabled and teacher is not None and (teacher.name != "tiny-random" or teacher.backend != "hf"):
            raise ValueError(f"simulate.enabled (simulated compute) runs only with a tiny-random hf teacher.model too "
                             f"(got {teacher.name!r} on {teacher.backend!r})")
        if self.simulate.enabled and (self.model.name != "tiny-random" or self.model.backend != "hf"):
            raise ValueError(
                f"simulate.enabled (simulated compute) runs only with model.name: tiny-random on the hf backend "
                f"(got model.name {self.model.name!r}, backend {self.model.backend!r}): it would add sleeps to a real model's compute"
            )
        return self

    @model_validator(mode="after")
    def _teacher_guard(self) -> "RunConfig":
        guard = self.credit.teacher_guard
        if not self.needs_teacher and guard != "report":
            # grpo has no teacher, so no gap to shrink: the setting would be silently without effect
            raise ValueError(f"credit.teacher_guard {guard} acts on a teacher's gap, and run.method "
                             f"{self.run.method} has no teacher: use report")
        weight_default = CreditSection.model_fields["teacher_guard_weight"].default
        # by value, not model_fields_set: a config dumped and read again (opsd run, --resume) sets every field
        if self.credit.teacher_guard_weight != weight_default and guard != "downweight":
            raise ValueError(f"credit.teacher_guard_weight is used only with credit.teacher_guard: downweight "
                             f"(got {guard}): remove it or set the guard to downweight")
        if self.run.method == "alignopsd" and self.credit.teacher_guard != "report":
            # Its corrected teacher mixes matched views in log space (spec 4.2), so a gap scaled after the teacher
            # would no longer be the rectification `opsd credit check` replays from the dumped views.
            raise ValueError(f"credit.teacher_guard {self.credit.teacher_guard} is not available for alignopsd "
                             "(its rectified teacher is nonlinear in the views): use report")
        return self

    @model_validator(mode="after")
    def _teacher_entropies(self) -> "RunConfig":
        if self.run.method == "fire_opd" and self.teacher_model.backend == "vllm":
            raise ValueError("run.method=fire_opd needs the teacher's entropies, which the vllm backend does not report: "
                             "serve the teacher with backend hf")
        return self

    @model_validator(mode="after")
    def _vllm_conventions(self) -> "RunConfig":
        # vLLM reports the sampled token's log-prob after top-p renormalization, and no entropies:
        # refuse what would silently break the sampler = trainer convention (bad-input case 6).
        if self.model.backend != "vllm":
            return self
        if self.rollout.top_p != 1.0:
            raise ValueError(
                f"model.backend=vllm reports nucleus-renormalized log-probs when rollout.top_p < 1 (got "
                f"{self.rollout.top_p}); the trainer recomputes log softmax(z/T) over the whole vocabulary: use top_p 1.0"
            )
        if not 0.01 <= self.rollout.temperature <= 2.0:  # vLLM clamps below 0.01 and refuses above 2
            raise ValueError(f"model.backend=vllm samples at temperatures in [0.01, 2] (got rollout.temperature "
                             f"{self.rollout.temperature})")
        return self

    @property
    def needs_teacher(self) -> bool:
        return self.run.method != "grpo"

    @property
    def cache_root(self) -> Path:
        """Where converted models and generated games are cached (shared by all roles)."""
        return Path(self.model.cache_dir or os.environ.get("OPSD_CACHE") or Path.home() / ".cache" / "opsd")

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        """Read a YAML file (`read_yaml`); raises FileNotFoundError, ValueError (an alias bomb, nesting too deep) or
        pydantic.ValidationError."""
        data = read_yaml(path) or {}
        return cls.model_validate(data)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


# A real config has a few hundred values; YAML aliases can make a few hundred bytes expand to billions
# (an "anchor bomb": each level of aliases multiplies the values every later pass has to walk).
MAX_CONFIG_VALUES = 100_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a mapping that repeats a key: PyYAML keeps the last one silently, so a second
    `trainer:` block appended to a config would replace the first one whole. A repeated merge key (`<<: *a` twice)
    is refused too, and so is a repeat inside an inline mapping merged in (`<<: {lr: 1, lr: 2}`), which PyYAML
    merges without ever constructing it."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()  # id() of the mappings checked (the nodes live as long as the loader)

    def flatten_mapping(self, node):
        # Called on every mapping before its merge keys are expanded, and on each mapping merged in. Once expanded,
        # a mapping holds its own keys after the merged ones (an override, not a repeat): checked only once.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen, merges = set(), 0
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    merges += 1
                    if merges > 1:
                        raise yaml.constructor.ConstructorError(None, None, "the merge key << appears twice in one "
                                                                "mapping (merge several: <<: [*a, *b])", key_node.start_mark)
                    continue
                key = self.construct_object(key_node)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeLoader refuses it with its own message
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping",
                                                            key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)


def read_yaml(path: str | Path) -> Any:
    """The YAML document of `path` (yaml.safe_load, refusing a repeated key). Raises OSError, UnicodeDecodeError,
    yaml.YAMLError (a repeated key: ConstructorError), or ValueError when its aliases expand it past
    MAX_CONFIG_VALUES values (counted without expanding: the walk stops at the cap, a self-referencing alias
    included) or it nests deeper than PyYAML's recursive parser can follow."""
    text = Path(path).read_text()
    try:
        loader = _UniqueKeyLoader(text)  # what yaml.safe_load does, with the repeated-key check
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except RecursionError:  # `[[[[...` a few thousand deep: a RuntimeError, outside every caller's one-line path
        raise ValueError("the document nests deeper than a YAML parser follows (thousands of [ or {?): refused") from None
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ValueError(f"the document expands to more than {MAX_CONFIG_VALUES} values (YAML aliases?): refused")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return data


# What may change when a run resumes (or between the roles of one run); everything else is the run's identity.
RESUMABLE_FIELDS = (
    ("run", "steps"), ("run", "output_dir"), ("run", "step_timeout_s"), ("run", "max_restarts"),
    ("redis", "url"), ("redis", "block_ms"), ("redis", "reclaim_idle_ms"), ("redis", "max_deliveries"),
    ("redis", "max_stream_lag"), ("teacher", "embedder_timeout_s"), ("teacher", "embedder_deadline_s"),
    ("trainer", "dump_credit"), ("trainer", "data_parallel"), ("trainer", "nproc_per_node"), ("trainer", "snapshot_every"),
    ("trainer", "keep_optimizer_state"), ("credit", "diagnostic_prompt_buckets"),  # what is reported, not what is trained
    ("trainer", "gradient_checkpointing"),  # memory, not what is trained
    ("trainer", "checkpoint_every"), ("trainer", "keep_checkpoints"),  # resume points, not what is trained
    ("run", "report_to"),  # where the run is reported
)
# Fields added after runs already existed: at their defaults they are left out of the hash, so a
# checkpoint written before they existed still resumes.
ADDED_FIELDS = (
    ("model", "device"), ("model", "vllm"), ("trainer", "lora"), ("env", "eval_pool"), ("env", "privileged"),
    ("env", "twx"), ("env", "scienceworld"), ("env", "alfworld"), ("env", "search"), ("env", "webshop"),
    ("env", "reasoning_gym"), ("embedder", "device"), ("env", "evidence"), ("embedder", "trust_remote_code"),
    ("trainer", "kl_coef"), ("trainer", "kl_estimator"), ("trainer", "loss_agg"), ("trainer", "loss_agg_norm_tokens"),
    ("trainer", "importance_level"), ("trainer", "tis_cap_low"), ("trainer", "tis_level"), ("trainer", "tis_mode"),
    ("credit", "grpo_singleton"),
)
# ModelSection fields added after runs already existed, in `model:` and an external teacher's `teacher.model:`
# alike: at their defaults they are left out of the hash.
ADDED_MODEL_FIELDS = ("revision", "trust_remote_code", "stop_token_ids", "chat_template", "chat_template_kwargs")
# Sections that never change what a run trains (dropped from the hash whole).
UNHASHED_SECTIONS = ("eval", "simulate", "weights", "probes", "tracking")


def hashed_config(cfg) -> dict:
    """The resolved config (a RunConfig) as JSON data, without RESUMABLE_FIELDS, ADDED_FIELDS and ADDED_MODEL_FIELDS at
    their defaults and any section's metrics_port."""
    data = cfg.model_dump(mode="json")
    for section in UNHASHED_SECTIONS:
        data.pop(section, None)
    for section, name in RESUMABLE_FIELDS:
        data[section].pop(name, None)
    defaults = type(cfg)().model_dump(mode="json")
    for section, name in ADDED_FIELDS:
        if data[section].get(name) == defaults[section][name]:
            data[section].pop(name, None)
    for model in (data["model"], data["teacher"].get("model")):
        for name in ADDED_MODEL_FIELDS:
            if model is not None and model.get(name) == defaults["model"][name]:
                model.pop(name, None)
    for section in data.values():
        if isinstance(section, dict):
            section.pop("metrics_port", None)
    return data


def config_hash(hashed: dict) -> str:
    """sha256 (hex) of a `hashed_config(cfg)` serialized with sorted keys: equal for configs a run may resume under."""
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()
