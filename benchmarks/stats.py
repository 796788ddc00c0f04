"""Statistics of the learning benchmark (issue 41): seeds, paired comparisons, compute. Pure functions.

Inputs are the per-episode rows the results files keep (benchmarks/learning.py): dicts with at least
"task_id" (the held-out game), "reward" (float) and "won" (bool). A game's value is the mean of its
episodes' headline values (`episode_value`); a seed's value is the mean over its games.

- `percentile_interval` / `percentile_bootstrap`: the plain percentile bootstrap every interval here uses.
- `bootstrap_mean`: the interval of a flat list's mean (resampling its values).
- `seed_summary`: mean and spread (min, max, sample std) of one step's held-out value over training seeds.
- `paired_differences` / `paired_comparison`: a method against GRPO on the same eval games, per (seed, game)
  difference, its mean and a hierarchical bootstrap interval (seeds with replacement, then games within).
- `training_compute`: episodes and model-token passes of a run's training records up to a step.
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


def hierarchical_mean(diffs: Sequence[np.ndarray], rng: np.random.Generator | None = None) -> float:
    """The mean over seeds of each seed's mean game difference (`diffs`: one array of game differences per
    seed). With `rng`, one hierarchical resample: seeds drawn with replacement, then games within each drawn
    seed."""
    if rng is None:
        return float(np.mean([d.mean() for d in diffs]))
    picked = rng.integers(0, len(diffs), len(diffs))
    return float(np.mean([diffs[i][rng.integers(0, diffs[i].size, diffs[i].size)].mean() for i in picked]))


def paired_comparison(method: Mapping[int, Sequence[Mapping]], base: Mapping[int, Sequence[Mapping]],
                      metric: str = "success", samples: int = SAMPLES, seed: int = RNG_SEED,
                      level: float = LEVEL) -> dict | None:
    """`method` against `base` (GRPO) on the same eval games: {"diff": mean over seeds of the mean per-game
    difference (method - base, in units of the metric), "lo", "hi": its `level` hierarchical percentile
    bootstrap interval (seeds, then games within; `samples` resamples, Generator seed `seed`), "seeds", "games"
    (pairs in all), "per_seed": {seed: mean difference}}; None when no (seed, game) pair exists."""
    pairs = paired_differences(method, base, metric)
    if not pairs:
        return None
    diffs = [np.asarray(list(d.values()), dtype=np.float64) for d in pairs.values()]
    lo, hi = percentile_bootstrap(lambda rng: hierarchical_mean(diffs, rng), samples, seed, level)
    return {"diff": hierarchical_mean(diffs), "lo": lo, "hi": hi, "seeds": len(diffs),
            "games": int(sum(d.size for d in diffs)), "per_seed": {s: float(d.mean()) for s, d in zip(pairs, diffs)}}


def trained_to(record: Mapping) -> int:
    """The policy version a training record's step produced: its "policy_version", else step + 1 (steps count
    from 0; snapshot policy-vN is the policy after N steps)."""
    return int(record["policy_version"]) if record.get("policy_version") is not None else int(record.get("step", 0)) + 1


def training_compute(records: Sequence[Mapping], ppo_epochs: int, upto: int | None = None) -> dict:
    """Compute of a run's training steps up to policy version `upto` (all with None), from its metrics.jsonl
    records: {"steps", "episodes" (played in training), "generated_tokens" (sampled by the rollout),
    "teacher_tokens" (teacher-forced: the trainer's `teacher_scored_tokens`), "trainer_tokens" (loss tokens x
    `ppo_epochs`: forward + backward passes), "token_passes" (their sum)}. Records without a count add 0 to it
    (runs from before the count existed)."""
    kept = [r for r in records if upto is None or trained_to(r) <= upto]
    out = {"steps": len(kept), "episodes": int(sum(r.get("episodes") or 0 for r in kept)),
           "generated_tokens": int(sum(r.get("generated_tokens") or 0 for r in kept)),
           "teacher_tokens": int(sum(r.get("teacher_scored_tokens") or 0 for r in kept)),
           "trainer_tokens": int(sum((r.get("loss_tokens") or 0) * ppo_epochs for r in kept))}
    out["token_passes"] = out["generated_tokens"] + out["teacher_tokens"] + out["trainer_tokens"]
    return out


def add_compute(a: Mapping, b: Mapping) -> dict:
    """Two `training_compute` results summed key by key (a student's and its teacher's training)."""
    return {k: a[k] + b[k] for k in a}
