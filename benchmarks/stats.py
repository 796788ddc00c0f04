"""Statistics of the learning benchmark (issue 41): seeds, paired comparisons, compute. Pure functions.

Inputs are the per-episode rows the results files keep (benchmarks/learning.py): dicts with at least
"task_id" (the held-out game), "reward" (float) and "won" (bool). A game's value is the mean of its
episodes' headline values (`episode_value`); a seed's value is the mean over its games.

- `percentile_interval` / `percentile_bootstrap`: the plain percentile bootstrap every interval here uses.
- `bootstrap_mean`: the interval of a flat list's mean (resampling its values).
- `seed_summary`: mean and spread (min, max, sample std) of one step's held-out value over training seeds.
- `paired_differences` / `paired_comparison`: a method against GRPO on the same eval games, per (seed, game)
  difference, its mean and a two-way bootstrap interval: seeds and games are crossed (every seed plays the same
  held-out games), so each resample draws seeds and one set of games, used for every drawn seed (Owen 2007, "The
  pigeonhole bootstrap", Ann. Appl. Stat. 1(2); McCullagh 2000, "Resampling and exchangeable arrays").
- `training_compute`: episodes and tokens through the model of a run's training records up to a step.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

LEVEL = 0.95
SAMPLES = 10_000
RNG_SEED = 0  # every interval is reproducible: the same inputs give the same bounds


def percentile_interval(estimates: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """The (1-level)/2 and (1+level)/2 quantiles of bootstrap `estimates` (floats), as (lo, hi).
    Raises ValueError for no estimates or a level outside (0, 1)."""
    x = np.asarray(estimates, dtype=np.float64)
    if x.size == 0 or not 0.0 < level < 1.0:
        raise ValueError(f"percentile_interval: need estimates and 0 < level < 1 (got {x.size}, {level})")
    lo, hi = np.quantile(x, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def percentile_bootstrap(statistic: Callable[[np.random.Generator], float], samples: int = SAMPLES,
                         seed: int = RNG_SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap: `statistic(rng)` computes one resample's estimate (it draws its own resample from
    `rng`), called `samples` times with one Generator seeded by `seed`; returns `percentile_interval` of them."""
    if samples < 1:
        raise ValueError(f"percentile_bootstrap: samples must be >= 1 (got {samples})")
    rng = np.random.default_rng(seed)
    return percentile_interval([statistic(rng) for _ in range(samples)], level)


def bootstrap_mean(values: Sequence[float], samples: int = SAMPLES, seed: int = RNG_SEED,
                   level: float = LEVEL) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (resampled with replacement). Raises
    ValueError for no values."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("bootstrap_mean: no values")
    return percentile_bootstrap(lambda rng: float(x[rng.integers(0, x.size, x.size)].mean()), samples, seed, level)


def episode_value(row: Mapping, metric: str = "success") -> float:
    """One episode's headline value in [0, 1]: won as 0/1 for "success", else its reward (F1, EM; WebShop's
    score as a fraction)."""
    return float(bool(row["won"])) if metric == "success" else float(row["reward"])


def game_values(rows: Sequence[Mapping], metric: str = "success") -> dict[str, float]:
    """{task_id: mean episode value} over `rows` (a game's episodes averaged first, so every game weighs the
    same however many episodes it had)."""
    by_game: dict[str, list[float]] = {}
    for r in rows:
        by_game.setdefault(str(r["task_id"]), []).append(episode_value(r, metric))
    return {g: float(np.mean(v)) for g, v in by_game.items()}


def seed_summary(values: Mapping[int, float]) -> dict:
    """Spread over training seeds of one step's value ({seed: value}): {"seeds": n, "mean", "min", "max",
    "std" (sample standard deviation, ddof 1; None for one seed: no spread measured)}. Raises ValueError for
    no seeds."""
    if not values:
        raise ValueError("seed_summary: no seeds")
    x = np.asarray(list(values.values()), dtype=np.float64)
    return {"seeds": int(x.size), "mean": float(x.mean()), "min": float(x.min()), "max": float(x.max()),
            "std": float(x.std(ddof=1)) if x.size > 1 else None}


def paired_differences(method: Mapping[int, Sequence[Mapping]], base: Mapping[int, Sequence[Mapping]],
                       metric: str = "success") -> dict[int, dict[str, float]]:
    """{seed: {task_id: method's game value - base's}} over the seeds both have and, per seed, the games both
    played (the same eval games and eval.seed for every method: a pair shares the game's sampling seed).
    `method`, `base`: {seed: episode rows}."""
    out = {}
    for seed in sorted(set(method) & set(base)):
        a, b = game_values(method[seed], metric), game_values(base[seed], metric)
        games = sorted(set(a) & set(b))
        if games:
            out[seed] = {g: a[g] - b[g] for g in games}
    return out


def difference_matrix(pairs: Mapping[int, Mapping[str, float]]) -> np.ndarray:
    """`paired_differences`' {seed: {game: difference}} as a float64 [seeds, games] matrix D_SG, seeds in the
    mapping's order and games sorted over all seeds; NaN where a seed lacks a game (a task that failed)."""
    games = sorted({g for d in pairs.values() for g in d})
    col = {g: j for j, g in enumerate(games)}
    D_SG = np.full((len(pairs), len(games)), np.nan)
    for i, d in enumerate(pairs.values()):
        for g, v in d.items():
            D_SG[i, col[g]] = v
    return D_SG


def crossed_mean(D_SG: np.ndarray, rng: np.random.Generator | None = None) -> float:
    """The mean over seeds of each seed's mean game difference (D_SG: `difference_matrix`, NaN = no pair). With
    `rng`, one two-way resample: S seeds and G games drawn with replacement, the same drawn games for every drawn
    seed (the games are shared by the seeds, not nested in them); a drawn seed none of whose drawn games it has
    is left out of that resample."""
    if rng is None:
        return float(np.mean(np.nanmean(D_SG, axis=1)))
    S, G = D_SG.shape
    sub = D_SG[np.ix_(rng.integers(0, S, S), rng.integers(0, G, G))]
    have = ~np.isnan(sub).all(axis=1)
    return float(np.mean(np.nanmean(sub[have], axis=1))) if have.any() else float("nan")


def paired_comparison(method: Mapping[int, Sequence[Mapping]], base: Mapping[int, Sequence[Mapping]],
                      metric: str = "success", samples: int = SAMPLES, seed: int = RNG_SEED,
                      level: float = LEVEL) -> dict | None:
    """`method` against `base` (GRPO) on the same eval games: {"diff": mean over seeds of the mean per-game
    difference (method - base, in units of the metric), "lo", "hi": its `level` percentile interval from the
    two-way bootstrap `crossed_mean` (`samples` resamples, Generator seed `seed`; resamples that drew no pair are
    dropped), "seeds", "games" (distinct games), "pairs" ((seed, game) pairs in all), "per_seed": {seed: mean
    difference}}; None when no (seed, game) pair exists."""
    pairs = paired_differences(method, base, metric)
    if not pairs:
        return None
    D_SG = difference_matrix(pairs)
    rng = np.random.default_rng(seed)
    draws = np.asarray([crossed_mean(D_SG, rng) for _ in range(samples)])
    lo, hi = percentile_interval(draws[~np.isnan(draws)], level)
    return {"diff": crossed_mean(D_SG), "lo": lo, "hi": hi, "seeds": len(pairs), "games": int(D_SG.shape[1]),
            "pairs": int((~np.isnan(D_SG)).sum()), "per_seed": {s: float(np.mean(list(d.values()))) for s, d in pairs.items()}}


def trained_to(record: Mapping) -> int:
    """The policy version a training record's step produced: its "policy_version", else step + 1 (steps count
    from 0; snapshot policy-vN is the policy after N steps)."""
    return int(record["policy_version"]) if record.get("policy_version") is not None else int(record.get("step", 0)) + 1


def training_compute(records: Sequence[Mapping], ppo_epochs: int, upto: int | None = None) -> dict:
    """Compute of a run's training steps up to policy version `upto` (all with None), from its metrics.jsonl
    records, in tokens run through the model: {"steps", "episodes" (played in training), "generated_tokens"
    (sampled by the rollout, for reference), "rollout_tokens" (every trajectory's tokens, `sequence_tokens`:
    prompts and observations prefilled, responses generated, each once; an engine that re-reads the history each
    turn runs more), "teacher_tokens" (what the teacher ran: `teacher_forward_tokens`, privileged prefixes, every
    view, matched continuations, its own generations), "trainer_tokens" (`sequence_tokens` x `ppo_epochs`, each a
    forward and a backward pass), "forward_tokens": rollout + teacher + 3 x trainer, forward-token equivalents
    (a forward pass costs about 2N FLOPs a token for N parameters, forward + backward about 6N: Kaplan et al.
    2020, "Scaling laws for neural language models", section 2.1), so compute is about 2N x forward_tokens}.
    Records without a count add 0 to it (runs from before the count existed)."""
    kept = [r for r in records if upto is None or trained_to(r) <= upto]
    total = lambda key, scale=1: int(sum((r.get(key) or 0) * scale for r in kept))  # noqa: E731
    out = {"steps": len(kept), "episodes": total("episodes"), "generated_tokens": total("generated_tokens"),
           "rollout_tokens": total("sequence_tokens"), "teacher_tokens": total("teacher_forward_tokens"),
           "trainer_tokens": total("sequence_tokens", ppo_epochs)}
    out["forward_tokens"] = out["rollout_tokens"] + out["teacher_tokens"] + 3 * out["trainer_tokens"]
    return out


def add_compute(a: Mapping, b: Mapping) -> dict:
    """Two `training_compute` results summed key by key (a student's and its teacher's training)."""
    return {k: a[k] + b[k] for k in a}
