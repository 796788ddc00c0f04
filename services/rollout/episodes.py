"""Play the G sibling episodes of one TaskGroup, token-in/token-out.

Each trajectory's ids are built only by appending: the initial prompt ids,
then per turn the sampled ids (loss mask 1, sampler log-probs kept) and the
ids of the next user turn from `ChatFormat.continuation_ids` (mask 0). Text
is decoded only to parse the action; it is never re-encoded, so turn k's
prompt + response ids are always a prefix of turn k+1's prompt (case 8).

All still-active episodes of the group are generated together, one
`backend.generate` call per turn (split into chunks of
`RolloutSection.batch_size` when the group is larger).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np

from opsd.chat import ChatFormat, decode, parse_response
from opsd.config import EnvSection, RolloutSection
from opsd.envs import Env, EnvContext, EnvStep, Task, get_adapter
from opsd.models.hf import NonFiniteLogitsError
from opsd.types import (
    ENTROPY_TOLERANCE, FINISH_REASONS, LOGPROB_TOLERANCE, MAX_HINT_ACTIONS, MAX_HINT_CHARS, RolloutGroup, TaskGroup,
    Trajectory, TurnRecord,
)
from services.rollout import prompts

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    """Counters of one group, for metrics and logs (not part of the wire message).

    turns / valid_turns: agent turns played / with a format-valid action;
    format_errors: invalid turns the model ended itself (finish "stop"); a
    reply cut by the token cap is counted in length_finishes, never here (case 16);
    env_invalid_actions: format-valid actions the environment did not accept;
    wins: episodes won; generated_tokens: sampled tokens (all turns);
    nonfinite_logprobs: sampled tokens whose log-prob came back NaN/inf or
    clearly positive (masked),
    plus rows the backend refused for non-finite logits (those episodes end "error");
    length_finishes: responses cut by the token cap; truncated_episodes:
    episodes ended because the context budget ran out; generate_seconds /
    env_seconds / seconds: wall time in the sampler, in the games, in total.
    """

    episodes: int = 0
    turns: int = 0
    valid_turns: int = 0
    format_errors: int = 0
    env_invalid_actions: int = 0
    wins: int = 0
    generated_tokens: int = 0
    nonfinite_logprobs: int = 0
    length_finishes: int = 0
    truncated_episodes: int = 0
    generate_calls: int = 0
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    seconds: float = 0.0

    def add(self, other: "RolloutStats") -> None:
        """Add `other`'s counters and seconds to these (one episode's stats into its group's)."""
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class _Episode:
    rollout_id: str
    env: Env | None  # None once closed
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    has_entropy: bool = True  # False once a generation came without entropies
    mask: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    admissible: list[str] = field(default_factory=list)
    hint: list[str] = field(default_factory=list)  # the remaining gold path from the current state
    won: bool = False
    reward: float = 0.0  # the last step's reward (rewards are terminal)
    ending: str = ""  # "" while running
    opening: str = ""  # the first user message (Trajectory.opening)

    @property
    def done(self) -> bool:
        return bool(self.ending)

    def begin(self, chat: ChatFormat, env_cfg: EnvSection, first: EnvStep) -> None:
        """Start from the env's opening step: its admissible commands and hint, the first prompt's ids, the opening text."""
        self.admissible, self.hint = first.admissible_commands, _hint(first)
        self.opening = prompts.first_user_message(first.observation, first.admissible_commands, env_cfg)
        self.append_prompt(initial_prompt_ids(chat, env_cfg, first))

    def append_prompt(self, ids: list[int]) -> None:
        self.ids.extend(int(i) for i in ids)
        self.logprobs.extend([0.0] * len(ids))
        self.entropies.extend([0.0] * len(ids))
        self.mask.extend([0] * len(ids))

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            rollout_id=self.rollout_id,
            token_ids_S=np.asarray(self.ids, dtype=np.int32),
            sampler_logprobs_S=np.asarray(self.logprobs, dtype=np.float32),
            loss_mask_S=np.asarray(self.mask, dtype=np.uint8),
            turns=self.turns,
            reward=float(self.reward),
            won=self.won,
            ending=self.ending or "max_turns",
            sampler_entropy_S=np.asarray(self.entropies, dtype=np.float32) if self.has_entropy else None,
            opening=self.opening,
        )


def rollout_ids(group_size: int) -> list[str]:
    """ "r00", "r01", ... zero-padded (at least 2 digits) so string order = numeric order."""
    width = max(2, len(str(max(group_size - 1, 0))))
    return [f"r{i:0{width}d}" for i in range(group_size)]


def _turn_seed(seed: int, turn: int, chunk: int) -> int:
    # Independent, reproducible streams per (group seed, turn, chunk) without
    # collisions between nearby group seeds (a plain seed + turn would collide).
    return int(np.random.SeedSequence([seed & (2**64 - 1), turn, chunk]).generate_state(1)[0])


def initial_prompt_ids(chat: ChatFormat, env_cfg: EnvSection, first: EnvStep) -> list[int]:
    """Token ids of an episode's first prompt (system, optional one-shot turn, the
    opening observation), ending with the assistant header + prefill."""
    user = prompts.first_user_message(first.observation, first.admissible_commands, env_cfg)
    return chat.initial_prompt_ids(
        prompts.system_prompt(env_cfg.prompt_format, env_cfg.list_admissible, env_cfg.name), user,
        one_shot=prompts.one_shot_examples(env_cfg),
    )


def _fits(n_prompt: int, max_new_tokens: int, max_model_len: int) -> bool:
    return n_prompt + max_new_tokens <= max_model_len


def run_group(
    task: TaskGroup,
    backend: Any,
    chat: ChatFormat,
    env_cfg: EnvSection,
    rollout_cfg: RolloutSection,
    max_model_len: int,
    seed: int,
    cache_dir: Path | str | None = None,
    ctx: EnvContext | None = None,
    guard: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> tuple[RolloutGroup, RolloutStats]:
    """Run `task.group_size` sibling episodes of `task.game` with `backend`.

    Args:
        task: the TaskGroup; `task.game` is an `opsd.envs.base.Task` dict (or
            the env's bare spec), played with the adapter of `task.env`
            (TextWorld games are regenerated locally when their file is missing).
        backend: `HFBackend`-like: `generate(prompts, max_new_tokens,
            temperature, top_p, seed) -> [Generation]`, `tokenizer`,
            `eos_token_id`, `vocab_size`, `policy_version`.
        chat: renders prompt/continuation ids; its prompt format must equal
            `env_cfg.prompt_format`.
        max_model_len: context budget in tokens; a turn is sampled only if
            prompt + `rollout_cfg.max_new_tokens` fits, else the episode ends
            "truncated" (earlier turns kept), so no request ever has a
            non-positive budget.
        seed: group seed; turn t's sampling seed is derived from (seed, t).
        cache_dir: this machine's game cache (`<cache>/textworld/...`); None
            uses `task.game["path"]` as is. Ignored when `ctx` is given.
        ctx: what the adapter needs on this machine (cache, Search's retriever).
        guard: a context manager factory each `backend.generate` call runs
            under (the worker's liveness guard of probes.generate_s).

    Returns:
        (RolloutGroup, RolloutStats). Trajectories are in rollout-id order
        ("r00", "r01", ...), with int32 ids, float32 sampler log-probs (0 off
        the loss mask) and uint8 loss mask; reward = the env's last reward in
        [0, 1] (1.0 for a won episode; 0.0 for one that ran out of turns). Sampled tokens with a non-finite or positive (> 1e-4) log-prob, or
        a non-finite / negative (< -1e-4) entropy, are masked (mask 0, log-prob
        and entropy 0) and counted in `stats.nonfinite_logprobs`.
        `sampler_entropy_S` holds the generations' entropies (clamped to
        [0, log vocab_size], 0 off the mask), or is None for a trajectory
        with a generation that reported none (`Generation.entropies` None).

    Raises:
        ValueError: unknown env, an env other than `env_cfg.name`, a malformed
            task, prompt-format mismatch, or a malformed
            generation from the backend; `opsd.types.MessageError` if the
            built group fails `validate(backend.vocab_size)`.
    """
    (result,) = run_groups([task], backend, chat, env_cfg, rollout_cfg, max_model_len, [seed], cache_dir, ctx, guard)
    if isinstance(result, Exception):
        raise result
    return result


@dataclass
class _Group:
    """One TaskGroup being played by `run_groups`."""

    task: TaskGroup
    seed: int
    stats: RolloutStats
    episodes: list[_Episode] = field(default_factory=list)
    env_task: Task | None = None
    error: Exception | None = None  # set: the group failed; its siblings in the batch go on


def run_groups(
    tasks: list[TaskGroup],
    backend: Any,
    chat: ChatFormat,
    env_cfg: EnvSection,
    rollout_cfg: RolloutSection,
    max_model_len: int,
    seeds: list[int],
    cache_dir: Path | str | None = None,
    ctx: EnvContext | None = None,
    guard: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> list[tuple[RolloutGroup, RolloutStats] | Exception]:
    """Play several TaskGroups together: each turn, the active episodes of every group are sampled in
    `backend.generate` calls of up to `rollout_cfg.batch_size` rows. Why: on a CPU one decode step
    costs about the same for 4 rows as for 16, so batching groups (`opsd eval`'s tasks) multiplies
    the episodes per second. One group alone is played exactly as `run_group` plays it (same seeds).

    Arguments as `run_group`, with one seed per task (`seeds[i]` for `tasks[i]`; a generate call
    draws from the seed of the first group among its rows). Returns, per task in order, its
    (RolloutGroup, RolloutStats) or the exception that failed that group alone (a malformed task,
    an env that never started, a group failing validation); the other groups are unaffected.
    Raises ValueError (for every group) on a config mismatch or a malformed generation.
    """
    if len(seeds) != len(tasks):
        raise ValueError(f"run_groups: {len(tasks)} tasks but {len(seeds)} seeds")
    t_start = time.perf_counter()
    adapter = checked_adapter(chat, env_cfg)
    fmt = env_cfg.prompt_format
    if ctx is None:
        ctx = EnvContext(cache_dir=Path(cache_dir) if cache_dir is not None else None)
    # Never promise more context than the backend itself accepts.
    max_model_len = min(max_model_len, getattr(backend, "max_model_len", max_model_len))
    max_new = rollout_cfg.max_new_tokens
    prefill = chat.prefill_text
    stop_ids = frozenset(backend.stop_token_ids)

    groups = [_Group(task, seed, RolloutStats(episodes=task.group_size)) for task, seed in zip(tasks, seeds)]
    try:
        for g in groups:
            try:
                g.env_task = _checked_task(g.task, env_cfg, backend)
                for rid in rollout_ids(g.task.group_size):
                    t0 = time.perf_counter()
                    env, first = _start(adapter, g.env_task, env_cfg, ctx, g.task, rid)
                    g.stats.env_seconds += time.perf_counter() - t0
                    ep = _Episode(rid, env)
                    g.episodes.append(ep)
                    ep.begin(chat, env_cfg, first)
            except Exception as err:  # noqa: BLE001 - this group fails alone
                g.error = err

        for turn in range(max((t.max_turns for t in tasks), default=0)):
            ready: list[tuple[_Group, _Episode]] = []
            for g in groups:
                if g.error is not None or turn >= g.task.max_turns:
                    continue
                for ep in g.episodes:
                    if ep.done:
                        continue
                    # Checked before sampling: the backend never sees a request without budget.
                    if not _fits(len(ep.ids), max_new, max_model_len):
                        ep.ending = "truncated"
                        continue
                    ready.append((g, ep))
            if not ready:
                break
            for c, lo in enumerate(range(0, len(ready), rollout_cfg.batch_size)):
                rows = ready[lo : lo + rollout_cfg.batch_size]
                rows, gens = _generate(backend, rows, max_new, rollout_cfg, _turn_seed(rows[0][0].seed, turn, c), guard)
                for (g, ep), gen in zip(rows, gens):
                    _play_turn(ep, gen, turn, g.task, chat, backend, env_cfg, max_new, max_model_len, prefill, stop_ids,
                               g.stats, adapter.ACTION_TAGS)
    finally:
        for g in groups:
            for ep in g.episodes:
                try:
                    ep.env.close()
                except Exception:  # noqa: BLE001 - one env failing to close must not leak the others or lose results
                    log.exception("group %s %s: env.close() failed", g.task.group_id, ep.rollout_id)
                # A failed group's error holds this frame (its traceback) and so every env: drop them now,
                # not at the next full garbage collection.
                ep.env = None

    results: list[tuple[RolloutGroup, RolloutStats] | Exception] = []
    for g in groups:
        if g.error is not None:
            results.append(g.error)
            continue
        for ep in g.episodes:
            if not ep.ending:  # loop ran out of turns (only reachable through max_turns)
                ep.ending = "max_turns"
            g.stats.truncated_episodes += ep.ending == "truncated"
            g.stats.wins += ep.won
        g.stats.seconds = time.perf_counter() - t_start
        group = RolloutGroup(task=g.task, trajectories=[ep.to_trajectory() for ep in g.episodes], prompt_format=fmt,
                             rollout_seconds=g.stats.seconds)
        try:
            group.validate(getattr(backend, "vocab_size", None))
        except Exception as err:  # noqa: BLE001 - this group fails alone
            results.append(err)
            continue
        results.append((group, g.stats))
    return results


def checked_adapter(chat: ChatFormat, env_cfg: EnvSection):
    """The env adapter of `env_cfg.name`, after checking that `chat` renders its prompt format and action tags.

    Raises ValueError for an unknown env or a ChatFormat built for another format or env.
    """
    adapter = get_adapter(env_cfg.name)
    fmt = env_cfg.prompt_format
    chat_fmt = getattr(chat, "prompt_format", fmt)
    if chat_fmt != fmt:
        raise ValueError(f"run_group: ChatFormat renders {chat_fmt!r} but env_cfg.prompt_format is {fmt!r}")
    if tuple(getattr(chat, "action_tags", adapter.ACTION_TAGS)) != tuple(adapter.ACTION_TAGS):
        raise ValueError(f"run_group: ChatFormat prefills for tags {chat.action_tags} but env {env_cfg.name!r} uses "
                         f"{adapter.ACTION_TAGS} (build it with ChatFormat.for_env)")
    return adapter


def _checked_task(task: TaskGroup, env_cfg: EnvSection, backend: Any) -> Task:
    """The env Task of `task`, after checking the TaskGroup (ValueError / MessageError when malformed)."""
    task.validate()
    if task.env != env_cfg.name:
        raise ValueError(f"run_group: task is for env {task.env!r} but the env config is {env_cfg.name!r}")
    get_adapter(task.env)
    try:
        env_task = Task.from_dict(task.game) if "spec" in task.game else Task(task.task_id, task.category, dict(task.game))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"run_group: malformed task in group {task.group_id}: {err!r}") from err
    if getattr(backend, "policy_version", task.policy_version) != task.policy_version:
        log.warning("group %s: backend holds policy v%s, task asks for v%s",
                    task.group_id, backend.policy_version, task.policy_version)
    return env_task


def _generate(
    backend: Any, rows: list[tuple[_Group, _Episode]], max_new: int, rollout_cfg: RolloutSection, seed: int,
    guard: Callable[[], ContextManager[Any]],
) -> tuple[list[tuple[_Group, _Episode]], list[Any]]:
    """One batched generate call; returns the rows (group, episode) that got a generation and their generations.

    A backend that refuses rows with non-finite logits (`NonFiniteLogitsError`
    with `.rows`) ends those episodes as "error" (earlier turns kept) and the
    rest of the batch is generated again, so one bad row never sinks the group.
    Every group in the call counts the call and its wall time.
    """
    while rows:
        t0 = time.perf_counter()
        try:
            with guard():
                gens = backend.generate(
                    [list(ep.ids) for _, ep in rows],
                    max_new_tokens=max_new,
                    temperature=rollout_cfg.temperature,
                    top_p=rollout_cfg.top_p,
                    seed=seed,
                )
        except NonFiniteLogitsError as err:
            bad = set(err.rows)
            if not bad or not bad <= set(range(len(rows))):
                raise
            for i in sorted(bad):
                g, ep = rows[i]
                log.warning("group %s %s: non-finite logits, episode ends as error", g.task.group_id, ep.rollout_id)
                ep.ending = "error"
                g.stats.nonfinite_logprobs += 1
            rows = [r for i, r in enumerate(rows) if i not in bad]
            continue
        finally:
            for g in {id(g): g for g, _ in rows}.values():
                g.stats.generate_seconds += time.perf_counter() - t0
                g.stats.generate_calls += 1
        if len(gens) != len(rows):
            raise ValueError(f"backend returned {len(gens)} generations for {len(rows)} prompts")
        return rows, gens
    return [], []


START_ATTEMPTS = 3
START_BACKOFF_S = 1.0  # the first retry's wait; doubled for each later one


def _start(adapter: Any, env_task: Task, env_cfg: EnvSection, ctx: EnvContext, task: TaskGroup, rid: str):
    """Open and reset one episode's env, retrying a failure twice (1 s, then 2 s later): a flaky env
    server or a JVM that failed to start. An env that never starts fails the whole group (RuntimeError):
    the job is then redelivered, up to redis.max_deliveries times, and dead-lettered, never trained on
    with a sibling missing or scored 0 for an infrastructure fault."""
    for attempt in range(START_ATTEMPTS):
        env = None
        try:
            env = adapter.open_env(env_task, env_cfg, ctx)
            return env, env.reset()
        except Exception as err:  # noqa: BLE001 - any env failure; re-raised below
            retry = not isinstance(err, (ValueError, TypeError, KeyError))  # a malformed task fails every time
            if env is not None:
                try:
                    env.close()
                except Exception:  # noqa: BLE001
                    log.exception("group %s %s: closing a failed env", task.group_id, rid)
            if not retry:
                raise ValueError(f"group {task.group_id} {rid}: env {task.env!r} refused the task: {err!r}") from err
            if attempt + 1 == START_ATTEMPTS:
                raise RuntimeError(f"group {task.group_id} {rid}: env {task.env!r} failed to start "
                                   f"{START_ATTEMPTS} times: {err!r}") from err
            log.warning("group %s %s: env failed to start (%r); retrying", task.group_id, rid, err)
            time.sleep(START_BACKOFF_S * 2.0 ** attempt)
    raise AssertionError("unreachable")


def _hint(step: EnvStep) -> list[str]:
    """The remaining gold path the env reports (the teacher's per-turn hint) within the wire's bounds:
    its first MAX_HINT_ACTIONS commands, up to the first one longer than MAX_HINT_CHARS. A command is
    never cut (a cut answer shown to the teacher as the gold one would be wrong privileged text), so
    an answer that does not fit gives no hint. TypeError when the env's policy_commands is not a
    list of str (a broken env: its episode ends "error")."""
    commands = step.policy_commands
    if not isinstance(commands, (list, tuple)) or not all(isinstance(a, str) for a in commands):
        raise TypeError(f"env policy_commands must be a list of str, got {type(commands).__name__}: {commands!r:.80}")
    hint: list[str] = []
    for command in commands[:MAX_HINT_ACTIONS]:
        if len(command) > MAX_HINT_CHARS:
            break
        hint.append(command)
    return hint


def _reward(step: EnvStep, task: TaskGroup) -> float:
    """The step's reward, checked: an env reporting a non-finite or out-of-range reward is a broken env."""
    reward = float(step.reward)  # EnvStep fills a missing reward from `won`
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise ValueError(f"group {task.group_id}: env {task.env!r} returned reward {reward!r} (must be in [0, 1])")
    return reward


def _play_turn(
    ep: _Episode,
    gen: Any,
    turn: int,
    task: TaskGroup,
    chat: ChatFormat,
    backend: Any,
    env_cfg: EnvSection,
    max_new: int,
    max_model_len: int,
    prefill: str,
    stop_ids: frozenset[int],
    stats: RolloutStats,
    action_tags: tuple[str, ...] = ("action",),
) -> None:
    """Append one sampled response, parse it, step the game, append the next user turn."""
    ids = [int(i) for i in gen.token_ids]
    lps = [float(x) for x in gen.logprobs]
    if len(ids) != len(lps):
        raise ValueError(f"generation has {len(ids)} token ids but {len(lps)} log-probs")
    ents = getattr(gen, "entropies", None)
    if ents is None:
        ep.has_entropy = False
        ents = [0.0] * len(ids)
    if len(ents) != len(ids):
        raise ValueError(f"generation has {len(ids)} token ids but {len(ents)} entropies")
    if len(ids) > max_new:
        raise ValueError(f"generation has {len(ids)} tokens, more than max_new_tokens={max_new}")
    finish = gen.finish_reason
    if finish not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {finish!r}")

    start = len(ep.ids)
    lp_N = np.asarray(lps, dtype=np.float64)
    ent_N = np.asarray(ents, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        # A sampled token's probability is <= 1 and an entropy is >= 0; tiny violations are float noise.
        ok_N = np.isfinite(lp_N) & (lp_N <= LOGPROB_TOLERANCE) & np.isfinite(ent_N) & (ent_N >= -ENTROPY_TOLERANCE)
    # Never ship NaN, nor a log-prob > 0 (a broken sampler, not noise): the
    # token stays in the ids but leaves the loss (case 5).
    max_ent = math.log(backend.vocab_size) if getattr(backend, "vocab_size", None) else np.inf
    ep.ids.extend(ids)
    ep.logprobs.extend(np.where(ok_N, np.minimum(np.nan_to_num(lp_N), 0.0), 0.0).tolist())
    ep.entropies.extend(np.where(ok_N, np.clip(np.nan_to_num(ent_N), 0.0, max_ent), 0.0).tolist())
    ep.mask.extend(ok_N.astype(int).tolist())
    stats.nonfinite_logprobs += int((~ok_N).sum())
    end = len(ep.ids)
    stats.turns += 1
    stats.generated_tokens += len(ids)
    stats.length_finishes += finish == "length"

    # Whether the ids already end with a stop id (the template's end of turn or an eos) decides if
    # the continuation must close the assistant turn itself: a question about the ids only.
    # Truncation is `finish`, from the sampler, never this check (case 16).
    ended_with_eos = bool(ids) and ids[-1] in stop_ids
    body = ids[:-1] if ended_with_eos else ids
    text = prefill + decode(backend.tokenizer, body)
    parsed = parse_response(text, env_cfg.prompt_format, env=task.env, action_tags=action_tags)
    # An env with several action tags (Search: search / answer) gets the action with its tag.
    action = f"<{parsed.tag}>{parsed.action}</{parsed.tag}>" if len(action_tags) > 1 else parsed.action

    observation = ""
    hint = ep.hint  # the state this turn acted in
    if parsed.valid:
        stats.valid_turns += 1
        t0 = time.perf_counter()
        try:
            step: EnvStep = ep.env.step(action)
            reward, next_hint = _reward(step, task), _hint(step)
        except Exception:  # a broken game (or a dead env server) must not take the sibling episodes down
            log.exception("group %s %s: env.step(%r) failed", task.group_id, ep.rollout_id, action)
            ep.ending = "error"
        else:
            ep.admissible = step.admissible_commands
            ep.hint = next_hint
            ep.reward = reward
            stats.env_invalid_actions += bool(step.invalid_action)
            if step.won:
                ep.won, ep.ending = True, "won"
            elif step.lost:
                ep.ending = "lost"
            elif step.done:
                ep.ending = "done"
            else:
                observation = prompts.observation_message(step.observation, step.admissible_commands, env_cfg)
        stats.env_seconds += time.perf_counter() - t0
    else:
        observation = prompts.invalid_message(ep.admissible, env_cfg)

    if not ep.ending and turn + 1 >= task.max_turns:
        ep.ending = "max_turns"
    if not ep.ending:
        cont = chat.continuation_ids(observation, ended_with_eos)
        if _fits(len(ep.ids) + len(cont), max_new, max_model_len):
            ep.append_prompt(cont)
        else:
            # The next turn could not be sampled: end here, keeping this turn
            # trainable and the trajectory ending on a response.
            ep.ending = "truncated"
    if ep.ending:
        observation = ""  # only observations present in the ids are recorded

    ep.turns.append(
        TurnRecord(
            turn_id=turn,
            response_start=start,
            response_end=end,
            text=text,
            thinking=parsed.thinking or "",
            action=parsed.action if parsed.valid else "",
            format_valid=bool(parsed.valid),
            finish_reason=finish,
            observation=observation,
            hint=hint,
        )
    )
    stats.format_errors += ep.turns[-1].format_error
