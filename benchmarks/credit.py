"""Credit-assignment speed: every registered method on an ALFWorld-scale batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/credit.py [--tasks 16 --rollouts 8 --turns 50 --tokens 512]
                                                             [--quick] [--json OUT]

The batch is random but valid (fixed seed): 16 tasks x 8 rollouts x 50 turns,
512 response tokens per turn with a random number of loss tokens, binary
episode rewards, some invalid turns, log-probs <= 0, a block-diagonal
similarity matrix. Each method runs through `opsd.credit.compute_advantages`
(the trainer's call, including validation), credit alone: no model passes.
Targets (issue 3): AlignOPSD < 1 s, every other method < 0.1 s on one core.
Prints: method, batch shape, median of 5 runs (after one warm-up run).
`--quick`: 2 x 4 x 10 x 64, 2 runs (a smoke test; the targets are stated for
the default size only). `--json OUT`: the rows as a benchmark JSON
(benchmarks/common.py), for `make bench`'s table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
    H_MM = np.zeros((M, M), dtype=np.float32)
    E_MM = np.zeros((M, M), dtype=bool)
    roll = np.repeat(np.arange(rollouts), turns)
    for t in range(tasks):
        sl = slice(t * n, (t + 1) * n)
        H_MM[sl, sl] = rng.uniform(0.3, 1.0, size=(n, n)).astype(np.float32)
        E_MM[sl, sl] = roll[:, None] != roll[None, :]
    return CreditBatch(
        task_id=task_id, rollout_id=rollout_id, turn_id=turn_id, data_source=["alfworld"] * M,
        episode_reward=episode_reward_M, is_action_valid=rng.random(M) > 0.1, loss_mask_ML=mask_ML,
        student_logprobs_ML=student_ML, teacher_logprobs_ML=teacher_ML, corrected_logprobs_ML=corrected_ML,
        similarity_MM=H_MM, eligible_MM=E_MM, base_logprobs_ML=student_ML.copy(),
        teacher_entropy_ML=rng.uniform(0, 3, size=(M, L)).astype(np.float32) * mask_ML,
        student_entropy_ML=rng.uniform(0, 3, size=(M, L)).astype(np.float32) * mask_ML,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=None, help="default 16 (--quick 2)")
    ap.add_argument("--rollouts", type=int, default=None, help="default 8 (--quick 4)")
    ap.add_argument("--turns", type=int, default=None, help="default 50 (--quick 10)")
    ap.add_argument("--tokens", type=int, default=None, help="default 512 (--quick 64)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (--quick 2)")
    ap.add_argument("--methods", nargs="*", default=None, help="default: every registered method")
    ap.add_argument("--quick", action="store_true", help="a small batch for a smoke test (2 x 4 x 10 x 64, 2 runs)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    args = ap.parse_args()
    for name, full, quick in (("tasks", 16, 2), ("rollouts", 8, 4), ("turns", 50, 10), ("tokens", 512, 64),
                              ("repeats", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    batch = make_batch(args.tasks, args.rollouts, args.turns, args.tokens)
    shape = f"{args.tasks}x{args.rollouts}x{args.turns}x{args.tokens}"
    issue_size = (args.tasks, args.rollouts, args.turns, args.tokens) == (16, 8, 50, 512)
    rows: list[Row] = []
    if not issue_size:
        print(f"batch {shape} is not the issue's 16x8x50x512: no targets judged")
    names = args.methods or [m for m in registered() if m not in ALIASES] + list(VARIANTS)
    print(f"{'method':<24} {'batch (tasks x rollouts x turns x tokens)':<42} {'median s':>9} {'target s':>9}  ok")
    for name in names:
        method, overrides = VARIANTS.get(name, (name, {}))
        cfg = CreditSection.model_validate(overrides)
        compute_advantages(method, batch, cfg)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            compute_advantages(method, batch, cfg)
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        target = TARGET_S.get(method, DEFAULT_TARGET_S)
        verdict = f"{target:>9.2f}  {'yes' if med < target else 'NO'}" if issue_size else f"{'-':>9}"  # as the rows
        print(f"{name:<24} {shape:<42} {med:>9.3f} {verdict}")
        rows.append(Row(f"{name} ({shape}): median s", med, "s", target=f"< {target:g} s" if issue_size else None,
                        note=f"median of {args.repeats} after a warm-up" + (
                            "" if issue_size else f"; target < {target:g} s holds for 16x8x50x512, not this size")))
    if args.json:
        write_json(args.json, "credit", command_line(), rows)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
