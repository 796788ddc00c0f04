"""`opsd inspect` page loads on a big step: how long until a step's pages answer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/inspect_page.py [--tasks 16 --rollouts 8 --turns 50 --tokens 64]
        [--method agentopsd] [--repeats 3] [--quick] [--json OUT]

(Named inspect_page.py, not inspect.py: a script's folder comes first on sys.path, and a file
named inspect.py there would stand in for the standard library's `inspect`.)

Writes a synthetic step (tasks x rollouts x turns, each response `tokens/2`-`tokens` tokens,
random ids, log-probs and rewards, observation and action texts) into a run directory through
the trainer's own dump code (services/trainer/dump.py `write_credit_dump`, as
`opsd run --dump-credit` does), then times the inspect API through its HTTP stack
(FastAPI's TestClient, no network):
- `open step (cold)`: the step page of a dump never read (read + parse + validate + answer) plus
  the first group page and the first trajectory page: what a click on the step costs. Target
  (issue 22) < 2 s at 16x8x50.
- `group page (warm)`, `trajectory page (warm)`: the next pages of the same step (parsed dump cached).
- `compare (cold)`: the step replayed with another method (grpo_opd) for the compare page.
- memory, in a fresh process (`--parallel` N requests at once for the uncached step, as the
  server's worker threads run them: load + step page): the RSS it gains at its peak and after,
  as multiples of the dump's size (what opsd.inspect.data.MAX_DUMP_BYTES is set by), and how many
  times the dump was parsed (1: the others waited for it).
Each time is the median of `--repeats` runs (the dump's parse cache cleared before each cold
one). `--quick`: 2x4x10x16, one run (a smoke test). The default method is agentopsd: an
AlignOPSD dump holds an [M, M, L] cross-teacher array, too large to write at this size (dump.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import numpy as np  # noqa: E402

from benchmarks.common import Row, command_line, write_json  # noqa: E402

TARGET_S = 2.0
ACTIONS = ("go north", "go south", "take coin", "open door", "look", "inventory")


def synthetic_groups(tasks: int, rollouts: int, turns: int, tokens: int, seed: int = 0):
    """`tasks` RolloutGroups of `rollouts` trajectories x `turns` turns and their ScoredGroups (identity
    teacher views only: what every method but AlignOPSD dumps). Responses hold tokens/2..tokens ids."""
    from opsd.types import RolloutGroup, ScoredGroup, TaskGroup, Trajectory, TurnRecord

    rng = np.random.default_rng(seed)
    groups, scored = [], []
    for t in range(tasks):
        task = TaskGroup(group_id=f"task{t:03d}", task_id=f"task{t:03d}", step=0, policy_version=0, group_size=rollouts,
                         env="alfworld", game={}, privileged_info="", max_turns=turns)
        trajs, teach, corr = [], [], []
        for r in range(rollouts):
            ids, mask, recs, pos = [rng.integers(0, 49152, 32)], [np.zeros(32, np.uint8)], [], 32
            for k in range(turns):
                n = int(rng.integers(max(1, tokens // 2), tokens + 1))
                act = ACTIONS[int(rng.integers(len(ACTIONS)))]
                valid = bool(rng.random() < 0.9)
                recs.append(TurnRecord(turn_id=k, response_start=pos, response_end=pos + n, text=f"<action>{act}</action>",
                                       thinking="", action=act if valid else "", format_valid=valid, finish_reason="stop",
                                       observation=f"You are in room {k}. You see a door and a coin."))
                ids.append(rng.integers(0, 49152, n))
                mask.append(np.ones(n, np.uint8))
                ids.append(rng.integers(0, 49152, 12))  # the next observation's tokens: never trained on
                mask.append(np.zeros(12, np.uint8))
                pos += n + 12
            tok = np.concatenate(ids).astype(np.int32)
            m = np.concatenate(mask)
            lp = np.where(m == 1, -rng.exponential(1.0, len(tok)), 0).astype(np.float32)
            reward = float(rng.integers(0, 2))
            trajs.append(Trajectory(rollout_id=f"task{t:03d}-r{r}", token_ids_S=tok, sampler_logprobs_S=lp, loss_mask_S=m,
                                    turns=recs, reward=reward, won=reward > 0, ending="won" if reward else "max_turns"))
            teach.append(np.where(m == 1, np.minimum(lp + rng.normal(0, 0.3, len(tok)), 0), 0).astype(np.float32))
            corr.append((teach[-1] * 0.9).astype(np.float32))
        grp = RolloutGroup(task=task, trajectories=trajs, prompt_format="action")
        M = rollouts * turns
        owner = np.repeat(np.arange(rollouts), turns)
        groups.append(grp)
        scored.append(ScoredGroup(rollout=grp, teacher_version=0, teacher_logprobs_S=teach, corrected_logprobs_S=corr,
                                  teacher_thinking_M=[""] * M, similarity_MM=np.zeros((M, M), np.float32),
                                  eligible_MM=owner[:, None] != owner[None, :], selected_sources_M=[[] for _ in range(M)],
                                  source_weights_M=[[] for _ in range(M)], rho_M=np.zeros(M, np.float32),
                                  alpha_M=np.zeros(M, np.float32)))
    return groups, scored


def write_step(run_dir: Path, method: str, tasks: int, rollouts: int, turns: int, tokens: int) -> Path:
    """Step 0's dump of a synthetic step, through the trainer's calls (build_credit_batch, compute_advantages,
    write_credit_dump)."""
    from opsd.config import RunConfig
    from opsd.credit import compute_advantages
    from services.trainer.batch import build_credit_batch
    from services.trainer.dump import write_credit_dump

    groups, scored = synthetic_groups(tasks, rollouts, turns, tokens)
    cfg = RunConfig.model_validate({"run": {"method": method, "name": "bench-inspect"}})
    batch, _ = build_credit_batch(groups, None if method == "grpo" else scored)
    adv, _ = compute_advantages(method, batch, cfg.credit)
    return write_credit_dump(run_dir / "credit" / "step_00000.json", cfg, batch, adv, groups, scored)


def measure(run_dir: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each timed action (module docstring), `repeats` times each."""
    from fastapi.testclient import TestClient

    from opsd.inspect import data
    from opsd.inspect.app import create_app

    token = "bench-token-0123456789abcdef"
    client = TestClient(create_app(run_dir, token))
    auth = {"Authorization": f"Bearer {token}"}

    def get(path: str, **params) -> dict:
        r = client.get(path, params=params, headers=auth)
        r.raise_for_status()
        return r.json()

    out: dict[str, list[float]] = {k: [] for k in ("open", "group", "trajectory", "compare")}
    for _ in range(repeats):
        data._cache.clear()  # a cold open: the dump is read and parsed again
        t0 = time.perf_counter()
        step = get("/api/step", step=0)
        group = step["groups"][0]["group"]
        gv = get("/api/group", step=0, group=group)
        get("/api/trajectory", step=0, group=group, rollout=gv["trajectories"][0]["rollout"])
        out["open"].append(time.perf_counter() - t0)
        other = step["groups"][-1]["group"]
        t0 = time.perf_counter()
        gv = get("/api/group", step=0, group=other)
        out["group"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        get("/api/trajectory", step=0, group=other, rollout=gv["trajectories"][-1]["rollout"])
        out["trajectory"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        get("/api/compare", step=0, group=other, method="grpo_opd")
        out["compare"].append(time.perf_counter() - t0)
    return out


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """This process's RSS high-water mark (Linux VmHWM), since start or the last `clear_refs` reset."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def open_memory(run_dir: Path, requests: int) -> dict[str, float]:
    """In this process (a fresh one: `memory`): `requests` threads open step 0 at once (load + step page).
    Returns MiB of RSS over the baseline at the peak and after ("held"), and the parse count."""
    import threading

    from opsd.inspect import data, views

    parses: list[int] = []
    real = data._loads
    data._loads = lambda raw: parses.append(1) or real(raw)
    start = threading.Barrier(requests)
    got = []

    def request() -> None:
        start.wait()
        got.append(views.step_view(data.load_step(run_dir, 0)))

    threads = [threading.Thread(target=request) for _ in range(requests)]
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here (Linux >= 4.0)
    base = _rss_mib()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == requests, "a request failed"
    return {"peak": _peak_rss_mib() - base, "held": _rss_mib() - base, "parses": len(parses)}


def memory(run_dir: Path, requests: int) -> dict[str, float]:
    """`open_memory` in a fresh Python process (its peak is not this one's, which wrote the dump)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-of", str(run_dir),
                           "--parallel", str(requests)], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64, help="the longest response of a turn, in tokens (default 64)")
    ap.add_argument("--method", default="agentopsd", help="the dumped method (not alignopsd: see the docstring)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick 1)")
    ap.add_argument("--quick", action="store_true", help="2 x 4 x 10 x 16, one run (a smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    ap.add_argument("--parallel", type=int, default=8, help="requests at once for the memory figures (default 8)")
    ap.add_argument("--memory-of", type=Path, default=None, help=argparse.SUPPRESS)  # the child `memory` runs
    args = ap.parse_args(argv)
    if args.memory_of is not None:
        print(json.dumps(open_memory(args.memory_of, args.parallel)))
        return
    if args.quick:
        args.tasks, args.rollouts, args.turns, args.tokens = 2, 4, 10, 16
    repeats = args.repeats or (1 if args.quick else 3)
    size = f"{args.tasks}x{args.rollouts}x{args.turns}x{args.tokens}"
    target = f"< {TARGET_S:g} s" if (args.tasks, args.rollouts, args.turns) == (16, 8, 50) else None
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        path = write_step(run_dir, args.method, args.tasks, args.rollouts, args.turns, args.tokens)
        write_s = time.perf_counter() - t0
        mb = path.stat().st_size / 1e6
        print(f"{args.method} step {size}: dump {mb:.1f} MB written in {write_s:.1f} s", flush=True)
        times = measure(run_dir, repeats)
        mem = memory(run_dir, args.parallel)
    med = {k: statistics.median(v) for k, v in times.items()}
    mib = mb * 1e6 / 2**20
    rows = [
        Row(f"open step (cold) {size}", med["open"], "s", target,
            note=f"step + first group + first trajectory page, {args.method} dump of {mb:.1f} MB, median of {repeats}"),
        Row(f"group page (warm) {size}", med["group"], "s", note=f"{args.rollouts} trajectories x {min(args.turns, 50)} turns"),
        Row(f"trajectory page (warm) {size}", med["trajectory"], "s", note=f"{min(args.turns, 20)} turns of tokens"),
        Row(f"compare (cold) {size}", med["compare"], "s", note="the step replayed with grpo_opd"),
        Row(f"dump size {size}", mb, "MB"),
        Row(f"open peak RSS / dump size {size}", mem["peak"] / mib, "x",
            note=f"{mem['peak']:.0f} MiB over a fresh process, {args.parallel} requests at once for the uncached step"),
        Row(f"held RSS / dump size {size}", mem["held"] / mib, "x", note=f"{mem['held']:.0f} MiB, the parsed step cached"),
        Row(f"parses of {args.parallel} parallel opens {size}", mem["parses"], "", "== 1"),
    ]
    for r in rows:
        verdict = "" if r.ok is None else ("ok" if r.ok else "MISSED")
        print(f"{r.name:<48} {r.value:>9.3f} {r.unit:<3} {r.target or '':<8} {verdict}", flush=True)
    if args.json:
        write_json(args.json, "inspect", command_line(), rows)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
