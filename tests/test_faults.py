"""Process-level faults on real `opsd run`s (real processes, redis-server, TextWorld, the tiny model).

A worker SIGKILLed while it holds a group, the trainer SIGKILLed mid-step
(restarted by the supervisor, or the whole run crashed and resumed), Redis
restarted mid-run, the embedder unreachable, and a randomized soak of all of
these (tests/soak.py). Each run must finish and train every issued group
exactly once; a resumed run must end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
from safetensors.numpy import load_file

from opsd.queue import StreamNames
from opsd.redis_server import LocalRedis, connect
from opsd.tracking import mlflow_key, scalars
from services.trainer.checkpoint import WRITE_DELAY_ENV
from tests.soak import (TARGETS, OpsdRun, accounting, alive, checkpoint_step, fault_plan, kill_role, run_env, soak,
                        wait_until, write_config)
from tests.tiny_model import make_tiny_model_dir
from tests.tracker_readers import mlflow_run, tensorboard_histograms, tensorboard_scalars, tensorboard_texts, wandb_run

e2e = pytest.mark.e2e  # every test here but the first runs a real `opsd run`
RUN_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server owned by the test (append-only, fsync always), so the test can inspect and restart it."""
    server = LocalRedis(tmp_path / "redis.log", data_dir=tmp_path / "redis-data", appendonly=True).start()
    yield server
    server.stop()


STARTED: list[OpsdRun] = []


@pytest.fixture(autouse=True)
def no_leftover_runs():
    """A test that fails half-way leaves no `opsd run` behind (it would compete for the 2 cores)."""
    yield
    while STARTED:
        run = STARTED.pop()
        if run.proc.poll() is None:
            run.crash()


def launch(args: list[str], log: Path, redis_url: str | None = None, **env: str) -> OpsdRun:
    STARTED.append(OpsdRun(args, log, run_env(redis_url, **env)))
    return STARTED[-1]


def start(tmp_path: Path, config: Path, redis_url: str | None = None, **env: str) -> tuple[OpsdRun, Path]:
    """`opsd run CONFIG` into tmp_path/runs; returns it and its run directory once that exists."""
    run = launch([str(config), "--output-dir", str(tmp_path / "runs")], tmp_path / "opsd.log", redis_url, **env)
    found = wait_until(lambda: next(iter((tmp_path / "runs").glob("*/config.yaml")), None), 120, "run directory", run)
    return run, found.parent


def finish(run: OpsdRun) -> None:
    assert run.wait(RUN_TIMEOUT_S) == 0, run.output()[-4000:]


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def scraped(run_dir: Path, role: str, series: str) -> float:
    """A counter's value in the role's last /metrics scrape (0.0 when absent)."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", (run_dir / "scrapes" / f"{role}.prom").read_text(), re.M)
    return float(m.group(1)) if m else 0.0


# A parent like `opsd run` (its Services start one role in a session of its own), and that role:
# a RoleProcess that only waits for its stop flag.
PARENT = """
import sys, time
from pathlib import Path
from opsd.supervisor import Services
role = [sys.executable, "-c", "import sys; from opsd.service import RoleProcess; "
        "p = RoleProcess.start('probe', sys.argv[1], sys.argv[2]); p.stop.wait(); print('probe stopped', flush=True)",
        sys.argv[1], sys.argv[2]]
services = Services(Path(sys.argv[2]), Path(sys.argv[1]), "redis://:unused@127.0.0.1:9/0", "t" * 32, command=lambda _: role)
services.start("probe")
print(services.procs["probe"].pid, flush=True)
time.sleep(600)
"""


def test_roles_stop_when_opsd_run_is_killed(tmp_path):
    """SIGKILL of the CLI (e.g. `kill -9 -PGID`, which misses the roles' own sessions): its roles stop by themselves."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "c.yaml").write_text("{}")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "c.yaml"), str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: not alive(child), 60, "the orphaned role to stop")
    finally:
        for pid in (parent.pid, child):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "probe stopped" in (tmp_path / "logs" / "probe.log").read_text()


@e2e
def test_rollout_killed_holding_a_group_is_redelivered_and_trained_once(tmp_path, tiny_model, own_redis):
    prefix = "faults-rollout"
    cfg = write_config(tmp_path / "rollout.yaml", tiny_model, redis={"stream_prefix": prefix})
    run, run_dir = start(tmp_path, cfg, own_redis.url)
    client = connect(own_redis.url, 1000)
    tasks = StreamNames(prefix).tasks

    def held():
        try:
            return next(iter(client.xpending_range(tasks, "rollout", "-", "+", 1)), None)
        except redis.ResponseError:  # the stream or the rollout group does not exist yet
            return None

    # Kill the worker while it works on a task; if it finished the task just before dying, try the next one.
    for _ in range(3):
        entry = wait_until(held, 300, "a task held by the rollout worker", run, poll_s=0.002)
        consumer, eid = entry["consumer"], entry["message_id"]
        pid = int(consumer.decode().rsplit("-", 1)[1])  # consumer names are rollout-<host>-<pid>
        if alive(pid):  # else a worker killed by an earlier try died holding this entry
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not alive(pid), 30, "the rollout worker to die")
        still = client.xpending_range(tasks, "rollout", eid, eid, 1)
        if still and still[0]["consumer"] == consumer:
            break
    else:
        pytest.fail("the rollout worker finished every task before the kill landed (3 tries)")
    assert still[0]["times_delivered"] == 1

    # The restarted worker re-claims the dead worker's entry after redis.reclaim_idle_ms and finishes it.
    def redelivered():
        p = client.xpending_range(tasks, "rollout", eid, eid, 1)
        return not p or (p[0]["consumer"] != consumer and p[0]["times_delivered"] == 2)

    wait_until(redelivered, 120, "the held task to be re-claimed", run, poll_s=0.01)
    finish(run)
    assert json.loads((run_dir / "run_summary.json").read_text())["restarts"]["rollout"] >= 1
    assert scraped(run_dir, "rollout", f'opsd_messages_reclaimed_total{{role="rollout",stream="{tasks}"}}') >= 1
    books = accounting(run_dir, client)
    client.close()
    assert books["violations"] == []
    assert books["trained"] == books["applied_entries"] == books["produced"]["tasks"] == 4  # 2 steps x 2 games


# ---------------------------------------------------------------- trainer killed mid-step, then resumed

STEPS = 3
# 16 PPO epochs hold each step's training for seconds (one epoch takes ~0.3 s with the tiny model), so a kill
# sent once the trainer has logged taking a step's groups lands mid-step.
MID_STEP = {"run": {"steps": STEPS}, "trainer": {"ppo_epochs": 16}}


@pytest.fixture(scope="module")
def reference_run(tiny_model, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed run is compared with (seeded, synchronous: run.max_staleness 0)."""
    tmp = tmp_path_factory.mktemp("reference")
    run, run_dir = start(tmp, write_config(tmp / "reference.yaml", tiny_model, **MID_STEP))
    finish(run)
    return run_dir


def kill_mid_step(run: OpsdRun, run_dir: Path, step: int, kill) -> None:
    """Call `kill()` while the trainer trains `step`: it has logged taking the step's groups, not its metrics line.

    Keyed to the trainer's own progress, not to a wait: the step then trains for seconds (MID_STEP).
    """
    metrics, trainer_log = run_dir / "metrics.jsonl", run_dir / "logs" / "trainer.log"
    wait_until(lambda: trainer_log.exists() and f"step {step}: 2 groups in" in trainer_log.read_text(errors="replace"), 300,
               f"the trainer to take step {step}'s groups", run, poll_s=0.005)
    kill()
    assert lines(metrics) == step, "the step finished before the kill: not a mid-step kill"


def assert_same_as(reference: Path, run_dir: Path) -> None:
    """Every tensor of the final checkpoint bit-identical, and the same loss at every step."""
    want, got = (load_file(d / "checkpoint" / "model.safetensors") for d in (reference, run_dir))
    assert sorted(want) == sorted(got)
    differ = [k for k in want if want[k].dtype != got[k].dtype or not np.array_equal(want[k], got[k])]
    assert differ == [], f"tensors differ from the uninterrupted run's: {differ}"
    want_loss, got_loss = ([json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
                           for d in (reference, run_dir))
    assert len(want_loss) == STEPS and got_loss == want_loss
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["policy_version"] == STEPS
    assert len(state["applied"]) == len({k.rsplit("@v", 1)[0] for k in state["applied"]}) == 2 * STEPS


# All three experiment trackers, offline (docs/trackers.md): the killed-and-resumed runs below must leave in each
# tracker, read back by its own reader, exactly metrics.jsonl's values, every step once.
TRACKED = {"report_to": ["wandb", "tensorboard", "mlflow"]}
OFFLINE = {"wandb": {"mode": "offline"}, "trajectories_per_step": 3}


def assert_trackers_hold_metrics(run_dir: Path) -> None:
    """Each tracker's own reader shows every metrics.jsonl step once, with its values, histograms and table; the
    W&B and MLflow runs are the ones the run started with (one id across the resume)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(len(records))) and steps
    expected = {r["step"]: scalars(r) for r in records}
    assert all("trainer/loss" in v and "learning/success_rate" in v for v in expected.values())
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["sent_through"] == dict.fromkeys(TRACKED["report_to"], steps[-1])
    assert list((run_dir / "tracking").glob("step_*.json")) == []  # every staged report sent

    wb = wandb_run(run_dir)
    assert set(wb.run_ids) == {state["wandb"]["id"]} and wb.steps == steps  # one run id; no step twice, none back
    for step, values in expected.items():
        row = wb.history[step]
        assert {k: row[k] for k in values} == values
        assert row["histograms/advantages"]["_type"] == "histogram" and sum(row["histograms/advantages"]["values"]) > 0
        assert len(row["learning/trajectories"]["data"]) == 3
    assert wb.config["opsd"]["run_dir"] == str(run_dir.resolve())

    tb = run_dir / "tensorboard"
    got = tensorboard_scalars(tb)
    for key in expected[0]:
        want = [(step, float(np.float32(v[key]))) for step, v in expected.items() if key in v]
        assert [(s, float(np.float32(x))) for s, x in got[key]] == want, key
    assert [s for s, _ in tensorboard_histograms(tb)["histograms/advantages"]] == steps
    assert [s for s, _ in tensorboard_texts(tb)["learning/trajectories/text_summary"]] == steps

    ml = mlflow_run(run_dir, state["mlflow"]["run_id"])
    assert ml.status == "FINISHED" and ml.tags["opsd.run_dir"] == str(run_dir.resolve())
    for key in expected[0]:
        assert ml.metrics[mlflow_key(key)] == [(step, v[key]) for step, v in expected.items() if key in v], key
    assert sorted(k for k in ml.artifacts if k.startswith("trajectories/")) == [f"trajectories/step_{s:05d}.json" for s in steps]


@e2e
def test_trainer_killed_mid_step_is_restarted_and_ends_bit_identical(tmp_path, tiny_model, reference_run):
    run, run_dir = start(tmp_path, write_config(tmp_path / "killed.yaml", tiny_model, **MID_STEP))
    kill_mid_step(run, run_dir, 1, lambda: kill_role(run, "trainer"))
    finish(run)
    assert json.loads((run_dir / "run_summary.json").read_text())["restarts"]["trainer"] == 1
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert re.search(r"resuming from \S+ at step 1 \(policy version 1\)", trainer_log), trainer_log[-3000:]
    assert_same_as(reference_run, run_dir)


@e2e
def test_whole_run_crashed_mid_step_resumes_bit_identical(tmp_path, tiny_model, reference_run):
    # With the three trackers on (reporting only: the run must still end bit-identical to the untracked one).
    config = write_config(tmp_path / "crashed.yaml", tiny_model, run={**MID_STEP["run"], **TRACKED},
                          trainer=MID_STEP["trainer"], tracking=OFFLINE)
    run, run_dir = start(tmp_path, config)
    killed = []
    kill_mid_step(run, run_dir, 1, lambda: killed.extend(run.crash()))
    assert len(killed) >= 5  # the CLI, its redis-server and the three roles (and anything they started)
    ids = json.loads((run_dir / "trackers.json").read_text())
    resumed = launch(["--resume", str(run_dir)], tmp_path / "resume.log")
    finish(resumed)
    assert "resuming after 1 logged steps" in resumed.output()
    assert_same_as(reference_run, run_dir)
    after = json.loads((run_dir / "trackers.json").read_text())
    assert (after["wandb"]["id"], after["mlflow"]["run_id"]) == (ids["wandb"]["id"], ids["mlflow"]["run_id"])
    assert_trackers_hold_metrics(run_dir)


@e2e
def test_trainer_killed_while_a_checkpoint_is_written_resumes_from_the_previous_one(tmp_path, tiny_model, own_redis):
    """Checkpoints are written in the background after the version is published; a SIGKILL while step 2's is
    half-written (the test hook holds each write for seconds after its model file) resumes from step 1's: step 1's
    groups, trained but not covered by a complete checkpoint, were never acked, so Redis re-delivers them and
    they are trained again; the run ends with every step, version and group once."""
    prefix = "faults-ckpt"
    cfg = write_config(tmp_path / "ckpt.yaml", tiny_model, run={"steps": 3, **TRACKED}, redis={"stream_prefix": prefix},
                       tracking=OFFLINE)
    run, run_dir = start(tmp_path, cfg, own_redis.url, **{WRITE_DELAY_ENV: "1.5"})
    client = connect(own_redis.url, 1000)
    scored = StreamNames(prefix).scored
    mid_write = run_dir / ".checkpoint-tmp" / "model.safetensors"

    pending = []

    def writing_step_2() -> bool:  # and what the trainer held unacked at that moment
        if not (mid_write.exists() and checkpoint_step(run_dir) == 1):
            return False
        pending.append(client.xpending(scored, "trainer")["pending"])
        return True

    assert kill_role(run, "trainer", 300, when=writing_step_2) is not None
    assert checkpoint_step(run_dir) == 1 and (run_dir / "weights" / "policy-v00002.safetensors").exists()  # published
    assert pending[-1] >= 2  # step 1's two groups: trained, held unacked while their checkpoint is written
    finish(run)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert re.search(r"resuming from \S+/checkpoint at step 1 \(policy version 1\)", trainer_log), trainer_log[-3000:]
    assert json.loads((run_dir / "run_summary.json").read_text())["restarts"]["trainer"] == 1
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == state["policy_version"] == 3
    assert len(state["applied"]) == len({k.rsplit("@v", 1)[0] for k in state["applied"]}) == 6
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not (run_dir / ".checkpoint-tmp").exists() and json.loads((run_dir / "DONE").read_text())["policy_version"] == 3
    books = accounting(run_dir, client)
    assert client.xpending(scored, "trainer")["pending"] == 0
    client.close()
    assert books["violations"] == [], books
    assert books["trained"] == books["applied_entries"] == books["produced"]["tasks"] == 6
    # Step 1 was logged to metrics.jsonl, then trained again after the kill: the trackers hold only the second.
    assert_trackers_hold_metrics(run_dir)


# ---------------------------------------------------------------- Redis and embedder outages


@e2e
def test_redis_restarted_mid_run_loses_nothing(tmp_path, tiny_model, own_redis):
    cfg = write_config(tmp_path / "redis.yaml", tiny_model, redis={"stream_prefix": "faults-redis"})
    run, run_dir = start(tmp_path, cfg, own_redis.url)
    wait_until(lambda: lines(run_dir / "metrics.jsonl") >= 1, 300, "step 0", run)
    # Down longer than a client's own retries (~1.5 s): the roles' own reconnect loops must ride it out.
    own_redis.restart(down_s=4.0)
    finish(run)
    client = connect(own_redis.url, 1000)
    books = accounting(run_dir, client)
    client.close()
    assert books["violations"] == []
    assert books["trained"] == books["produced"]["scored"] == books["produced"]["tasks"] == 4
    reconnects = {r: scraped(run_dir, r, f'opsd_redis_reconnects_total{{role="{r}"}}') for r in ("rollout", "teacher", "trainer")}
    assert sum(reconnects.values()) >= 1, reconnects


@e2e
def test_embedder_down_falls_back_to_identity_views_and_counts_it(tmp_path, tiny_model):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cfg = write_config(tmp_path / "embedder.yaml", tiny_model, run={"method": "alignopsd", "steps": 1},
                       teacher={"embedder_deadline_s": 2.0, "embedder_timeout_s": 1.0})
    run, run_dir = start(tmp_path, cfg, OPSD_EMBEDDER_URL=f"http://127.0.0.1:{closed}")
    finish(run)
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["embedder_fallbacks"] == 2 and record["matched_turn_rate"] == 0.0
    assert scraped(run_dir, "teacher", 'opsd_embedder_fallbacks_total{role="teacher"}') == 2.0
    teacher_log = (run_dir / "logs" / "teacher.log").read_text()
    assert "embedder call failed" in teacher_log and "; attempt 2 in " in teacher_log  # retried before giving up
    assert teacher_log.count("embedder unavailable") == 2


# ---------------------------------------------------------------- randomized soak


def test_fault_plan_strikes_every_target_at_steps_that_leave_two_to_run():
    import random

    for seed in range(20):
        plan = fault_plan(random.Random(seed), kills=9, steps=8)
        assert len(plan) == 9 and sorted(t for _, t in plan[: len(TARGETS)]) == sorted(TARGETS)  # each once first
        at = [a for a, _ in plan]
        assert at == sorted(at) and all(1 <= a <= 6 for a in at)  # step 0 logged first, two steps left after
    assert fault_plan(random.Random(3), 6, 8) == fault_plan(random.Random(3), 6, 8)  # the seed fixes the plan
    assert fault_plan(random.Random(3), 0, 8) == []
    with pytest.raises(ValueError, match="steps >= 3"):
        fault_plan(random.Random(0), 2, 2)


@e2e
def test_randomized_soak_keeps_the_books(tmp_path, tiny_model):
    """Each fault once (every role, Redis, the trainer as a checkpoint lands) in a seeded random order and pace."""
    report = soak(kills=len(TARGETS), steps=8, seed=1, out_dir=tmp_path, timeout_s=900, log=lambda _: None,
                  model_dir=tiny_model)
    assert report["violations"] == [], json.dumps(report, indent=2)
    assert report["kills"] == dict.fromkeys(TARGETS, 1), report["kill_log"]
    # Each fault struck a running pipeline, no earlier than its planned progress.
    assert all(e["planned_at_steps"] <= e["steps_logged"] < 8 for e in report["kill_log"]), report["kill_log"]
    assert report["trained"] == report["produced"]["scored"] - report["dropped_stale"] == 16
