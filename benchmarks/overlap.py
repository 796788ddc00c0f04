"""Pipeline overlap: one config run synchronous (run.max_staleness 0) and one-step-off (1), through `opsd run`.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py [--quick] [--json OUT] [--pairs N] [--real]

Each run is a real `python -m opsd.cli run CONFIG --output-dir <temp dir>` (Redis, every role a process),
started alternately: sync, one-step-off, sync, one-step-off, ... (`--pairs` of them), so both see the same
machine load. Step time comes from each run's metrics.jsonl: `finished_at`, the wall clock once a step's
update is applied (its checkpoint and weight publish follow), differenced between steps. The first steps are discarded (2 by default, 1 with --quick
and --real: process start, model load, the one-step-off pipeline filling up), and the measured window
holds an even number of steps (one-step-off alternates a longer and a shorter step, see below). groups/s = env.num_games per step
/ step time. speedup = sync step time / one-step-off step time.

Simulated compute (default; configs/overlap.yaml): every role runs for real on the tiny random model and
holds each job for its configured time (opsd.config.SimulateSection): R s per group for the rollout, T s per
group for the teacher, S s per step for the trainer's credit + update; G = env.num_games groups a step.
The ideal step times follow from how our pipeline overlaps:

- synchronous: step n+1's tasks are issued once step n's weights are out. The rollout plays the G groups
  one after another and the teacher scores each as it comes out, so the last group is scored after
  W = R + T + (G - 1) * max(R, T); then the trainer takes S. Sync step = W + S.
- one-step-off: when step n starts waiting, the trainer issues step n+1's tasks (sampled with policy n),
  so rollout and teacher work on step n+1 while step n trains. Step n+2's tasks need policy n+1 (staleness
  <= 1), which exists only once step n's update is out: they are issued when step n ends, and step n+2
  ends at least W + S later. Over any two steps the period P satisfies 2P >= W + S; and every stage must
  keep up, P >= G*R, P >= G*T, P >= S. Ideal one-step-off step = max(G*R, G*T, S, (W + S) / 2).

So staleness 1 can at most halve the step time (ideal speedup <= 2), and reaches 2 when rollout and
training take similar time: configs/overlap.yaml's R = 2, T = 1.5, S = 4, G = 2 gives W = 5.5, sync
9.5 s, one-step-off 4.75 s (steps of 5.5 and 4 s alternately). Efficiency = measured speedup / ideal
speedup. What the ideal leaves out is the pipeline's own cost: checkpoint, weight publishing and loading,
Redis hops, polling, and any stage whose real tiny-model work overran its simulated time (reported as
"overrun"). Sync pays that cost in every step, one-step-off partly overlaps it, so efficiency can pass
100 % (more likely with --quick's halved times, where that cost is a larger part of a step).

`--real`: configs/quickstart.yaml as it is (SmolLM2-135M, AlignOPSD), 3 steps each, the first discarded;
heavy (about 10 min a run on 2 cores) and without an ideal: the roles compete for the same cores.
`--quick`: a smoke test, 3 steps per run (the first discarded) with all simulated times halved; the targets
are judged only at the default sizes (6 steps, the first 2 discarded). Writes (with --json) a benchmark JSON (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

from benchmarks.common import REPO, Row, command_line, machine, print_rows, write_json  # noqa: E402

WARMUP_STEPS = 2  # simulated runs: discarded steps (start-up, and the one-step-off pipeline filling up)
MODES = {"sync": 0, "one-step-off": 1}  # name -> run.max_staleness


@dataclass
class Stages:
    """Per-stage compute times in seconds: R and T per group, S per step; G groups a step."""

    R: float
    T: float
    S: float
    G: int

    @property
    def latency(self) -> float:
        """W: seconds from a step's tasks being issued to its last group scored (rollout -> teacher pipeline)."""
        return self.R + self.T + (self.G - 1) * max(self.R, self.T)

    def ideal_sync(self) -> float:
        return self.latency + self.S

    def ideal_one_step_off(self) -> float:
        return max(self.G * self.R, self.G * self.T, self.S, (self.latency + self.S) / 2)


@dataclass
class RunResult:
    mode: str
    run_dir: Path
    step_s: float  # mean wall seconds per measured step
    groups_per_s: float
    steps_measured: int
    rollout_s: float  # mean per group, measured steps (includes the simulated hold)
    teacher_s: float  # mean per group (0 without a teacher)
    train_s: float  # mean per step: credit + update (includes the simulated hold)
    wait_s: float  # mean per step: the trainer waiting for its groups
    overhead_s: float  # mean per step: checkpoint, weight publishing, metrics (step interval - wait - train)
    staleness_max: int  # largest group staleness trained on in the measured steps
    dropped: int  # groups dropped as stale or duplicate (whole run)
    wall_s: float  # the whole `opsd run`, start-up included
    load: tuple[float, float]  # 1-minute load average before and after


def run_config(base: Path, staleness: int, steps: int, scale: float, work: Path) -> Path:
    """Write `base` with run.max_staleness, run.steps and the simulated times multiplied by `scale` to `work`."""
    from opsd.config import read_yaml

    data = read_yaml(base) or {}  # as `opsd run` reads it: the rewrite below would drop a repeated key silently
    data.setdefault("run", {}).update(max_staleness=staleness, steps=steps,
                                      name=f"{data['run'].get('name', 'overlap')}-k{staleness}")
    sim = data.get("simulate") or {}
    for key in ("rollout_s", "teacher_s", "trainer_s"):
        if key in sim:
            sim[key] = float(sim[key]) * scale
    out = work / f"config-k{staleness}.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def run_once(mode: str, config: Path, out_dir: Path, warmup: int, timeout_s: float) -> RunResult:
    """`opsd run config --output-dir out_dir` in a subprocess, then its step times from metrics.jsonl.

    Raises RuntimeError (with the log's tail) when the run fails or leaves too few steps to measure.
    """
    log = out_dir / "opsd.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(config), "--output-dir", str(out_dir / "runs")],
                            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{mode} run failed (exit {rc}): {log.read_text(errors='replace')[-2000:]}")
    (run_dir,) = [p.parent for p in (out_dir / "runs").glob("*/metrics.jsonl")]
    records = sorted((json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                     key=lambda r: r["step"])
    measured = records[warmup:]
    if len(measured) % 2:  # an even number of steps: one-step-off alternates longer and shorter steps
        measured = measured[1:]
    if len(measured) < 2 or warmup < 1:
        raise RuntimeError(f"{mode}: {len(records)} steps leave too few to measure after {warmup} warm-up step(s)")
    first = records[records.index(measured[0]) - 1]["finished_at"]
    window = measured[-1]["finished_at"] - first
    n = len(measured)
    cfg = yaml.safe_load(config.read_text())
    G = int(cfg.get("env", {}).get("num_games", 2))
    intervals = [b["finished_at"] - a["finished_at"] for a, b in zip(records, records[1:])][-n:]
    return RunResult(
        mode=mode, run_dir=run_dir, step_s=window / n, groups_per_s=G * n / window, steps_measured=n,
        rollout_s=statistics.mean(r["rollout_seconds"] for r in measured) / G,
        teacher_s=statistics.mean(r.get("teacher_seconds", 0.0) for r in measured) / G,
        train_s=statistics.mean(r["train_seconds"] for r in measured),
        wait_s=statistics.mean(r["wait_seconds"] for r in measured),
        overhead_s=statistics.mean(i - r["step_seconds"] for i, r in zip(intervals, measured)),
        staleness_max=int(max(r["staleness_max"] for r in measured)),
        dropped=int(records[-1]["groups_dropped_stale"] + records[-1]["groups_dropped_duplicate"]),
        wall_s=wall, load=(load0, os.getloadavg()[0]),
    )


def describe(r: RunResult) -> str:
    return (f"{r.mode}: {r.step_s:.2f} s/step over {r.steps_measured} steps; per group rollout {r.rollout_s:.2f} s, "
            f"teacher {r.teacher_s:.2f} s; per step train {r.train_s:.2f} s, wait {r.wait_s:.2f} s, checkpoint+publish+"
            f"metrics {r.overhead_s:.2f} s; max staleness {r.staleness_max}, dropped {r.dropped}; run {r.wall_s:.0f} s, "
            f"load {r.load[0]:.1f}->{r.load[1]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes: 3 steps a run, simulated times halved")
    ap.add_argument("--real", action="store_true", help="configs/quickstart.yaml with the real model, 3 steps a run")
    ap.add_argument("--pairs", type=int, default=1, help="sync + one-step-off runs, interleaved, >= 1 (default 1)")
    ap.add_argument("--config", type=Path, help="base config (default configs/overlap.yaml; --real: configs/quickstart.yaml)")
    ap.add_argument("--steps", type=int, help=f"steps per run, >= the warm-up + 2 (default 6, {WARMUP_STEPS} warm-up; "
                                               "--quick and --real 3, 1 warm-up)")
    ap.add_argument("--json", type=Path, help="write the benchmark JSON here")
    ap.add_argument("--keep", type=Path, help="keep the runs' directories under this folder (default: a temp dir, deleted)")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error(f"--pairs must be >= 1 (got {args.pairs})")
    warmup = 1 if args.real or args.quick else WARMUP_STEPS
    steps = (3 if args.real or args.quick else 6) if args.steps is None else args.steps
    if steps < warmup + 2:  # run_once measures at least 2 steps after the discarded ones
        ap.error(f"--steps must be >= {warmup + 2} here ({warmup} warm-up step(s) discarded + 2 measured); got {steps}")

    base = args.config or REPO / ("configs/quickstart.yaml" if args.real else "configs/overlap.yaml")
    if not base.is_file():
        ap.error(f"--config {base}: not a file (give a run config YAML, e.g. configs/overlap.yaml)")
    scale = 0.5 if args.quick and not args.real else 1.0
    timeout_s = 7200.0 if args.real else 900.0
    work = args.keep or Path(tempfile.mkdtemp(prefix="opsd-overlap-"))
    try:
        measure(args, base, work, steps, warmup, scale, timeout_s)
    finally:  # also on a failed run: the temp dir holds every run's Redis data and checkpoints
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, base: Path, work: Path, steps: int, warmup: int, scale: float,
            timeout_s: float) -> None:
    """The interleaved runs in `work`, their rows printed (and written with --json)."""
    work.mkdir(parents=True, exist_ok=True)
    configs = {mode: run_config(base, k, steps, scale, work) for mode, k in MODES.items()}
    cfg = yaml.safe_load(configs["sync"].read_text())
    sim = cfg.get("simulate") or {}
    simulated = bool(sim.get("enabled"))
    stages = None
    if simulated:
        stages = Stages(R=float(sim.get("rollout_s", 0.0)), T=float(sim.get("teacher_s", 0.0)) if cfg["run"].get("method") != "grpo" else 0.0,
                        S=float(sim.get("trainer_s", 0.0)), G=int(cfg.get("env", {}).get("num_games", 2)))
        print(f"simulated compute: R {stages.R} s, T {stages.T} s per group, S {stages.S} s per step, G {stages.G}; "
              f"ideal sync {stages.ideal_sync():.2f} s, one-step-off {stages.ideal_one_step_off():.2f} s per step", flush=True)

    results: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    for i in range(args.pairs):
        for mode, k in MODES.items():
            out = work / f"{i}-{mode}"
            out.mkdir()
            print(f"run {i + 1}/{args.pairs} {mode} (max_staleness {k}, {steps} steps) ...", flush=True)
            r = run_once(mode, configs[mode], out, warmup, timeout_s)
            results[mode].append(r)
            print("  " + describe(r), flush=True)

    sync = statistics.median(r.step_s for r in results["sync"])
    off = statistics.median(r.step_s for r in results["one-step-off"])
    speedup = sync / off
    judged = not args.quick  # the targets hold for the default sizes; --quick is a smoke test
    where = f"real models ({base.name})" if args.real else f"simulated compute ({base.name}{', times x0.5' if scale != 1 else ''})"
    runs = f"{args.pairs} interleaved pair(s), {steps} steps a run, first {warmup} discarded"
    everyone = [*results["sync"], *results["one-step-off"]]
    load = f"load average {min(r.load[0] for r in everyone):.1f}-{max(r.load[1] for r in everyone):.1f} on {os.cpu_count()} cores"
    ideal_sync = f"ideal {stages.ideal_sync():.2f} s; " if stages else ""
    ideal_off = f"ideal {stages.ideal_one_step_off():.2f} s; " if stages else ""
    stale = max(r.staleness_max for r in results["one-step-off"])
    rows = [
        Row("sync step time", sync, "s", note=f"{ideal_sync}{where}; {runs}"),
        Row("one-step-off step time", off, "s", note=f"{ideal_off}groups trained up to {stale} version(s) stale; {runs}"),
        Row("sync groups/s", statistics.median(r.groups_per_s for r in results["sync"]), "groups/s"),
        Row("one-step-off groups/s", statistics.median(r.groups_per_s for r in results["one-step-off"]), "groups/s"),
        Row("speedup (sync / one-step-off step time)", speedup, "x",
            target=">= 1.6 x" if judged and simulated else None,
            note=f"{load}" + ("; roles share the machine's cores: no target" if not simulated else "")),
        Row("trainer overhead per step", statistics.median(r.overhead_s for r in everyone), "s",
            note="checkpoint, weight publishing, metrics: the step interval minus waiting and credit + update"),
    ]
    if stages is not None:
        ideal = stages.ideal_sync() / stages.ideal_one_step_off()
        overruns = [f"{mode} {name} {got:.2f} s > {want:.2f} s" for mode, rs in results.items() for r in rs
                    for name, got, want in (("rollout", r.rollout_s, stages.R), ("teacher", r.teacher_s, stages.T),
                                            ("train", r.train_s, stages.S)) if got > want * 1.05 + 0.05]
        rows += [
            Row("ideal speedup", ideal, "x", note=f"sync {stages.ideal_sync():.2f} s / one-step-off "
                f"{stages.ideal_one_step_off():.2f} s (R {stages.R}, T {stages.T}, S {stages.S}, G {stages.G})"),
            Row("overlap efficiency (speedup / ideal)", 100 * speedup / ideal, "%", target=">= 90 %" if judged else None,
                note=("overrun: " + "; ".join(sorted(set(overruns))) if overruns
                      else "no stage overran its simulated time")
                + "; can pass 100 %: the ideal leaves out the pipeline's own cost (checkpoint, weight publishing), "
                  "which sync pays every step and one-step-off partly overlaps"),
        ]
    print_rows(rows, width=44)  # each run's line was printed as it finished
    print(machine())
    if args.json:
        write_json(args.json, "overlap", command_line(), rows)


if __name__ == "__main__":
    main()
