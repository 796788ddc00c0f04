"""Randomized fault soak: SIGKILL the roles of a real `opsd run` (and its Redis) at random, then check the books.

    python -m tests.soak --kills 8 --steps 12 [--seed 0] [--out DIR]

Runs method alignopsd (embedder, rollout, teacher, trainer) with
run.max_staleness 1 and several groups in flight per rollout and teacher worker on the tiny model (tests/tiny_model.py) against a
redis-server this script owns (append-only file, fsync always). A seeded RNG
plans what to strike, every target once in a random order, then any, and
when, keyed to the run's progress, never to wall time (`fault_plan`): each
fault waits until a drawn number of steps is logged (at least one, and at
least two steps left to run), then, for a role that reads a stream, until
that role holds a job (an entry of its consumer group pending), so it dies
mid-work. The same plan strikes whether the machine is fast or slow.
Targets: a role, "redis", or "trainer@checkpoint" (the trainer the moment
its next checkpoint lands, before it acknowledges what the checkpoint
covers). A killed role is restarted by `opsd run`'s supervisor; a killed
redis-server is started again on its data dir. After the last kill the soak
waits for the run to finish and checks:

  * the run finished: exit code 0, DONE, the checkpoint at run.steps;
  * tasks issued (counts hash field produced:<tasks>) == run.steps x env.num_games;
  * groups produced into the trainer's input stream (produced:<scored>) ==
    groups trained (distinct group ids in the final checkpoint's `applied`) +
    groups dropped as stale (the checkpoint's counts);
  * no group id twice in `applied`, none that was never issued, and every
    issued group trained, dropped as stale or dead-lettered.

The report (kills per target, produced, trained, dropped as stale,
redeliveries deduplicated, dead letters by reason, restarts, violations) is
printed and written to <run_dir>/soak_report.json. The helpers here also
drive tests/test_faults.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import yaml
from redis import exceptions as redis_errors

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tests/soak.py` as well as `python -m tests.soak`
    sys.path.insert(0, str(REPO))

from opsd.config import RunConfig  # noqa: E402
from opsd.queue import StreamNames  # noqa: E402
from opsd.redis_server import LocalRedis, connect  # noqa: E402
from services.trainer.books import accounting  # noqa: E402,F401 (tests/test_faults.py imports it from here)

CONFIG = REPO / "tests" / "configs" / "faults.yaml"
ROLES = ("embedder", "rollout", "teacher", "trainer")
# The trainer killed as its checkpoint lands (or mid-swap), before it acknowledges the groups that checkpoint
# covers, when the kill is in time: its successor gets them again and must drop them as duplicates.
CHECKPOINT_KILL = "trainer@checkpoint"
TARGETS = ROLES + ("redis", CHECKPOINT_KILL)


def write_config(path: Path, model_dir: Path, **sections: dict) -> Path:
    """tests/configs/faults.yaml with model.name = `model_dir` and each `sections[name]` merged over its section.

    Returns `path` (written as YAML).
    """
    data = yaml.safe_load(CONFIG.read_text())
    data["model"]["name"] = str(model_dir)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)


def run_env(redis_url: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for an `opsd run`: REDIS_URL = `redis_url` (None: it starts its own), one OMP thread."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", **extra)
    if redis_url:
        env["REDIS_URL"] = redis_url
    return env


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process from /proc, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name (in parentheses) may hold spaces
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not reaped yet, counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), found by parent pid in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[1], []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def stop_sessions(procs, grace_s: float = 60.0) -> None:
    """SIGTERM the session (process group) of each live `subprocess.Popen` in `procs` (started with
    start_new_session), wait up to `grace_s` for each, then SIGKILL its session."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_until(pred: Callable[[], object], timeout_s: float, what: str, run: "OpsdRun | None" = None, poll_s: float = 0.05):
    """Poll `pred()` until it returns a truthy value (returned).

    Raises AssertionError (with the run's output tail) if `run` exits first,
    TimeoutError after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"opsd run exited ({run.proc.returncode}) while waiting for {what}:\n{run.output()[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
        time.sleep(poll_s)


class OpsdRun:
    """`opsd run ARGS` as a child process in its own session, output appended to `log`.

    Its roles are its children (each in a session of its own, so signals to
    the CLI's process group do not reach them: `crash` finds them by parent pid).
    """

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        self.log = Path(log)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "opsd.cli", "run", *args], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def role_pid(self, role: str) -> int | None:
        """Pid of the live process running `python -m services.<role>` under this run, None while there is none."""
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"services.{role}".encode() in argv and alive(pid):
                return pid
        return None

    def wait(self, timeout_s: float) -> int:
        """Wait for the CLI to exit; returns its exit code. On timeout: `crash` it, raise TimeoutError with the output tail."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.crash()
            raise TimeoutError(f"opsd run did not finish within {timeout_s:.0f}s:\n{self.output()[-4000:]}") from None

    def crash(self) -> list[int]:
        """Freeze the CLI and every process below it (roles, embedded redis-server), then SIGKILL them all.

        Like a machine losing power: nobody runs a handler or notices the
        others die first. Returns the pids killed; waits until they are gone.
        """
        pids = [self.proc.pid] + descendants(self.proc.pid)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in pids), 30, "killed processes to go away")
        return pids


def kill_role(run: OpsdRun, role: str, timeout_s: float = 120.0, when: Callable[[], bool] | None = None) -> int | None:
    """SIGKILL the live process of `role` (waiting up to `timeout_s` s for one); returns its pid once it is gone.

    With `when`, the kill waits (polling every 2 ms, at most `timeout_s` s)
    until `when()` is true; None (no kill) if that process died meanwhile.
    """
    pid = wait_until(lambda: run.role_pid(role), timeout_s, f"live {role} process", run)
    if when is not None:
        wait_until(lambda: when() or not alive(pid), timeout_s, f"the moment to kill {role}", run, poll_s=0.002)
        if not alive(pid):
            return None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 30, f"{role} {pid} to die")
    return pid


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of <run_dir>/checkpoint/trainer_state.json, None while there is none (or it is being swapped in)."""
    try:
        return int(json.loads((Path(run_dir) / "checkpoint" / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


# The stream and consumer group whose pending entries mean "this target holds a job" (alignopsd). The
# embedder reads no stream: it is struck while the teacher, its only client, holds a group.
HOLDS = {"rollout": ("tasks", "rollout"), "teacher": ("rollouts", "teacher"), "embedder": ("rollouts", "teacher"),
         "trainer": ("scored", "trainer")}


def fault_plan(rng: random.Random, kills: int, steps: int, targets: tuple[str, ...] = TARGETS) -> list[tuple[int, str]]:
    """The soak's faults as (steps logged before the strike, target), in strike order.

    Targets: every one of `targets` once in a random order, then random
    picks; each fault's step count is drawn from 1..steps-2 (sorted), so a
    strike always finds a running pipeline with at least two steps to go.
    Raises ValueError for steps < 3, kills < 0 or no targets.
    """
    if steps < 3 or kills < 0 or not targets:
        raise ValueError(f"a soak needs steps >= 3, kills >= 0 and a target (got {steps}, {kills}, {targets})")
    order = rng.sample(targets, len(targets))
    chosen = [order[i] if i < len(order) else rng.choice(targets) for i in range(kills)]
    return list(zip(sorted(rng.randint(1, steps - 2) for _ in range(kills)), chosen))


def holds_a_job(client, names: StreamNames, target: str) -> bool:
    """True while `target`'s consumer group (HOLDS) has an entry delivered and not acknowledged.

    False for a target that reads no stream, and while Redis or the group is not there.
    """
    if target not in HOLDS:
        return False
    stream, group = HOLDS[target]
    try:
        return int(client.xpending(getattr(names, stream), group)["pending"]) > 0
    except (redis_errors.ResponseError, redis_errors.ConnectionError, redis_errors.TimeoutError):
        return False


def soak(kills: int, steps: int, seed: int = 0, out_dir: Path | None = None,
         targets: tuple[str, ...] = TARGETS, timeout_s: float = 1800.0, log: Callable[[str], None] = print,
         model_dir: Path | None = None, groups_in_flight: int = 4) -> dict:
    """Run the soak (module docstring); returns the report, also written to <run_dir>/soak_report.json.

    kills: faults to inject (fault_plan); steps: run.steps (>= 3); seed: the
    run's seed and the fault plan's; out_dir: where the model, Redis data and run go
    (default: a new temp dir); targets: some of TARGETS (roles, "redis",
    CHECKPOINT_KILL); timeout_s: for the whole run; model_dir: a tiny model
    dir to use (default: made in out_dir); groups_in_flight: the rollout
    and teacher workers' max_groups_in_flight (several groups held per worker).
    Raises TimeoutError if the run does not finish in time, AssertionError
    if it exits before its last planned fault, ValueError for a bad plan.
    """
    from tests.tiny_model import make_tiny_model_dir

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="opsd-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(model_dir or out_dir / "tiny-model")
    if not (model_dir / "config.json").exists():
        make_tiny_model_dir(model_dir)
    cfg_path = write_config(
        out_dir / "soak.yaml", model_dir,
        run={"name": "soak", "steps": steps, "seed": seed, "method": "alignopsd", "max_staleness": 1,
             "max_restarts": 10_000, "step_timeout_s": 900},
        rollout={"max_groups_in_flight": groups_in_flight},
        redis={"max_deliveries": 10_000},  # every kill of a worker redelivers what it held: not poison
        teacher={"embedder_deadline_s": 60, "max_groups_in_flight": groups_in_flight},
    )
    rng = random.Random(seed)
    plan = fault_plan(rng, kills, steps, targets)
    server = LocalRedis(out_dir / "redis.log", data_dir=out_dir / "redis", appendonly=True).start()
    t0 = time.monotonic()
    run = OpsdRun([str(cfg_path), "--output-dir", str(out_dir / "runs")], out_dir / "opsd.log", run_env(server.url))
    events: list[dict] = []
    try:
        run_dir = wait_until(lambda: next((p for p in (out_dir / "runs").glob("soak-*") if p.is_dir()), None), 120,
                             "run directory", run)
        metrics = run_dir / "metrics.jsonl"
        names = StreamNames(RunConfig.load(cfg_path).redis.stream_prefix)
        watch = connect(server.url, 1000)

        def logged() -> int:
            return metrics.read_text().count("\n") if metrics.exists() else 0

        def remaining() -> float:
            return max(timeout_s - (time.monotonic() - t0), 1.0)

        for at, target in plan:
            wait_until(lambda: logged() >= at, remaining(), f"{at} steps logged", run, poll_s=0.05)
            # Mid-work: once the target holds a job, or (nothing left for it to take) once the next step is logged.
            wait_until(lambda: target not in HOLDS or holds_a_job(watch, names, target) or logged() > at,
                       remaining(), f"{target} to hold a job", run, poll_s=0.005)
            if target == "redis":
                pid = server.process.pid
                server.process.kill()
                server.process.wait()
                server.restart(down_s=rng.uniform(0.5, 3.0))
            elif target == CHECKPOINT_KILL:
                before = checkpoint_step(run_dir)
                pid = kill_role(run, "trainer", when=lambda: checkpoint_step(run_dir) != before or (run_dir / "DONE").exists())
            else:
                pid = kill_role(run, target)
            events.append({"t": round(time.monotonic() - t0, 1), "target": target, "pid": pid,
                           "planned_at_steps": at, "steps_logged": logged()})
            log(f"soak: killed {target} (pid {pid}) at {events[-1]['t']}s, {events[-1]['steps_logged']} steps logged")
        watch.close()
        rc = run.wait(max(timeout_s - (time.monotonic() - t0), 1.0))
        client = connect(server.url, 1000)
        try:
            report = accounting(run_dir, client)
        finally:
            client.close()
    finally:
        if run.proc.poll() is None:
            run.crash()
        server.stop()
    report = {"seed": seed, "exit_code": rc, "wall_seconds": round(time.monotonic() - t0, 1),
              "kills_done": len(events), "kills": dict(Counter(e["target"] for e in events)), "kill_log": events, **report}
    if rc != 0:
        report["violations"].insert(0, f"opsd run exited with code {rc}")
    (run_dir / "soak_report.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report, indent=2))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=8, help="faults to inject (SIGKILLs)")
    ap.add_argument("--steps", type=int, default=12, help="run.steps")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed and the fault RNG's")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: a new temp dir)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--groups-in-flight", type=int, default=4, help="rollout and teacher max_groups_in_flight")
    args = ap.parse_args()
    report = soak(args.kills, args.steps, args.seed, args.out, tuple(args.targets.split(",")),
                  groups_in_flight=args.groups_in_flight)
    sys.exit(0 if not report["violations"] else 1)


if __name__ == "__main__":
    main()
