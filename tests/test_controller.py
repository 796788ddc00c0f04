"""The trainer's controller on a real redis-server: admission (TaskIssuer), the Collector, weight-file retention."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from opsd import wire
from opsd.config import RunConfig
from opsd.envs import Task
from opsd.queue import StreamNames, StreamQueue, produce_message
from opsd.types import RolloutGroup, TaskGroup
from opsd.weights import StalePolicyError, ensure_version, prune_versions, published_versions, weights_path
from services.trainer.controller import (Backoff, Collector, DeadLetters, StepFailed, TaskIssuer, group_id, step_tasks,
                                         wait_for_groups)
from tests.factories import make_rollout_group

MAX_BYTES = 16 * 1024 * 1024
pytestmark = pytest.mark.redis


def FakeGame(task_id: str, walkthrough: str | None = None) -> Task:
    """A task the controller can issue (it is never played here)."""
    return Task(task_id, "1-step", {"seed": int(task_id[-2:])}, gold_path=[walkthrough or f"walkthrough of {task_id}"])


GAMES = [FakeGame(f"tw-{i:02d}") for i in range(6)]


def _cfg(prefix: str, steps: int = 5, k: int = 1, num_games: int = 2) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"method": "grpo", "steps": steps, "max_staleness": k, "step_timeout_s": 60},
        "redis": {"stream_prefix": prefix, "block_ms": 100},
        "env": {"num_games": num_games},
        "rollout": {"group_size": 2},
    })


def _queue(client, prefix: str, consumer: str = "trainer-1", stream: str = "rollouts", cls=RolloutGroup) -> StreamQueue:
    names = StreamNames(prefix)
    q = StreamQueue(client, getattr(names, stream), "trainer" if stream == "rollouts" else "rollout", consumer, cls,
                    role="trainer-test", max_bytes=MAX_BYTES, dead_stream=names.dead)
    q.ensure_group()
    return q


def _group(step: int, task_id: str, version: int, seed: int = 0) -> RolloutGroup:
    g = make_rollout_group(G=2, turns=1, seed=seed)
    return replace(g, task=replace(g.task, group_id=group_id(step, task_id), task_id=task_id, step=step, policy_version=version))


def _produce(client, prefix: str, msg) -> str:
    return produce_message(client, StreamNames(prefix).rollouts, msg, MAX_BYTES)


def _pending(client, prefix: str) -> set[str]:
    rows = client.xpending_range(StreamNames(prefix).rollouts, "trainer", "-", "+", 100)
    return {r["message_id"].decode() for r in rows}


def _dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("opsd_groups_dropped_total", {"role": "trainer-test", "reason": reason}) or 0.0


def test_group_ids_do_not_depend_on_the_run():
    a = step_tasks(_cfg("opsd:run-a"), GAMES, 3, 1)
    b = step_tasks(_cfg("opsd:run-b"), GAMES, 3, 1)
    assert [t.group_id for t in a] == [t.group_id for t in b]
    assert all(t.group_id == f"s00003-{t.task_id}" and t.step == 3 and t.policy_version == 1 for t in a)


def test_collector_drops_duplicates_and_stale_groups_and_buffers_future_steps(redis_client, stream_prefix):
    q = _queue(redis_client, stream_prefix)
    col = Collector(q, max_staleness=1, role="trainer-test")
    dup0, stale0 = _dropped("duplicate"), _dropped("stale")
    e_b = _produce(redis_client, stream_prefix, _group(0, "tw-b", 0, seed=2))
    e_future = _produce(redis_client, stream_prefix, _group(1, "tw-c", 0, seed=3))  # step 1 issued early (k = 1)
    e_a = _produce(redis_client, stream_prefix, _group(0, "tw-a", 0, seed=1))
    e_a2 = _produce(redis_client, stream_prefix, _group(0, "tw-a", 0, seed=1))  # a second entry of one group
    col.poll(version=0, step=0, block_ms=100, reclaim_idle_ms=60_000)
    assert set(col.buffer) == {"s00000-tw-a", "s00000-tw-b", "s00001-tw-c"}
    assert col.counts == {"trained": 0, "dropped_stale": 0, "dropped_duplicate": 1, "dropped_future": 0}
    assert _pending(redis_client, stream_prefix) == {e_a, e_b, e_future}  # the duplicate entry is acked at once

    assert col.take(["s00000-tw-a", "s00000-tw-x"], 0, 0) is None  # not all here: nothing moves
    msgs = col.take(["s00000-tw-a", "s00000-tw-b"], step=0, version=0)
    assert [m.group_id for m in msgs] == ["s00000-tw-a", "s00000-tw-b"]  # task order, not delivery order
    assert col.applied == ["s00000-tw-a@v0", "s00000-tw-b@v0"] and col.trained == [e_a, e_b]
    assert set(col.buffer) == {"s00001-tw-c"}

    # Trainer at version 3: a version-1 group is 2 behind (> k = 1); a trained group comes back (redelivery).
    e_stale = _produce(redis_client, stream_prefix, _group(3, "tw-d", 1))
    e_again = _produce(redis_client, stream_prefix, _group(0, "tw-a", 0, seed=1))
    col.poll(version=3, step=3, block_ms=100, reclaim_idle_ms=60_000)
    assert col.counts == {"trained": 2, "dropped_stale": 1, "dropped_duplicate": 2, "dropped_future": 0}
    assert _dropped("duplicate") - dup0 == 2 and _dropped("stale") - stale0 == 1
    pending = _pending(redis_client, stream_prefix)
    assert e_stale not in pending and e_again not in pending and e_a2 not in pending
    assert pending == {e_a, e_b, e_future}  # trained (no checkpoint yet) and buffered groups stay held


def test_a_group_claiming_a_version_never_published_is_dropped(redis_client, stream_prefix):
    """A group stamped v999 against a v0 trainer is refused and counted, never trained with staleness 0; a
    resumed trainer (checkpoint v2) still takes groups of the v4 it had published before it stopped."""
    q = _queue(redis_client, stream_prefix)
    col = Collector(q, max_staleness=1, role="trainer-test")
    future0 = _dropped("future")
    e_forged = _produce(redis_client, stream_prefix, _group(0, "tw-a", 999))
    e_next = _produce(redis_client, stream_prefix, _group(0, "tw-b", 1, seed=2))  # one ahead of v0: never published
    col.poll(version=0, step=0, block_ms=100, reclaim_idle_ms=60_000)
    assert col.buffer == {} and col.counts["dropped_future"] == 2 and _dropped("future") - future0 == 2
    assert e_forged not in _pending(redis_client, stream_prefix) and e_next not in _pending(redis_client, stream_prefix)

    resumed = Collector(_queue(redis_client, stream_prefix), max_staleness=1, role="trainer-test", newest_published=4)
    _produce(redis_client, stream_prefix, _group(2, "tw-c", 3, seed=3))
    resumed.poll(version=2, step=2, block_ms=100, reclaim_idle_ms=60_000)
    assert set(resumed.buffer) == {"s00002-tw-c"} and resumed.counts["dropped_future"] == 0


def test_held_groups_are_kept_alive_and_acked_only_after_release(redis_client, stream_prefix):
    q = _queue(redis_client, stream_prefix)
    other = _queue(redis_client, stream_prefix, consumer="trainer-2")  # e.g. a second trainer started by mistake
    col = Collector(q, max_staleness=0, role="trainer-test")
    e_a = _produce(redis_client, stream_prefix, _group(0, "tw-a", 0))
    e_next = _produce(redis_client, stream_prefix, _group(1, "tw-b", 0, seed=4))
    col.poll(0, 0, block_ms=100, reclaim_idle_ms=60_000)
    assert col.take(["s00000-tw-a"], 0, 0) is not None
    # other.reclaim right after a poll must come within IDLE_MS of the poll's keep-alive: 2 s is far more
    # than two Redis calls take on a loaded machine (200 ms was not). Each sleep outlasts IDLE_MS, so
    # without the poll's keep-alive every reclaim below would take the entries.
    IDLE_MS = 2000
    for _ in range(3):  # waiting for step 1 across a checkpoint_every > 1 gap
        time.sleep(IDLE_MS / 1000 + 0.1)
        col.poll(1, 1, block_ms=1, reclaim_idle_ms=60_000)
        assert other.reclaim(IDLE_MS, count=10) == []  # idle < IDLE_MS: the poll refreshed both held entries
    assert _pending(redis_client, stream_prefix) == {e_a, e_next}
    # A re-claim of our own held entry (after a step longer than reclaim_idle_ms) changes nothing.
    (d,) = [d for d in q.reclaim(0, count=10) if d.entry_id == e_a]
    assert col.offer(d, 1, 1) == "held" and col.counts["dropped_duplicate"] == 0

    col.release_trained()  # a checkpoint now covers step 0
    assert col.flush() == 1
    assert _pending(redis_client, stream_prefix) == {e_next}
    time.sleep(IDLE_MS / 1000 + 0.1)  # not polled: nothing keeps the buffered entry alive now
    assert [d.entry_id for d in other.reclaim(IDLE_MS, count=10)] == [e_next]


def test_a_checkpoint_releases_only_the_groups_trained_before_it_began(redis_client, stream_prefix):
    """The trainer's background checkpoint covers the groups trained when it started (`covered`); groups
    trained while it is written stay held and unacked until a later checkpoint covers them."""
    col = Collector(_queue(redis_client, stream_prefix), max_staleness=1, role="trainer-test")
    e0 = _produce(redis_client, stream_prefix, _group(0, "tw-a", 0))
    e1 = _produce(redis_client, stream_prefix, _group(1, "tw-b", 0, seed=4))
    col.poll(0, 0, block_ms=100, reclaim_idle_ms=60_000)
    assert col.take(["s00000-tw-a"], 0, 0) is not None
    covered = len(col.trained)  # step 1's checkpoint begins
    assert col.take(["s00001-tw-b"], 1, 1) is not None  # the next step's groups come in while it is written
    col.release_trained(covered)
    assert col.flush() == 1 and _pending(redis_client, stream_prefix) == {e1} and col.trained == [e1]
    assert e0 not in col.held() and e1 in col.held()
    col.release_trained()
    assert col.flush() == 1 and _pending(redis_client, stream_prefix) == set()


def test_issuer_issues_each_step_once_in_one_transaction(redis_client, stream_prefix):
    cfg = _cfg(stream_prefix, steps=5, k=2)
    tasks = StreamNames(stream_prefix).tasks
    issuer = TaskIssuer(redis_client, cfg, GAMES, MAX_BYTES)
    assert issuer.top_up(0, 0) == [0, 1, 2]
    assert redis_client.xlen(tasks) == 6 and int(redis_client.get(f"{stream_prefix}:issued_step")) == 2
    assert int(redis_client.hget(StreamNames(stream_prefix).counts, f"produced:{tasks}")) == 6
    assert issuer.top_up(0, 0) == []
    assert TaskIssuer(redis_client, cfg, GAMES, MAX_BYTES).top_up(1, 1) == [3]  # a resumed trainer continues
    assert issuer.top_up(4, 4) == [4]  # never past run.steps - 1
    assert issuer.top_up(4, 4) == []
    entries = redis_client.xrange(tasks)
    msgs = [wire.decode(fields[b"data"], TaskGroup, MAX_BYTES) for _, fields in entries]
    assert [(m.step, m.policy_version) for m in msgs] == [(0, 0)] * 2 + [(1, 0)] * 2 + [(2, 0)] * 2 + [(3, 1)] * 2 + [(4, 4)] * 2
    assert [m.group_id for m in msgs[:2]] == [t.group_id for t in step_tasks(cfg, GAMES, 0, 0)]

    redis_client.delete(f"{stream_prefix}:issued_step")  # Redis lost its data
    assert issuer.top_up(3, 3) == [3, 4]  # from the current step again, with the current version
    assert [wire.decode(f[b"data"], TaskGroup, MAX_BYTES).policy_version for _, f in redis_client.xrange(tasks)[-4:]] == [3] * 4


def _stall(redis_client, seconds: float) -> threading.Timer:
    """Stop the Redis server process (SIGSTOP) for `seconds`: what a client sends meanwhile waits in its socket
    and runs when the server continues, even if the client gave up on it (timed out, reconnected, re-sent)."""
    pid = int(redis_client.info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    return timer


def test_a_step_issued_across_a_redis_stall_is_issued_once(redis_url, redis_client, stream_prefix):
    """A 6.5 s stall of Redis: the issuer's client times out after 5.1 s and re-sends its write; when Redis
    continues it runs both copies. The step must still be issued once: 2 tasks, counted 2 (a MULTI/EXEC sent
    twice made 4). Re-issuing dead-lettered tasks likewise."""
    from opsd.redis_server import connect

    cfg = _cfg(stream_prefix, steps=5, k=0)
    tasks, counts = StreamNames(stream_prefix).tasks, StreamNames(stream_prefix).counts
    client = connect(redis_url, block_ms=100)  # socket timeout 5.1 s, commands retried on a timeout
    issuer = TaskIssuer(client, cfg, GAMES, MAX_BYTES)
    client.get(issuer.key)  # connected before the stall: the stall hits the write itself
    (first, _) = step_tasks(cfg, GAMES, 0, 0)
    for attempt in (lambda: issuer.top_up(0, 0), lambda: issuer.reissue(0, {first.group_id}, 1)):
        timer = _stall(redis_client, 6.5)
        try:
            t0 = time.perf_counter()
            attempt()
            assert time.perf_counter() - t0 > 5.0  # the write timed out once and was sent again
        finally:
            timer.join()
    assert redis_client.xlen(tasks) == 3 and int(redis_client.hget(counts, f"produced:{tasks}")) == 3
    client.close()


def test_issuer_writes_nothing_when_a_step_cannot_be_issued_whole(redis_client, stream_prefix):
    games = [FakeGame("tw-01"), FakeGame("tw-02", "x" * 20_000)]  # both are step 0's tasks; one is over the size limit
    issuer = TaskIssuer(redis_client, _cfg(stream_prefix), games, max_bytes=4096)
    with pytest.raises(wire.WireError):
        issuer.top_up(0, 0)
    assert redis_client.xlen(StreamNames(stream_prefix).tasks) == 0
    assert redis_client.get(f"{stream_prefix}:issued_step") is None
    assert redis_client.hget(StreamNames(stream_prefix).counts, f"produced:{StreamNames(stream_prefix).tasks}") is None


def _fake_rollout(client, prefix: str, stop: threading.Event) -> None:
    """Plays every task at once: a RolloutGroup with the task's ids, produced and acked atomically."""
    q = _queue(client, prefix, consumer="rollout-1", stream="tasks", cls=TaskGroup)
    out = StreamNames(prefix).rollouts
    while not stop.is_set():
        try:
            for d in q.consume(50, count=8):
                seed = sum(map(ord, d.msg.group_id))
                q.produce_then_ack(out, replace(make_rollout_group(G=2, turns=1, seed=seed), task=d.msg), d.entry_id)
        except redis.RedisError:
            time.sleep(0.05)


def test_wait_for_groups_rides_over_a_redis_that_lost_its_data(redis_url, redis_client, stream_prefix):
    from opsd.redis_server import connect

    cfg = _cfg(stream_prefix, steps=3, k=1)
    q = _queue(redis_client, stream_prefix)
    issuer = TaskIssuer(redis_client, cfg, GAMES, MAX_BYTES)
    col = Collector(q, 1, role="trainer-test")
    stop = threading.Event()
    worker = threading.Thread(target=_fake_rollout, args=(connect(redis_url, 100), stream_prefix, stop), daemon=True)
    worker.start()
    try:
        ids0 = [t.group_id for t in step_tasks(cfg, GAMES, 0, 0)]
        dead = DeadLetters(redis_client, StreamNames(stream_prefix).dead)
        msgs = wait_for_groups(stop, cfg, issuer, col, Backoff("trainer-test", stop), dead, ids0, 0, 0)
        assert [m.group_id for m in msgs] == ids0
        assert int(redis_client.get(f"{stream_prefix}:issued_step")) == 1  # step 1 went out with step 0 (k = 1)
        deadline = time.monotonic() + 30
        while len(col.buffer) < 2 and time.monotonic() < deadline:  # step 1's groups arrive while step 0 "trains"
            col.poll(0, 1, 100, 60_000)
        assert len(col.buffer) == 2
        col.release_trained()
        col.flush()

        # Redis restarts empty: streams, groups and the issued_step key are gone.
        redis_client.delete(*redis_client.keys(f"{stream_prefix}:*"))
        ids1 = [t.group_id for t in step_tasks(cfg, GAMES, 1, 1)]
        msgs = wait_for_groups(stop, cfg, issuer, col, Backoff("trainer-test", stop), dead, ids1, 1, 1)
        assert [m.group_id for m in msgs] == ids1
        assert [m.task.policy_version for m in msgs] == [0, 0]  # the buffered originals, issued at version 0
        deadline = time.monotonic() + 30
        while col.counts["dropped_duplicate"] < 2 and time.monotonic() < deadline:  # step 1 was issued again
            col.poll(1, 2, 100, 60_000)
        assert col.counts["dropped_duplicate"] == 2
        assert int(redis_client.get(f"{stream_prefix}:issued_step")) == 2
    finally:
        stop.set()
        worker.join(5)


def test_wait_for_groups_times_out_with_the_missing_groups(redis_client, stream_prefix):
    cfg = _cfg(stream_prefix, steps=1, k=0)
    cfg.run.step_timeout_s = 0.3
    col = Collector(_queue(redis_client, stream_prefix), 0, role="trainer-test")
    stop = threading.Event()
    with pytest.raises(TimeoutError, match="s00000-tw-"):
        wait_for_groups(stop, cfg, TaskIssuer(redis_client, cfg, GAMES, MAX_BYTES), col, Backoff("t", stop),
                        DeadLetters(redis_client, StreamNames(stream_prefix).dead), ["s00000-tw-01"], 0, 0)


def _wait_with_a_poisoned_group(redis_client, prefix: str, max_deliveries: int, kills: int, error: str):
    """wait_for_groups on step 0 while a rollout worker plays every task but dead-letters the first
    group's job `kills` times (reason "handler_error"); returns (messages, group ids, stream names)."""
    names = StreamNames(prefix)
    cfg = _cfg(prefix, steps=2, k=0)
    cfg.run.step_timeout_s = 20
    cfg.redis.max_deliveries = max_deliveries
    ids = [t.group_id for t in step_tasks(cfg, GAMES, 0, 0)]
    rollout = StreamQueue(redis_client, names.tasks, "rollout", "rollout-1", TaskGroup, "rollout-test", MAX_BYTES, names.dead)
    rollout.ensure_group()
    col = Collector(_queue(redis_client, prefix), 0, role="trainer-test")
    stop = threading.Event()
    died = []

    def worker():
        while not stop.is_set():
            for d in rollout.consume(100, count=4):
                if d.msg.group_id == ids[0] and len(died) < kills:
                    died.append(d.entry_id)
                    rollout.dead_letter(d.entry_id, d.raw, error, "handler_error")
                else:
                    rollout.produce_then_ack(names.rollouts, replace(make_rollout_group(G=2, turns=1), task=d.msg), d.entry_id)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        msgs = wait_for_groups(stop, cfg, TaskIssuer(redis_client, cfg, GAMES, MAX_BYTES), col, Backoff("t", stop),
                               DeadLetters(redis_client, names.dead), ids, 0, 0)
        return msgs, ids, names
    finally:
        stop.set()
        thread.join(5)


def test_a_dead_lettered_group_is_issued_again(redis_client, stream_prefix):
    # Dead-lettered twice (= max_deliveries): issued again each time, played on the third copy.
    msgs, ids, names = _wait_with_a_poisoned_group(redis_client, stream_prefix, 2, 2, "handler failed 3 times")
    assert [m.group_id for m in msgs] == ids
    assert int(redis_client.hget(names.counts, f"produced:{names.tasks}")) == len(ids) + 2  # two re-issues
    dead_ids = [f[b"group_id"].decode() for _, f in redis_client.xrange(names.dead)]
    assert dead_ids == [ids[0], ids[0]]


def test_a_group_dead_lettered_too_often_fails_the_step_with_the_reason(redis_client, stream_prefix):
    with pytest.raises(StepFailed, match=r"s00000-\S+ was dead-lettered 2 times; last reason handler_error: NaN"):
        _wait_with_a_poisoned_group(redis_client, stream_prefix, 1, 10**6, "NaN in the teacher's log-probs")


def test_backoff_retries_connection_errors_and_counts_them():
    stop = threading.Event()
    backoff = Backoff("trainer-test", stop, first_s=0.01, max_s=0.02)
    before = REGISTRY.get_sample_value("opsd_redis_reconnects_total", {"role": "trainer-test"}) or 0.0
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("connection refused")
        return "ok"

    assert backoff.retry(flaky) == "ok" and len(calls) == 3
    assert REGISTRY.get_sample_value("opsd_redis_reconnects_total", {"role": "trainer-test"}) - before == 2
    assert backoff.delay == 0.01  # reset after the success
    stop.set()
    calls.clear()
    assert backoff.retry(flaky) is None and len(calls) == 1  # stopping: one try, no waiting
    assert backoff.retry(lambda: 7) == 7


class _Backend:
    """The two members ensure_version uses: policy_version and load_weights."""

    def __init__(self, version: int = 0):
        self.policy_version = version

    def load_weights(self, path, version):
        from safetensors.numpy import load_file

        load_file(str(path))  # FileNotFoundError when missing, like HFBackend
        self.policy_version = version


def _publish(run_dir, version: int) -> None:
    from safetensors.numpy import save_file

    path = weights_path(run_dir, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full(2, version, np.float32)}, str(path))


def test_weight_files_kept_for_every_version_in_flight(tmp_path):
    for v in range(6):
        _publish(tmp_path, v)
    assert prune_versions(tmp_path, newest=4, keep=3) == [0, 1]  # k = 1: versions 2..4; 5 (a dead run's) stays
    assert published_versions(tmp_path) == [2, 3, 4, 5]

    backend = _Backend(version=4)
    assert ensure_version(backend, tmp_path, 4) is False
    assert ensure_version(backend, tmp_path, 2) is True and backend.policy_version == 2
    with pytest.raises(StalePolicyError, match="version 1"):
        ensure_version(backend, tmp_path, 1)
    with pytest.raises(StalePolicyError, match="version 0"):
        ensure_version(backend, tmp_path, 0)
    with pytest.raises(FileNotFoundError, match="not published"):
        ensure_version(backend, tmp_path, 6)
    assert backend.policy_version == 2


def test_version_zero_loads_from_its_file_after_a_newer_one(tmp_path):
    """k-step-off: a worker that loaded v1 gets step 1's task, issued with v0 before v1 existed."""
    _publish(tmp_path, 0)
    _publish(tmp_path, 1)
    backend = _Backend(version=0)
    assert ensure_version(backend, tmp_path, 1) is True
    assert ensure_version(backend, tmp_path, 0) is True and backend.policy_version == 0


def _step0_issued(client, prefix: str, step_timeout_s: float):
    """A one-step run (k = 0) whose step 0 is issued: (stream names, config, issuer, step 0's group ids)."""
    cfg = _cfg(prefix, steps=1, k=0)
    cfg.run.step_timeout_s = step_timeout_s
    issuer = TaskIssuer(client, cfg, GAMES, MAX_BYTES)
    issuer.top_up(0, 0)
    return StreamNames(prefix), cfg, issuer, [t.group_id for t in step_tasks(cfg, GAMES, 0, 0)]


def test_a_job_deleted_from_its_stream_while_pending_is_issued_again(redis_client, stream_prefix):
    """An operator's XDEL (or a producer's MAXLEN) removes a task entry a worker holds; the worker dies. The next
    worker's reclaim finds the entry gone: it is dead-lettered (reason "deleted", counted, logged), not dropped
    silently, and the trainer issues the step's missing group again instead of waiting until the step times out
    (an hour here: only the dead letter can bring the group back while the test runs)."""
    names, cfg, issuer, ids = _step0_issued(redis_client, stream_prefix, step_timeout_s=3600)

    def worker_queue(consumer):
        q = StreamQueue(redis_client, names.tasks, "rollout", consumer, TaskGroup, "rollout-test", MAX_BYTES, names.dead)
        q.ensure_group()
        return q

    dead = DeadLetters(redis_client, names.dead)  # the trainer, running before the job was lost
    dying = worker_queue("rollout-dies")
    held = dying.consume(100, count=4)
    assert [d.msg.group_id for d in held] == ids
    lost = next(d for d in held if d.msg.group_id == ids[0])
    redis_client.xdel(names.tasks, lost.entry_id)  # the operator's XDEL, while the worker holds the job
    deleted0 = REGISTRY.get_sample_value("opsd_messages_rejected_total",
                                         {"role": "rollout-test", "stream": names.tasks, "reason": "deleted"}) or 0.0
    healthy = worker_queue("rollout-2")
    (kept,) = healthy.reclaim(0, count=10)  # the dying worker's jobs: one still there, one deleted
    assert kept.msg.group_id == ids[1]
    assert REGISTRY.get_sample_value("opsd_messages_rejected_total", {"role": "rollout-test", "stream": names.tasks,
                                                                     "reason": "deleted"}) == deleted0 + 1
    ((_, letter),) = redis_client.xrange(names.dead)
    assert letter[b"reason"] == b"deleted" and letter[b"entry_id"].decode() == lost.entry_id and letter[b"group_id"] == b""
    assert redis_client.xpending(names.tasks, "rollout")["pending"] == 1  # the deleted id is no longer pending
    healthy.produce_then_ack(names.rollouts, replace(make_rollout_group(G=2, turns=1), task=kept.msg), kept.entry_id)

    col = Collector(_queue(redis_client, stream_prefix), 0, role="trainer-test")
    stop = threading.Event()
    worker = threading.Thread(target=_fake_rollout, args=(redis_client, stream_prefix, stop), daemon=True)
    worker.start()
    hang_guard = threading.Timer(120, stop.set)  # were the group not issued again: None after 120 s, not an hour
    hang_guard.start()
    try:
        msgs = wait_for_groups(stop, cfg, issuer, col, Backoff("t", stop), dead, ids, 0, 0)
        assert msgs is not None and [m.group_id for m in msgs] == ids
        assert int(redis_client.hget(names.counts, f"produced:{names.tasks}")) == 3  # the lost one issued again
    finally:
        hang_guard.cancel()
        stop.set()
        worker.join(5)


def test_a_group_lost_without_a_trace_is_issued_again_once_at_the_step_timeout(redis_client, stream_prefix):
    """A job can vanish in a way no worker reports (e.g. Redis 7 dropping a deleted entry from the pending list
    when a retried XAUTOCLAIM's first reply was lost): at step_timeout_s the missing groups are issued again once,
    and the step completes instead of failing; a restarted trainer does not count deletions from before it."""
    names, cfg, issuer, ids = _step0_issued(redis_client, stream_prefix, step_timeout_s=1.0)
    first = redis_client.xrange(names.tasks)[0][0]
    redis_client.xdel(names.tasks, first)  # gone before any worker read it: nobody can report it
    redis_client.xadd(names.dead, {"reason": "deleted", "group_id": "", "entry_id": "0-1"})  # an old deletion
    time.sleep(0.01)
    dead = DeadLetters(redis_client, names.dead)
    dead.poll()
    assert dead.lost == 0  # from before this trainer started
    col = Collector(_queue(redis_client, stream_prefix), 0, role="trainer-test")
    stop = threading.Event()
    worker = threading.Thread(target=_fake_rollout, args=(redis_client, stream_prefix, stop), daemon=True)
    worker.start()
    try:
        msgs = wait_for_groups(stop, cfg, issuer, col, Backoff("t", stop), dead, ids, 0, 0)
        assert [m.group_id for m in msgs] == ids
        assert int(redis_client.hget(names.counts, f"produced:{names.tasks}")) == 3
    finally:
        stop.set()
        worker.join(5)

