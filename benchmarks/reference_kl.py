"""What the KL to the reference policy costs a step: the quickstart with trainer.kl_coef 0 and 0.01, side by side.

    .venv/bin/python benchmarks/reference_kl.py [--config configs/quickstart.yaml] [--steps 3] [--quick] [--json OUT]

Runs `opsd run` on the config twice, the KL term off and on (everything else the same), and reads each run's
metrics.jsonl: `reference_seconds` (the reference's forward pass over the step's trajectories, rank 0, no
gradient), `train_seconds` (credit assignment + the PPO update, the reference's pass included) and `kl`. The
trainer's peak resident memory is sampled (psutil, every 0.2 s) in both runs: the difference is the reference's
frozen copy (SmolLM2-135M in fp32: 0.54 GB; with LoRA it is 0: the base without the adapters).
`--quick`: tests/configs/tiny.yaml for one step (checks that it runs, not what it measures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: `benchmarks.common` importable

from benchmarks.common import Row, command_line, print_rows, write_json  # noqa: E402


def _trainer_peak(proc: subprocess.Popen, stop: threading.Event, out: dict) -> None:
    """Peak RSS (bytes) of the `services.trainer` process among `proc`'s descendants, sampled until `stop`."""
    peak = 0
    while not stop.is_set():
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "services.trainer" in " ".join(child.cmdline()):
                        peak = max(peak, child.memory_info().rss)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        stop.wait(0.2)
    out["peak"] = peak


def run(config: dict, kl_coef: float, steps: int, workdir: Path) -> dict:
    """One `opsd run` of `config` with trainer.kl_coef; returns its metrics.jsonl records and the trainer's peak RSS."""
    cfg = {**config, "trainer": {**config.get("trainer", {}), "kl_coef": kl_coef},
           "run": {**config.get("run", {}), "name": f"kl-{kl_coef:g}", "output_dir": str(workdir)}}
    path = workdir / f"kl-{kl_coef:g}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(workdir / f"kl-{kl_coef:g}.log", "w") as log:
        proc = subprocess.Popen([str(ROOT / ".venv/bin/opsd"), "run", str(path), "--steps", str(steps)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        stop, mem = threading.Event(), {}
        sampler = threading.Thread(target=_trainer_peak, args=(proc, stop, mem))
        sampler.start()
        rc = proc.wait()
        stop.set()
        sampler.join()
    if rc != 0:
        raise RuntimeError(f"opsd run (kl_coef {kl_coef}) exited {rc}: see {workdir / f'kl-{kl_coef:g}.log'}")
    (run_dir,) = [d for d in workdir.iterdir() if d.is_dir() and d.name.startswith(f"kl-{kl_coef:g}-")]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": [r for r in records if "train_seconds" in r], "peak_rss": mem.get("peak", 0)}


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="run config (default configs/quickstart.yaml)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 3)")
    ap.add_argument("--quick", action="store_true", help="tests/configs/tiny.yaml, 1 step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    if steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    path = Path(args.config or ROOT / ("tests/configs/tiny.yaml" if args.quick else "configs/quickstart.yaml"))
    if not path.is_file():
        ap.error(f"--config {path}: no such file")
    from opsd.config import read_yaml

    config = read_yaml(path)  # as `opsd run` reads it: a repeated key is refused, not dropped on the rewrite
    with tempfile.TemporaryDirectory(prefix="opsd-kl-") as tmp:
        off = run(config, 0.0, steps, Path(tmp))
        on = run(config, 0.01, steps, Path(tmp))

    def mean(res: dict, key: str) -> float:
        return sum(r[key] for r in res["records"]) / len(res["records"])

    rows = [
        Row("reference forward pass per step (kl_coef 0.01)", mean(on, "reference_seconds"), "s"),
        Row("train seconds per step, kl_coef 0.01", mean(on, "train_seconds"), "s"),
        Row("train seconds per step, kl_coef 0", mean(off, "train_seconds"), "s"),
        Row("reference share of the step's training", mean(on, "reference_seconds") / mean(on, "train_seconds"), ""),
        Row("trainer peak RSS, kl_coef 0.01", on["peak_rss"] / 2**30, "GiB"),
        Row("trainer peak RSS, kl_coef 0", off["peak_rss"] / 2**30, "GiB"),
        Row("KL to the reference, last step (kl_coef 0.01)", on["records"][-1]["kl"], "nats/token"),
    ]
    print_rows(rows)
    if args.json:
        write_json(args.json, "reference_kl", command_line(argv), rows)
    return rows


if __name__ == "__main__":
    main()
