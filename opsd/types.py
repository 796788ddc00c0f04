"""The data that flows between roles: TaskGroup -> RolloutGroup -> ScoredGroup.

Every message is a small dataclass whose array fields are numpy arrays with a
fixed dtype (checked on the wire by `opsd.wire`). Shape suffixes follow the
house convention: `_S` = tokens of one trajectory (prompt, responses and
observations in order), `_M` = the turns of one group in canonical order
(sorted by rollout id, then turn id), `_MM` = [source turn, target turn].

Token layout of one trajectory (token-in/token-out, never re-rendered):

    token_ids_S = prompt(turn 0) + response(0) + separator/observation(0)
                  + response(1) + ... + response(K-1)

Turn k's prompt is `token_ids_S[:turns[k].response_start]`; its response is
`token_ids_S[response_start:response_end]`. `loss_mask_S` is 1 exactly on the
sampled tokens; prefilled tokens (e.g. `<action>`), separators and
observations are prompt (mask 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

MAX_GROUP_SIZE = 1024  # sibling rollouts per task: a bigger value on the wire would make a worker build millions of games
# |reward| bound: rewards are z-scored (or centred) in float32 by the trainer; a finite
# float64 reward like 1e39 would become inf there and crash the step.
MAX_ABS_REWARD = 1e9
# Turns of one group (all its trajectories): the teacher and the trainer build [M, M]
# matrices per group (64 MB of float32 at 4096), so an unbounded M is an out-of-memory kill.
MAX_GROUP_TURNS = 4096
# A turn's privileged hint (remaining gold path): bounded so a message stays small.
MAX_HINT_ACTIONS = 64
MAX_HINT_CHARS = 256
SIMILARITY_TOLERANCE = 1e-3  # cosine H may exceed [-1, 1] by float noise (FAISS inner products), not more
LOGPROB_TOLERANCE = 1e-4  # a log-prob is <= 0; tiny positive values are float noise
ENTROPY_TOLERANCE = 1e-4  # an entropy lies in [0, log V]; float noise may step outside by this much
# Sentence-embedding width bound (MiniLM 384, Qwen3-Embedding-0.6B 1024): [M, D] arrays stay small.
MAX_EMBEDDING_DIM = 4096

FINISH_REASONS = ("stop", "length")  # sampler finish reason of one turn
# "done": the episode ended by the agent without success (a wrong final answer, a purchase scoring below 1).
EPISODE_ENDINGS = ("won", "lost", "done", "max_turns", "truncated", "error")


class MessageError(ValueError):
    """A message violates its schema (wrong type, shape, dtype, NaN, bounds)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise MessageError(msg)


def _check_array(name: str, arr: Any, dtype: np.dtype | type, ndim: int) -> None:
    _check(isinstance(arr, np.ndarray), f"{name}: expected numpy array, got {type(arr).__name__}")
    _check(arr.dtype == np.dtype(dtype), f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    _check(arr.ndim == ndim, f"{name}: expected {ndim}-d array, got shape {arr.shape}")
    if arr.dtype.kind == "f":
        _check(bool(np.isfinite(arr).all()), f"{name}: contains NaN or inf")


def _check_entropy(name: str, arr: Any, loss_mask_S: np.ndarray, vocab_size: int | None) -> None:
    """float32 [S] entropies (nats): finite, in [0, log V] (to ENTROPY_TOLERANCE), 0 off the loss mask."""
    _check_array(name, arr, np.float32, 1)
    _check(arr.shape == loss_mask_S.shape, f"{name}: length {arr.shape[0]} != trajectory length {loss_mask_S.shape[0]}")
    _check(bool((arr >= -ENTROPY_TOLERANCE).all()), f"{name}: a negative entropy")
    if vocab_size is not None and arr.size:
        _check(float(arr.max()) <= math.log(vocab_size) + ENTROPY_TOLERANCE, f"{name}: an entropy > log(vocab size)")
    _check(not bool(arr[loss_mask_S == 0].any()), f"{name}: nonzero off the loss mask")


@dataclass
class TaskGroup:
    """One task to be played G times by the rollout role with policy `policy_version`.

    `game` is the task as `opsd.envs.base.Task.to_dict()` (the adapter of
    env `env` rebuilds it); `privileged_info` is the text the teacher sees
    and the student does not (SkillBank skills and the walkthrough, see
    `opsd.skills.privileged_text`); `category` is the reporting bucket
    (ALFWorld task type, Search data source, ...).
    """

    group_id: str
    task_id: str
    step: int
    policy_version: int
    group_size: int
    env: str
    game: dict[str, Any]
    privileged_info: str
    max_turns: int
    category: str = ""

    def validate(self) -> None:
        _check(bool(self.group_id) and bool(self.task_id), "TaskGroup: empty group_id or task_id")
        _check(
            1 <= self.group_size <= MAX_GROUP_SIZE,
            f"TaskGroup: group_size must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}",
        )
        _check(self.max_turns >= 1, f"TaskGroup: max_turns must be >= 1, got {self.max_turns}")
        _check(self.policy_version >= 0 and self.step >= 0, "TaskGroup: negative step or policy_version")


@dataclass
class TurnRecord:
    """One agent turn: where its response lies in the trajectory and what it parsed to."""

    turn_id: int
    response_start: int
    response_end: int
    text: str  # decoded response, including any prefilled opening tag
    thinking: str  # parsed <think> content ("" when absent)
    action: str  # parsed action ("" when invalid)
    format_valid: bool
    finish_reason: str  # "stop" (end of turn token sampled) or "length" (token cap)
    observation: str  # the environment's reply to this turn ("" after the last turn)
    # The remaining gold path from the state this turn acted in (privileged: the env's
    # `EnvStep.policy_commands`, at most MAX_HINT_ACTIONS); [] when the env does not know it.
    hint: list[str] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """Cut by the token cap: from the sampler's finish reason, never from the last id (case 16)."""
        return self.finish_reason == "length"

    @property
    def format_error(self) -> bool:
        """Invalid format in a reply the model ended itself; a truncated reply is not one (case 16)."""
        return not self.format_valid and not self.truncated


@dataclass
class Trajectory:
    """One episode of one sibling rollout, as exact token ids.

    Arrays: token_ids_S int32 [S]; sampler_logprobs_S float32 [S] (natural-log
    probability of each sampled token under the sampling temperature, 0 where
    loss_mask is 0); loss_mask_S uint8 [S]. `reward` is the terminal episode
    reward in [0, 1] from the environment (1.0 won, 0.0 otherwise; WebShop: the purchase score).

    Optional (None when the sampler did not report it, e.g. messages from
    before the field existed): sampler_entropy_S float32 [S], the entropy in
    nats of the distribution each sampled token was drawn from (softmax at the
    sampling temperature, renormalized to the top-p nucleus when top_p < 1),
    in [0, log V], 0 where loss_mask is 0 (FiRe-OPD's student confusion, spec 3).
    4 bytes per token, like the log-probs.

    `opening` is the episode's first user message as the student read it (the env's opening
    observation, which states the task, and the admissible commands when listed); "" in messages
    from before the field.
    """

    rollout_id: str
    token_ids_S: np.ndarray
    sampler_logprobs_S: np.ndarray
    loss_mask_S: np.ndarray
    turns: list[TurnRecord]
    reward: float
    won: bool
    ending: str
    sampler_entropy_S: np.ndarray | None = None
    opening: str = ""

    def validate(self, vocab_size: int | None = None) -> None:
        name = f"Trajectory {self.rollout_id}"
        _check_array(f"{name}.token_ids_S", self.token_ids_S, np.int32, 1)
        _check_array(f"{name}.sampler_logprobs_S", self.sampler_logprobs_S, np.float32, 1)
        _check_array(f"{name}.loss_mask_S", self.loss_mask_S, np.uint8, 1)
        S = self.token_ids_S.shape[0]
        _check(
            self.sampler_logprobs_S.shape[0] == S and self.loss_mask_S.shape[0] == S,
            f"{name}: token_ids, sampler_logprobs and loss_mask lengths differ",
        )
        _check(bool(((self.loss_mask_S == 0) | (self.loss_mask_S == 1)).all()), f"{name}: loss_mask not 0/1")
        _check(bool((self.sampler_logprobs_S <= LOGPROB_TOLERANCE).all()), f"{name}: a log-prob is positive")
        if self.sampler_entropy_S is not None:
            _check_entropy(f"{name}.sampler_entropy_S", self.sampler_entropy_S, self.loss_mask_S, vocab_size)
        if S:
            _check(int(self.token_ids_S.min()) >= 0, f"{name}: negative token id")
            if vocab_size is not None:
                _check(int(self.token_ids_S.max()) < vocab_size, f"{name}: token id >= vocab size {vocab_size}")
        _check(self.ending in EPISODE_ENDINGS, f"{name}: unknown ending {self.ending!r}")
        _check(math.isfinite(self.reward), f"{name}: reward is not finite")
        _check(abs(self.reward) <= MAX_ABS_REWARD, f"{name}: |reward| {self.reward} > {MAX_ABS_REWARD}")
        prev_end = 0
        for k, t in enumerate(self.turns):
            _check(t.turn_id == k, f"{name}: turn ids must be 0..K-1 in order")
            _check(
                prev_end <= t.response_start <= t.response_end <= S,
                f"{name}: turn {k} span [{t.response_start},{t.response_end}) out of order or bounds",
            )
            _check(t.finish_reason in FINISH_REASONS, f"{name}: turn {k} finish_reason {t.finish_reason!r}")
            _check(isinstance(t.hint, list) and all(isinstance(a, str) for a in t.hint),
                   f"{name}: turn {k} hint must be a list of str, got {type(t.hint).__name__}")
            _check(len(t.hint) <= MAX_HINT_ACTIONS and all(len(a) <= MAX_HINT_CHARS for a in t.hint),
                   f"{name}: turn {k} hint longer than {MAX_HINT_ACTIONS} actions of {MAX_HINT_CHARS} chars")
            prev_end = t.response_end
        inside = np.zeros(S, dtype=bool)
        for t in self.turns:
            inside[t.response_start : t.response_end] = True
        _check(not bool((self.loss_mask_S.astype(bool) & ~inside).any()), f"{name}: loss token outside a response")

    def response_slice(self, k: int) -> slice:
        t = self.turns[k]
        return slice(t.response_start, t.response_end)


@dataclass
class RolloutGroup:
    """The G sibling trajectories of one TaskGroup, all sampled with `task.policy_version`."""

    task: TaskGroup
    trajectories: list[Trajectory]
    prompt_format: str  # "action" (action-only) or "think" (the papers' format)
    rollout_seconds: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def group_id(self) -> str:
        return self.task.group_id

    def validate(self, vocab_size: int | None = None) -> None:
        _check(self.schema_version == SCHEMA_VERSION, f"schema_version {self.schema_version} != {SCHEMA_VERSION}")
        self.task.validate()
        _check(len(self.trajectories) >= 1, "RolloutGroup: no trajectories")
        ids = [t.rollout_id for t in self.trajectories]
        _check(len(set(ids)) == len(ids), "RolloutGroup: duplicate rollout ids")
        _check(self.prompt_format in ("action", "think"), f"unknown prompt_format {self.prompt_format!r}")
        _check(
            len(self.trajectories) <= self.task.group_size,
            f"RolloutGroup: {len(self.trajectories)} trajectories for group_size {self.task.group_size}",
        )
        for t in self.trajectories:
            _check(len(t.turns) <= self.task.max_turns, f"Trajectory {t.rollout_id}: more turns than max_turns {self.task.max_turns}")
        M = sum(len(t.turns) for t in self.trajectories)
        _check(M <= MAX_GROUP_TURNS, f"RolloutGroup: {M} turns > {MAX_GROUP_TURNS}")
        for t in self.trajectories:
            t.validate(vocab_size)

    def canonical_turns(self) -> list[tuple[int, int]]:
        """(trajectory index, turn index) of every turn, sorted by (rollout_id, turn_id)."""
        order = sorted(range(len(self.trajectories)), key=lambda i: self.trajectories[i].rollout_id)
        return [(i, k) for i in order for k in range(len(self.trajectories[i].turns))]


@dataclass
class ScoredGroup:
    """A RolloutGroup plus the teacher's view of it.

    Per trajectory (aligned with token_ids_S, 0 off the loss mask):
    teacher_logprobs_S = identity view (own privileged history), and
    corrected_logprobs_S = after decision-aligned rectification (spec 4.2).
    Per group, over the M turns in `rollout.canonical_turns()` order:
    similarity_MM[s, t] = H (teacher thinking of s vs student thinking of t),
    eligible_MM[s, t] = structural eligibility (spec 4.1), and the selected
    sources / weights / rho / alpha of each target turn. `teacher_thinking_M`
    is the text the embedder embedded for the teacher (the parsed thinking;
    the parsed action in the action-only format; "" when invalid).

    Optional fields (None in messages from before they existed; the teacher
    fills them as noted). Per trajectory, aligned with token_ids_S:

    - teacher_entropy_S: float32 [S] per trajectory, entropy (nats, T = 1) of
      the identity view's next-token distribution at each response position,
      in [0, log V], 0 off the loss mask (FiRe-OPD's teacher confidence).

    Per group, over the M canonical turns (what a credit dump writes in the
    refvector AlignOPSD schema):

    - teacher_response_M: the teacher's own decoded response (prefill
      included; "" where none was generated); student_thinking_M: the student
      text the embedder embedded (same rule as teacher_thinking_M);
      student_action_M / teacher_action_M: parsed actions ("" = invalid).
    - student_thinking_emb_MD, teacher_thinking_emb_MD, student_action_emb_MD,
      teacher_action_emb_MD: float32 [M, D], the encoder's L2-normalized
      embeddings of those texts (zero rows for empty/invalid text), all four
      or none: None when the embedder was unavailable (identity fallback) or
      not asked for them (the teacher asks only with trainer.dump_credit).
      D = 384 for MiniLM: 4 x 1.5 KiB = 6 KiB per turn.
    - cross_logprobs_M: per target turn t a float32 [K_t, n_t] array, the
      teacher-forced log-probs (T = 1) of all n_t response tokens of t
      (response_end - response_start, loss mask or not) under the privileged
      history of each source in selected_sources_M[t], rows in that order
      (K_t = 0 -> [0, n_t]); 4 K_t n_t bytes per turn. The teacher keeps in
      selected_sources_M only the sources it scored (a view past the context
      budget, or of weight 0, is dropped; weights renormalized), so for every t:
      corrected_logprobs_S[i][response of t] = rectify(teacher_logprobs_S[i][..],
      cross_logprobs_M[t], source_weights_M[t], alpha_M[t]) on the loss mask.
    """

    rollout: RolloutGroup
    teacher_version: int
    teacher_logprobs_S: list[np.ndarray]
    corrected_logprobs_S: list[np.ndarray]
    teacher_thinking_M: list[str]
    similarity_MM: np.ndarray
    eligible_MM: np.ndarray
    selected_sources_M: list[list[int]]
    source_weights_M: list[list[float]]
    rho_M: np.ndarray
    alpha_M: np.ndarray
    identity_fallback: bool = False  # correspondences unavailable: identity views only
    teacher_seconds: float = 0.0
    # Tokens the teacher ran through its model for this group (compute counted): every privileged view's
    # prefix and ids, matched-view continuations and its own generated tokens; 0 from a teacher that did not count.
    teacher_forward_tokens: int = 0
    schema_version: int = SCHEMA_VERSION
    teacher_entropy_S: list[np.ndarray] | None = None
    teacher_response_M: list[str] | None = None
    student_thinking_M: list[str] | None = None
    student_action_M: list[str] | None = None
    teacher_action_M: list[str] | None = None
    student_thinking_emb_MD: np.ndarray | None = None
    teacher_thinking_emb_MD: np.ndarray | None = None
    student_action_emb_MD: np.ndarray | None = None
    teacher_action_emb_MD: np.ndarray | None = None
    cross_logprobs_M: list[np.ndarray] | None = None
    # Which teacher scored: "self:<teacher.version>" (the policy at teacher_version: live, frozen, lag:K) or
    # "model:<name>" (an external frozen model; teacher_version is then 0, its only version).
    teacher: str | None = None

    EMBEDDING_FIELDS = ("student_thinking_emb_MD", "teacher_thinking_emb_MD", "student_action_emb_MD", "teacher_action_emb_MD")

    @property
    def group_id(self) -> str:
        return self.rollout.group_id

    def validate(self, vocab_size: int | None = None) -> None:
        _check(self.schema_version == SCHEMA_VERSION, f"schema_version {self.schema_version} != {SCHEMA_VERSION}")
        self.rollout.validate(vocab_size)
        n = len(self.rollout.trajectories)
        _check(len(self.teacher_logprobs_S) == n, "ScoredGroup: teacher_logprobs_S count != trajectories")
        _check(len(self.corrected_logprobs_S) == n, "ScoredGroup: corrected_logprobs_S count != trajectories")
        for i, traj in enumerate(self.rollout.trajectories):
            for nm, arr in (("teacher_logprobs_S", self.teacher_logprobs_S[i]), ("corrected_logprobs_S", self.corrected_logprobs_S[i])):
                _check_array(f"ScoredGroup.{nm}[{i}]", arr, np.float32, 1)
                _check(arr.shape == traj.token_ids_S.shape, f"ScoredGroup.{nm}[{i}]: length != trajectory length")
                # A positive teacher log-prob would silently inflate every gap built from it.
                _check(bool((arr <= LOGPROB_TOLERANCE).all()), f"ScoredGroup.{nm}[{i}]: a log-prob is positive")
        M = sum(len(t.turns) for t in self.rollout.trajectories)
        _check_array("ScoredGroup.similarity_MM", self.similarity_MM, np.float32, 2)
        _check_array("ScoredGroup.eligible_MM", self.eligible_MM, np.bool_, 2)
        _check(self.similarity_MM.shape == (M, M) and self.eligible_MM.shape == (M, M), f"ScoredGroup: H must be [{M},{M}]")
        _check(
            bool((np.abs(self.similarity_MM) <= 1.0 + SIMILARITY_TOLERANCE).all()),
            "ScoredGroup.similarity_MM: a cosine outside [-1, 1]",
        )
        _check_array("ScoredGroup.rho_M", self.rho_M, np.float32, 1)
        _check_array("ScoredGroup.alpha_M", self.alpha_M, np.float32, 1)
        _check(self.rho_M.shape == (M,) and self.alpha_M.shape == (M,), "ScoredGroup: rho/alpha must be [M]")
        _check(len(self.selected_sources_M) == M and len(self.source_weights_M) == M, "ScoredGroup: sources must be [M]")
        _check(len(self.teacher_thinking_M) == M, "ScoredGroup: teacher_thinking must be [M]")
        for t, (src, w) in enumerate(zip(self.selected_sources_M, self.source_weights_M)):
            _check(len(src) == len(w), f"ScoredGroup: turn {t} sources and weights differ in length")
            _check(all(0 <= s < M for s in src), f"ScoredGroup: turn {t} source index out of range")
            _check(all(math.isfinite(x) for x in w), f"ScoredGroup: turn {t} weight not finite")
        self._validate_optional(M, vocab_size)

    def _validate_optional(self, M: int, vocab_size: int | None) -> None:
        """Checks of the optional fields (see the class docstring); each may be None."""
        trajs = self.rollout.trajectories
        if self.teacher is not None:
            _check(isinstance(self.teacher, str) and 0 < len(self.teacher) <= 4200, "ScoredGroup.teacher: 1-4200 characters")
        if self.teacher_entropy_S is not None:
            _check(len(self.teacher_entropy_S) == len(trajs), "ScoredGroup: teacher_entropy_S count != trajectories")
            for i, (traj, arr) in enumerate(zip(trajs, self.teacher_entropy_S)):
                _check_entropy(f"ScoredGroup.teacher_entropy_S[{i}]", arr, traj.loss_mask_S, vocab_size)
        for nm in ("teacher_response_M", "student_thinking_M", "student_action_M", "teacher_action_M"):
            val = getattr(self, nm)
            if val is not None:
                _check(len(val) == M, f"ScoredGroup: {nm} must have {M} entries, got {len(val)}")
        embs = [getattr(self, nm) for nm in self.EMBEDDING_FIELDS]
        if any(e is not None for e in embs):
            _check(all(e is not None for e in embs), f"ScoredGroup: embeddings {', '.join(self.EMBEDDING_FIELDS)} come all four or none")
            text_of = {"student_thinking_emb_MD": self.student_thinking_M, "teacher_thinking_emb_MD": self.teacher_thinking_M,
                       "student_action_emb_MD": self.student_action_M, "teacher_action_emb_MD": self.teacher_action_M}
            for nm, arr in zip(self.EMBEDDING_FIELDS, embs):
                _check_array(f"ScoredGroup.{nm}", arr, np.float32, 2)
            D = embs[0].shape[1]
            _check(1 <= D <= MAX_EMBEDDING_DIM, f"ScoredGroup: embedding width {D} outside [1, {MAX_EMBEDDING_DIM}]")
            for nm, arr in zip(self.EMBEDDING_FIELDS, embs):
                _check(arr.shape == (M, D), f"ScoredGroup.{nm}: expected shape ({M}, {D}), got {arr.shape}")
                # The encoder's vectors are unit length (or zero): anything longer is not an embedding.
                _check(bool((np.linalg.norm(arr, axis=1) <= 1.0 + SIMILARITY_TOLERANCE).all()), f"ScoredGroup.{nm}: a row longer than 1")
                txt = text_of[nm]
                _check(txt is not None, f"ScoredGroup.{nm} needs its texts")
                empty = np.array([not x for x in txt], dtype=bool)
                _check(not bool(arr[empty].any()), f"ScoredGroup.{nm}: nonzero row for an empty text")
        if self.cross_logprobs_M is not None:
            _check(len(self.cross_logprobs_M) == M, f"ScoredGroup: cross_logprobs_M must have {M} entries")
            for t, ((i, k), arr) in enumerate(zip(self.rollout.canonical_turns(), self.cross_logprobs_M)):
                nm = f"ScoredGroup.cross_logprobs_M[{t}]"
                _check_array(nm, arr, np.float32, 2)
                rec = trajs[i].turns[k]
                shape = (len(self.selected_sources_M[t]), rec.response_end - rec.response_start)
                _check(arr.shape == shape, f"{nm}: expected shape {shape} (sources, response tokens), got {arr.shape}")
                _check(bool((arr <= LOGPROB_TOLERANCE).all()), f"{nm}: a log-prob is positive")


@dataclass
class CreditBatch:
    """What an advantage estimator sees: every turn of a training batch as one row.

    Rows are in canonical order, sorted by (task_id, rollout_id, turn_id) as
    strings/ints (spec 4). `task_id` is the GRPO group (one TaskGroup's
    group_id), `rollout_id` the trajectory. Arrays ([M] rows, [L] response
    tokens, right-padded with mask 0):

    - loss_mask_ML uint8/float32 0/1, student_logprobs_ML float32 (pi_old of the
      sampled token), teacher_logprobs_ML float32 (identity privileged view),
      corrected_logprobs_ML float32 (after rectification; = teacher where no
      source).
    - similarity_blocks float32 and eligible_blocks bool: per task id, one
      [m, m] block ([source, target]) over that task's m rows in batch order
      (opsd.credit.batch.task_rows). Pairs never cross tasks (spec 4.1), so
      nothing [M, M] over the step is kept (opsd.credit.batch).
    - per row: task_id, rollout_id, turn_id, data_source, episode_reward
      (raw return repeated on every turn), is_action_valid.

    Teacher fields may be None for methods that need no teacher (GRPO).
    """

    task_id: list[str]
    rollout_id: list[str]
    turn_id: list[int]
    data_source: list[str]
    episode_reward: np.ndarray  # float32 [M]
    is_action_valid: np.ndarray  # bool [M]
    loss_mask_ML: np.ndarray
    student_logprobs_ML: np.ndarray
    teacher_logprobs_ML: np.ndarray | None = None
    corrected_logprobs_ML: np.ndarray | None = None
    similarity_blocks: dict[str, np.ndarray] | None = None
    eligible_blocks: dict[str, np.ndarray] | None = None
    # Needed by single methods only (None otherwise), float32 [M, L]:
    base_logprobs_ML: np.ndarray | None = None  # ex_opd: the initial policy's log-prob of the token
    teacher_entropy_ML: np.ndarray | None = None  # fire_opd: entropy (nats) of the teacher's next-token distribution
    student_entropy_ML: np.ndarray | None = None  # fire_opd: entropy (nats) of the sampler's distribution

    @property
    def num_rows(self) -> int:
        return len(self.task_id)


@dataclass(frozen=True)
class MessageLimits:
    """Bounds a run's config puts on the messages it makes, beyond the wire's fixed ones (checked at decode by
    each role's queue: `check_limits`). A schema-valid message past them (a 2M-token turn, 4,095 empty turns)
    would make the teacher or trainer allocate gigabytes; it is dead-lettered instead.

    max_tokens: token ids of one trajectory: a rollout never grows its context past model.max_model_len, but
      one truncated before its first turn holds its whole first prompt (an observation, an admissible list,
      the system and one-shot text); bounded by model.max_model_len + 4 tokens a character of
      env.max_observation_chars + 1024, loose for every shipped config;
    max_turns: TaskGroup.max_turns (env.max_turns), hence the turns of each of its trajectories;
    max_group_size: TaskGroup.group_size, the trajectories of one group (rollout.group_size).
    """

    max_tokens: int
    max_turns: int
    max_group_size: int

    @classmethod
    def for_config(cls, cfg: Any) -> "MessageLimits":
        """The limits of a RunConfig."""
        return cls(max_tokens=cfg.model.max_model_len + 4 * cfg.env.max_observation_chars + 1024,
                   max_turns=cfg.env.max_turns, max_group_size=cfg.rollout.group_size)


def check_limits(msg: Any, limits: MessageLimits) -> None:
    """Raise MessageError when a TaskGroup, RolloutGroup or ScoredGroup (already validated) exceeds `limits`."""
    task = msg.rollout.task if isinstance(msg, ScoredGroup) else msg.task if isinstance(msg, RolloutGroup) else msg
    if isinstance(task, TaskGroup):
        _check(task.group_size <= limits.max_group_size,
               f"group_size {task.group_size} > this run's rollout.group_size {limits.max_group_size}")
        _check(task.max_turns <= limits.max_turns, f"max_turns {task.max_turns} > this run's env.max_turns {limits.max_turns}")
    group = msg.rollout if isinstance(msg, ScoredGroup) else msg if isinstance(msg, RolloutGroup) else None
    for traj in group.trajectories if group is not None else []:  # (its turns: at most task.max_turns, validated)
        _check(traj.token_ids_S.shape[0] <= limits.max_tokens,
               f"trajectory {traj.rollout_id}: {traj.token_ids_S.shape[0]} tokens > this run's bound {limits.max_tokens} "
               f"(model.max_model_len + the last observation)")

