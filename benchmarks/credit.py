"""Credit-assignment speed and memory: every registered method on ALFWorld-scale batches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/credit.py [--sizes 16x8x50x512 ...]
        [--tasks T --rollouts G --turns K --tokens L] [--quick] [--json OUT]

Each batch is random but valid (fixed seed): tasks x rollouts x turns, a
number of response tokens per turn with a random number of loss tokens,
binary episode rewards, some invalid turns, log-probs <= 0, one similarity
and eligibility block per task. Each method runs through
`opsd.credit.compute_advantages` (the trainer's call, including validation),
credit alone: no model passes.
Sizes (default): 16x8x50x512 (the papers' ALFWorld step; the targets),
16x8x100x512 (100 turns) and 128x8x50x512 (a 128-task step).
Targets (issue 3), at 16x8x50x512 only: AlignOPSD < 1 s, every other method
< 0.1 s on one core.
Prints per method and size: median of 5 runs (after one warm-up run) and the
peak memory the call allocates beyond the batch (tracemalloc, which numpy
reports its arrays to; a separate run, so tracing does not slow the timed ones).
`--tasks/--rollouts/--turns/--tokens`: one size instead (unset ones from 16x8x50x512).
`--quick`: 2x4x10x64, 2 runs (a smoke test). `--json OUT`: the rows as a
benchmark JSON (benchmarks/common.py), for `make bench`'s table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import numpy as np  # noqa: E402

from benchmarks.common import Row, command_line, write_json  # noqa: E402
from opsd.config import CreditSection  # noqa: E402
from opsd.credit import compute_advantages, registered  # noqa: E402
from opsd.types import CreditBatch  # noqa: E402

TARGET_S = {"alignopsd": 1.0}
DEFAULT_TARGET_S = 0.1
# Settings that take a different code path, timed as extra rows ("method:variant").
VARIANTS = {
    "agentopsd:token": ("agentopsd", {"agentopsd": {"granularity": "token"}}),
    "agentopsd:reference": ("agentopsd", {"agentopsd": {"variant": "reference"}}),
    "alignopsd:token_level": ("alignopsd", {"alignopsd": {"ablation": "token_level"}}),
    "alignopsd:turn_level": ("alignopsd", {"alignopsd": {"ablation": "turn_level"}}),
    "alignopsd:random_spans": ("alignopsd", {"alignopsd": {"ablation": "random_spans"}}),
    "gc_opd:teacher_abs": ("gc_opd", {"gc_opd": {"credit_mode": "teacher_abs"}}),
}
ALIASES = {"opsd", "grpo_opsd"}  # same functions as opd / grpo_opd


def make_batch(tasks: int, rollouts: int, turns: int, tokens: int, seed: int = 0) -> CreditBatch:
    """A random valid CreditBatch in canonical order, M = tasks*rollouts*turns rows of `tokens`."""
    rng = np.random.default_rng(seed)
    M, L = tasks * rollouts * turns, tokens
    task_id = [f"task{t:03d}" for t in range(tasks) for _ in range(rollouts * turns)]
    rollout_id = [f"r{r:02d}" for _ in range(tasks) for r in range(rollouts) for _ in range(turns)]
    turn_id = [k for _ in range(tasks * rollouts) for k in range(turns)]
    lengths_M = rng.integers(1, L + 1, size=M)
    mask_ML = (np.arange(L)[None, :] < lengths_M[:, None]).astype(np.float32)
    student_ML = (-rng.exponential(1.0, size=(M, L))).astype(np.float32) * mask_ML
    teacher_ML = (student_ML + rng.normal(0, 0.5, size=(M, L)).astype(np.float32)).clip(max=0) * mask_ML
    corrected_ML = (teacher_ML + rng.normal(0, 0.1, size=(M, L)).astype(np.float32)).clip(max=0) * mask_ML
    reward_T = rng.integers(0, 2, size=tasks * rollouts).astype(np.float32) * 10.0
    episode_reward_M = np.repeat(reward_T, turns)
    n = rollouts * turns
    roll = np.repeat(np.arange(rollouts), turns)
    # One [n, n] block per task, as the trainer builds them (services/trainer/batch.py): pairs never cross tasks.
    H = {f"task{t:03d}": rng.uniform(0.3, 1.0, size=(n, n)).astype(np.float32) for t in range(tasks)}
    E = {f"task{t:03d}": roll[:, None] != roll[None, :] for t in range(tasks)}
    return CreditBatch(
        task_id=task_id, rollout_id=rollout_id, turn_id=turn_id, data_source=["alfworld"] * M,
        episode_reward=episode_reward_M, is_action_valid=rng.random(M) > 0.1, loss_mask_ML=mask_ML,
        student_logprobs_ML=student_ML, teacher_logprobs_ML=teacher_ML, corrected_logprobs_ML=corrected_ML,
        similarity_blocks=H, eligible_blocks=E, base_logprobs_ML=student_ML.copy(),
        teacher_entropy_ML=rng.uniform(0, 3, size=(M, L)).astype(np.float32) * mask_ML,
        student_entropy_ML=rng.uniform(0, 3, size=(M, L)).astype(np.float32) * mask_ML,
    )


ISSUE_SIZE = (16, 8, 50, 512)
DEFAULT_SIZES = ("16x8x50x512", "16x8x100x512", "128x8x50x512")


def parse_size(text: str) -> tuple[int, int, int, int]:
    """'16x8x50x512' -> (tasks, rollouts, turns, tokens); argparse.ArgumentTypeError otherwise."""
    try:
        size = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        size = ()
    if len(size) != 4 or min(size) < 1:
        raise argparse.ArgumentTypeError(f"a size is TASKSxROLLOUTSxTURNSxTOKENS of positive integers, got {text!r}")
    return size  # type: ignore[return-value]


def peak_mib(method: str, batch: CreditBatch, cfg: CreditSection) -> float:
    """MiB allocated at the peak of one compute_advantages call, beyond what existed before it."""
    tracemalloc.start()
    try:
        compute_advantages(method, batch, cfg)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                    help=f"TASKSxROLLOUTSxTURNSxTOKENS each (default {' '.join(DEFAULT_SIZES)})")
    ap.add_argument("--tasks", type=int, default=None, help="one size: tasks (default 16)")
    ap.add_argument("--rollouts", type=int, default=None, help="one size: rollouts per task (default 8)")
    ap.add_argument("--turns", type=int, default=None, help="one size: turns per rollout (default 50)")
    ap.add_argument("--tokens", type=int, default=None, help="one size: response tokens per turn (default 512)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (--quick 2)")
    ap.add_argument("--methods", nargs="*", default=None, help="default: every registered method")
    ap.add_argument("--quick", action="store_true", help="a small batch for a smoke test (2 x 4 x 10 x 64, 2 runs)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    args = ap.parse_args()
    one = (args.tasks, args.rollouts, args.turns, args.tokens)
    if args.quick:
        sizes = [(2, 4, 10, 64)]
    elif any(v is not None for v in one):
        if args.sizes:
            ap.error("give --sizes or --tasks/--rollouts/--turns/--tokens, not both")
        sizes = [tuple(d if v is None else v for v, d in zip(one, ISSUE_SIZE))]
    else:
        sizes = args.sizes or [parse_size(x) for x in DEFAULT_SIZES]
    repeats = args.repeats or (2 if args.quick else 5)
    names = args.methods or [m for m in registered() if m not in ALIASES] + list(VARIANTS)
    rows: list[Row] = []
    print(f"{'method':<24} {'size (tasks x rollouts x turns x tokens)':<40} {'median s':>9} {'target s':>9}  ok  "
          f"{'peak MiB':>9}")
    for size in sizes:
        batch = make_batch(*size)
        shape = "x".join(str(x) for x in size)
        issue_size = size == ISSUE_SIZE
        for name in names:
            method, overrides = VARIANTS.get(name, (name, {}))
            cfg = CreditSection.model_validate(overrides)
            compute_advantages(method, batch, cfg)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                compute_advantages(method, batch, cfg)
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            peak = peak_mib(method, batch, cfg)
            target = TARGET_S.get(method, DEFAULT_TARGET_S)
            verdict = f"{target:>9.2f}  {'yes' if med < target else 'NO '}" if issue_size else f"{'-':>9}  -  "
            print(f"{name:<24} {shape:<40} {med:>9.3f} {verdict} {peak:>9.1f}", flush=True)
            rows.append(Row(f"{name} ({shape}): median s", med, "s", target=f"< {target:g} s" if issue_size else None,
                            note=f"median of {repeats} after a warm-up" + (
                                "" if issue_size else f"; target < {target:g} s holds for 16x8x50x512, not this size")))
            rows.append(Row(f"{name} ({shape}): peak MiB", peak, "MiB",
                            note="allocated by one call beyond the batch (tracemalloc)"))
    if args.json:
        write_json(args.json, "credit", command_line(), rows)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
