"""Nothing lost, nothing counted twice: backpressure, output counting, stale jobs, Redis restarts, supervision.

Against real redis-server processes (the session server, or a private
LocalRedis where a test restarts it); no fakeredis.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from opsd.config import RunConfig
from opsd.queue import DEAD_MAXLEN, StreamNames, StreamQueue, produce_message
from opsd.redis_server import SOCKET_TIMEOUT_MARGIN_S, LocalRedis, connect
from opsd.service import RoleProcess, consume_forever
from opsd.types import RolloutGroup, TaskGroup
from opsd.weights import StalePolicyError
from opsd.wire import decode
from tests.factories import make_rollout_group, make_task

pytestmark = pytest.mark.redis
LIMIT = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def task_queue(client, names: StreamNames, consumer: str = "rollout-0", **kw) -> StreamQueue:
    q = StreamQueue(client, names.tasks, "rollout", consumer, TaskGroup, role="rollout", max_bytes=LIMIT,
                    dead_stream=names.dead, counts_key=names.counts, **kw)
    q.ensure_group()
    return q


def rollout_reader(client, names: StreamNames) -> StreamQueue:
    q = StreamQueue(client, names.rollouts, "teacher", "teacher-0", RolloutGroup, role="teacher", max_bytes=LIMIT,
                    dead_stream=names.dead)
    q.ensure_group()
    return q


def play(task: TaskGroup) -> RolloutGroup:
    """A stand-in rollout: the group of the task's seed (its group_id is the task's)."""
    return make_rollout_group(G=task.group_size, turns=1, seed=int(task.task_id[3:]))


def role_process(tmp_path: Path, prefix: str, **redis_section) -> RoleProcess:
    cfg = RunConfig.model_validate({"redis": {"stream_prefix": prefix, **redis_section}})
    return RoleProcess(role="rollout", cfg=cfg, run_dir=tmp_path)


def wait_until(cond, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------- backpressure


def test_wait_for_room_waits_for_the_reader_and_loses_nothing(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    producer = task_queue(redis_client, names)
    stop = threading.Event()
    assert producer.stream_lag(names.rollouts, "teacher") == 0  # no stream yet
    assert producer.wait_for_room(names.rollouts, "teacher", max_lag=3, stop=stop) is True
    ids = [producer.produce_to(names.rollouts, make_rollout_group(G=2, turns=1, seed=i)) for i in range(5)]
    assert producer.stream_lag(names.rollouts, "teacher") == 5  # no reader group yet: everything is undelivered

    before = metric("opsd_backpressure_seconds_total", role="rollout", stream=names.rollouts)
    result: dict = {}
    poll_s = 0.05

    def wait():
        t0 = time.monotonic()
        result["room"] = producer.wait_for_room(names.rollouts, "teacher", max_lag=3, stop=stop, poll_s=poll_s)
        result["wall"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.4)
    assert waiter.is_alive()  # 5 > 3: the producer waits
    reader = rollout_reader(redis_client, names)
    got = reader.consume(block_ms=100, count=1)
    time.sleep(0.2)
    assert waiter.is_alive()  # 4 undelivered: still over the bound
    got += reader.consume(block_ms=100, count=1)
    waiter.join(timeout=5)
    assert not waiter.is_alive() and result["room"] is True  # 3 undelivered: room again
    # The seconds waited are counted: at least one whole poll, at most the call's own duration (~0.6 s).
    # Only the sleeps between polls count, not the Redis calls between them, which a loaded machine
    # makes slow: a fixed share of the ~0.6 s (it was >= 0.5 s) is not guaranteed.
    waited = metric("opsd_backpressure_seconds_total", role="rollout", stream=names.rollouts) - before
    assert poll_s <= waited <= result["wall"]

    got += reader.consume(block_ms=100, count=10)
    assert [d.entry_id for d in got] == ids  # every entry, in order, none trimmed
    assert producer.stream_lag(names.rollouts, "teacher") == 0

    # a stop request ends the wait at once: after one poll, not one poll_s later (an hour here)
    for i in range(5):
        producer.produce_to(names.rollouts, make_rollout_group(G=2, turns=1, seed=i))
    stop.set()
    polls: list[bool] = []
    stopped = threading.Thread(target=lambda: polls.append(producer.wait_for_room(
        names.rollouts, "teacher", max_lag=3, stop=stop, poll_s=3600, on_poll=lambda: polls.append(True))), daemon=True)
    stopped.start()
    stopped.join(30)  # a hang guard only
    assert not stopped.is_alive() and polls == [True, False]  # one poll, then False


def test_work_streams_are_never_trimmed(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    n = DEAD_MAXLEN + 200  # past the only MAXLEN there is (the dead-letter stream's)
    q = task_queue(redis_client, names)
    for i in range(n):
        produce_message(redis_client, names.tasks, make_task(seed=i % 50, step=i), LIMIT)
    assert redis_client.xlen(names.tasks) == n
    reader = rollout_reader(redis_client, names)
    got = q.consume(block_ms=100, count=n)
    for d in got:
        assert q.produce_then_ack(names.rollouts, make_rollout_group(G=2, turns=1, seed=d.msg.step % 7), d.entry_id)
    assert len(got) == n and redis_client.xlen(names.rollouts) == n
    assert redis_client.xlen(names.tasks) == 0  # only acknowledged entries left their stream
    assert len(reader.consume(block_ms=100, count=2 * n)) == n
    assert redis_client.hget(names.counts, f"produced:{names.rollouts}") == str(n).encode()


def test_consume_forever_stops_taking_jobs_while_its_output_is_backed_up(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    producer = task_queue(redis_client, names, "trainer-0")
    tasks = [make_task(group_size=2, seed=i) for i in range(8)]
    for t in tasks:
        producer.produce_to(names.tasks, t)
    proc = role_process(tmp_path, stream_prefix, max_stream_lag=2, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1")
    loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, play, 600_000, 200),
                            kwargs={"out_group": "teacher"})
    loop.start()
    try:
        wait_until(lambda: redis_client.xlen(names.rollouts) == 3, what="3 outputs")
        time.sleep(0.6)
        assert redis_client.xlen(names.rollouts) == 3  # lag 3 > 2: it takes no further job
        assert redis_client.xlen(names.tasks) == 5  # the rest wait in their stream, none lost
        reader = rollout_reader(redis_client, names)
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < len(tasks) and time.monotonic() < deadline:
            for d in reader.consume(block_ms=100, count=1):  # a slow reader: one at a time
                seen.append(d.msg.group_id)
                assert reader.ack(d.entry_id)
                assert worker.stream_lag(names.rollouts, "teacher") <= 3  # the bound holds throughout
    finally:
        proc.stop.set()
        loop.join(timeout=10)
    assert not loop.is_alive()
    assert sorted(seen) == sorted(t.group_id for t in tasks)  # each job's output exactly once
    assert redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"8"
    assert redis_client.xlen(names.tasks) == 0 and worker.depth() == (0, 0)
    assert metric("opsd_backpressure_seconds_total", role="rollout", stream=names.rollouts) > 0


def test_consume_forever_holds_several_jobs_and_acks_each_when_its_own_output_is_written(
        redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    producer = task_queue(redis_client, names, "trainer-0")
    tasks = [make_task(group_size=2, seed=i) for i in range(7)]
    for t in tasks:
        producer.produce_to(names.tasks, t)
    proc = role_process(tmp_path, stream_prefix, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1")
    seen_in_flight, lock = [], threading.Lock()

    def three_held() -> None:  # run once all three are in the handler, before any may finish
        # the loop sets the gauge just after it hands a job over, so the third job can start before it is counted
        wait_until(lambda: metric("opsd_groups_in_flight", role="rollout") == 3.0, timeout_s=30,
                   what="the in-flight gauge at three")
        seen_in_flight.append(metric("opsd_groups_in_flight", role="rollout"))

    together = threading.Barrier(3, action=three_held, timeout=60)  # passes only with three jobs in the handler at once
    fail_once = {tasks[1].group_id}
    first_three = {t.group_id for t in tasks[:3]}

    def handle(task: TaskGroup) -> RolloutGroup:
        with lock:
            seen_in_flight.append(metric("opsd_groups_in_flight", role="rollout"))
            meet = task.group_id in first_three
            first_three.discard(task.group_id)  # a retried job does not wait again
        if meet:
            together.wait()
        if task.group_id in fail_once:  # this job fails: it stays pending, the others are acked meanwhile
            fail_once.clear()
            raise RuntimeError("one bad job")
        return play(task)

    loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, handle, 1000, 200),
                            kwargs={"max_in_flight": 3})
    loop.start()
    try:
        wait_until(lambda: redis_client.xlen(names.rollouts) == 7, timeout_s=60, what="7 outputs (one after a retry)")
    finally:
        proc.stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert max(seen_in_flight) == 3.0  # the gauge showed three groups held
    assert redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"7"  # each output once
    assert worker.depth() == (0, 0) and metric("opsd_groups_in_flight", role="rollout") == 0.0


def test_a_job_thread_that_must_end_the_process_ends_consume_forever(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    task_queue(redis_client, names, "trainer-0").produce_to(names.tasks, make_task(group_size=2, seed=1))
    proc = role_process(tmp_path, stream_prefix, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1")

    def handle(task: TaskGroup) -> RolloutGroup:
        raise SystemExit(3)  # e.g. the teacher's refused embedder token

    with pytest.raises(SystemExit) as exit_:
        consume_forever(proc, worker, names.rollouts, handle, 600_000, 200, max_in_flight=2)
    assert exit_.value.code == 3 and proc.stop.is_set()
    assert worker.depth() == (0, 1)  # the job stays pending for the next worker


def test_an_error_escaping_a_job_thread_ends_consume_forever_as_with_one_job(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    task_queue(redis_client, names, "trainer-0").produce_to(names.tasks, make_task(group_size=2, seed=1))
    proc = role_process(tmp_path, stream_prefix, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1")

    def handle(task: TaskGroup) -> RolloutGroup:
        raise StalePolicyError("version 3 is gone")

    def dead_letter(*args, **kwargs):
        raise redis.AuthenticationError("WRONGPASS (test)")  # not an outage: retrying cannot fix it

    worker.dead_letter = dead_letter
    with pytest.raises(redis.AuthenticationError):
        consume_forever(proc, worker, names.rollouts, handle, 600_000, 200, max_in_flight=3)
    assert proc.stop.is_set()


def test_a_job_re_claimed_by_its_own_worker_is_not_started_twice(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    task = make_task(group_size=2, seed=4)
    task_queue(redis_client, names, "trainer-0").produce_to(names.tasks, task)
    proc = role_process(tmp_path, stream_prefix, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1")
    worker.keep_alive = lambda ids: None  # heartbeats lost (a long Redis outage): the entry goes idle
    calls, started = [], threading.Event()

    def handle(t: TaskGroup) -> RolloutGroup:
        calls.append(t.group_id)
        started.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # held until the loop has re-claimed (and skipped) its own entry
            pending = redis_client.xpending_range(names.tasks, "rollout", "-", "+", 1)
            if pending and pending[0]["times_delivered"] >= 2:
                break
            time.sleep(0.05)
        return play(t)

    loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, handle, 300, 200),
                            kwargs={"max_in_flight": 2})
    loop.start()
    try:
        wait_until(lambda: redis_client.xlen(names.rollouts) == 1, timeout_s=60, what="the one output")
    finally:
        proc.stop.set()
        loop.join(timeout=30)
    assert calls == [task.group_id]  # re-claimed (delivered twice) but handled once
    assert redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"1"


def connect_like(client: redis.Redis) -> redis.Redis:
    """A second client on the same server (a worker thread must not share the test's connections' state)."""
    kw = client.connection_pool.connection_kwargs
    return connect(f"redis://:{kw['password']}@{kw['host']}:{kw['port']}/0", block_ms=2000)


# ---------------------------------------------------------------- counting outputs once


def test_output_is_counted_once_when_the_reply_is_lost_and_the_call_retried(redis_client, stream_prefix, monkeypatch):
    names = StreamNames(stream_prefix)
    q = task_queue(redis_client, names)
    q.produce_to(names.tasks, make_task(seed=1))
    (d,) = q.consume(block_ms=100)

    # The server runs the script, then the connection drops before the reply is read:
    # redis-py's retry sends the same script again.
    real_read = redis.connection.AbstractConnection.read_response
    lost = {"armed": True, "n": 0}

    def read_then_lose(conn, *args, **kwargs):
        reply = real_read(conn, *args, **kwargs)
        if lost["armed"]:
            lost.update(armed=False, n=lost["n"] + 1)
            conn.disconnect()
            raise redis.ConnectionError("reply lost (test)")
        return reply

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_then_lose)
    assert q.produce_then_ack(names.rollouts, play(d.msg), d.entry_id) is None  # the retry found it done
    monkeypatch.undo()
    assert lost["n"] == 1
    assert redis_client.xlen(names.rollouts) == 1
    assert redis_client.hgetall(names.counts) == {f"produced:{names.rollouts}".encode(): b"1"}
    assert q.depth() == (0, 0)
    # and an explicit second attempt (consume_forever's own retry) changes nothing either
    assert q.produce_then_ack(names.rollouts, play(d.msg), d.entry_id) is None
    assert redis_client.xlen(names.rollouts) == 1 and redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"1"


def test_a_counts_key_of_the_wrong_type_writes_nothing(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    q = task_queue(redis_client, names)
    q.produce_to(names.tasks, make_task(seed=2))
    (d,) = q.consume(block_ms=100)
    redis_client.set(names.counts, "oops")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE counts key"):
        q.produce_then_ack(names.rollouts, play(d.msg), d.entry_id)
    assert redis_client.xlen(names.rollouts) == 0 and q.depth() == (0, 1)  # input still pending, no output
    redis_client.delete(names.counts)
    assert q.produce_then_ack(names.rollouts, play(d.msg), d.entry_id) is not None
    assert redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"1"


# ---------------------------------------------------------------- stale jobs


def test_stale_policy_job_goes_straight_to_the_dead_letter_stream(redis_client, stream_prefix, tmp_path):
    names = StreamNames(stream_prefix)
    producer = task_queue(redis_client, names, "trainer-0")
    stale = producer.produce_to(names.tasks, make_task(seed=3, policy_version=1))
    fresh = producer.produce_to(names.tasks, make_task(seed=4, policy_version=5))
    calls: list[str] = []

    def handle(task: TaskGroup) -> RolloutGroup:
        calls.append(task.group_id)
        if task.policy_version < 5:
            raise StalePolicyError(f"policy version {task.policy_version} was deleted")
        return play(task)

    proc = role_process(tmp_path, stream_prefix, block_ms=200)
    worker = task_queue(connect_like(redis_client), names, "rollout-1", max_deliveries=3)
    before = metric("opsd_messages_rejected_total", role="rollout", stream=names.tasks, reason="stale_policy_version")
    # reclaim_idle_ms=200: a job left pending would be retried within the test; a stale one must not be
    loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, handle, 200, 200),
                            kwargs={"out_group": "teacher"})
    loop.start()
    try:
        wait_until(lambda: redis_client.xlen(names.rollouts) == 1 and redis_client.xlen(names.dead) == 1, what="both jobs")
        time.sleep(0.8)
    finally:
        proc.stop.set()
        loop.join(timeout=10)
    assert calls == [make_task(seed=3).group_id, make_task(seed=4).group_id]  # the stale job ran once, no retry
    ((_, dead),) = redis_client.xrange(names.dead)
    assert dead[b"reason"] == b"stale_policy_version" and dead[b"entry_id"].decode() == stale
    assert b"policy version 1 was deleted" in dead[b"error"]
    assert decode(dead[b"data"], TaskGroup, LIMIT) == make_task(seed=3, policy_version=1)  # the job is kept whole
    assert metric("opsd_messages_rejected_total", role="rollout", stream=names.tasks, reason="stale_policy_version") == before + 1
    assert worker.depth() == (0, 0) and redis_client.xlen(names.tasks) == 0
    assert fresh and redis_client.hget(names.counts, f"produced:{names.rollouts}") == b"1"  # dead letters are not outputs


def test_dead_letter_twice_writes_one_dead_letter(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    q = task_queue(redis_client, names)
    q.produce_to(names.tasks, make_task(seed=5))
    (d,) = q.consume(block_ms=100)
    assert q.dead_letter(d.entry_id, d.raw, "gone", "stale_policy_version") is True
    assert q.dead_letter(d.entry_id, d.raw, "gone", "stale_policy_version") is False  # a retry after a lost reply
    assert redis_client.xlen(names.dead) == 1 and q.depth() == (0, 0)


# ---------------------------------------------------------------- Redis persistence and restarts


def test_append_only_redis_keeps_pending_and_acked_entries_across_restarts(tmp_path):
    data = tmp_path / "redis"
    names = StreamNames("aof")
    server = LocalRedis(tmp_path / "redis.log", data_dir=data, appendonly=True).start()
    try:
        url = server.url
        client = connect(url, block_ms=1000)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        q = task_queue(client, names, "rollout-a")
        acked = q.produce_to(names.tasks, make_task(seed=1))
        pending = q.produce_to(names.tasks, make_task(seed=2))
        assert [d.entry_id for d in q.consume(block_ms=100, count=2)] == [acked, pending]
        assert q.ack(acked)

        pid = server.process.pid
        server.restart()
        assert server.process.pid != pid and server.url == url  # same port and password: clients just reconnect
        assert [g["name"] for g in client.xinfo_groups(names.tasks)] == [b"rollout"]  # the group survived
        (info,) = client.xpending_range(names.tasks, "rollout", "-", "+", 10)
        assert info["message_id"].decode() == pending and info["consumer"] == b"rollout-a"
        assert client.xlen(names.tasks) == 1  # the acknowledged (and deleted) entry stays gone
        other = task_queue(client, names, "rollout-b")
        (d,) = other.reclaim(min_idle_ms=0)
        assert d.entry_id == pending and d.deliveries == 2 and d.msg == make_task(seed=2)
        assert other.produce_then_ack(names.rollouts, play(d.msg), d.entry_id)
        client.close()
    finally:
        server.stop()
    assert data.is_dir() and any(data.iterdir())  # a given data dir is kept

    # `opsd run --resume`: a new server (new port, new password) on the same dir has it all
    with LocalRedis(tmp_path / "redis2.log", data_dir=data, appendonly=True) as again:
        client = connect(again.url, block_ms=1000)
        assert client.xlen(names.tasks) == 0 and client.xlen(names.rollouts) == 1
        assert client.hget(names.counts, f"produced:{names.rollouts}") == b"1"
        assert client.xpending(names.tasks, "rollout")["pending"] == 0
        client.close()


def test_consume_forever_keeps_its_output_across_a_redis_restart(tmp_path):
    names = StreamNames("restart")
    server = LocalRedis(tmp_path / "redis.log", data_dir=tmp_path / "redis", appendonly=True).start()
    proc = role_process(tmp_path, "restart", block_ms=200)
    entered, go = threading.Event(), threading.Event()

    def handle(task: TaskGroup) -> RolloutGroup:
        entered.set()
        go.wait(30)
        return play(task)

    loop = None
    try:
        client = connect(server.url, block_ms=1000)
        worker = task_queue(connect(server.url, block_ms=200), names, "rollout-1")
        worker.produce_to(names.tasks, make_task(seed=1))
        before = metric("opsd_redis_reconnects_total", role="rollout")
        loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, handle, 600_000, 200),
                                kwargs={"out_group": "teacher"})
        loop.start()
        assert entered.wait(20)
        # The job finishes while Redis is down for longer than the client's own retries (~1.5 s).
        threading.Timer(0.3, go.set).start()
        server.restart(down_s=3.0)  # from this (the starting) thread: the parent-death signal follows it
        wait_until(lambda: client.xlen(names.rollouts) == 1, what="the output written after the restart")
        assert metric("opsd_redis_reconnects_total", role="rollout") >= before + 1
        assert worker.depth() == (0, 0) and client.xlen(names.tasks) == 0

        server.restart(down_s=2.5)  # while the loop sits in a blocking read
        worker.produce_to(names.tasks, make_task(seed=2))
        wait_until(lambda: client.xlen(names.rollouts) == 2, what="a job taken after the second restart")
        assert client.hget(names.counts, f"produced:{names.rollouts}") == b"2"
        got = [decode(f[b"data"], RolloutGroup, LIMIT).group_id for _, f in client.xrange(names.rollouts)]
        assert got == [make_task(seed=1).group_id, make_task(seed=2).group_id]
        assert loop.is_alive()
        client.close()
    finally:
        go.set()
        proc.stop.set()
        if loop is not None:
            loop.join(timeout=15)
        server.stop()
    assert not loop.is_alive()


def test_without_persistence_the_temp_data_dir_goes_away(tmp_path):
    server = LocalRedis(tmp_path / "redis.log").start()
    temp = Path(server._dir)
    client = connect(server.url, block_ms=100)
    client.set("k", "v")
    server.restart()
    assert client.get("k") is None  # no persistence: back empty
    server.stop()
    assert not temp.exists()


# ---------------------------------------------------------------- connecting safely


def test_connect_refuses_a_url_without_password(monkeypatch):
    monkeypatch.delenv("OPSD_REDIS_ALLOW_NO_AUTH", raising=False)
    for url in ("redis://127.0.0.1:6379/0", "redis://user@host:6379/0", "unix:///tmp/redis.sock"):
        with pytest.raises(ValueError, match="no password.*OPSD_REDIS_ALLOW_NO_AUTH=1"):
            connect(url, block_ms=100)
    for url in ("redis://:pw@host:6379/0", "redis://user:pw@host/0", "unix:///tmp/redis.sock?password=pw"):
        connect(url, block_ms=100).close()  # does not contact the server
    monkeypatch.setenv("OPSD_REDIS_ALLOW_NO_AUTH", "1")
    connect("redis://127.0.0.1:6379/0", block_ms=100).close()


@pytest.mark.parametrize("query", ["socket_timeout=1", "socket_timeout=100000", "socket_connect_timeout=900",
                                   "health_check_interval=0", "retry_on_timeout=no", "retry=x", "protocol=3"])
def test_connect_refuses_url_options_that_override_its_own(query):
    """redis-py lets a URL's query win over connect()'s keyword options: ?socket_timeout=1 would break every
    blocking read (a ValueError nothing catches), a huge one hang a consumer on a dead server. Refused, one line."""
    with pytest.raises(ValueError, match=f"the Redis URL sets {query.split('=')[0]}: opsd sets these itself"):
        connect(f"redis://:pw@host:6379/0?{query}", block_ms=100)
    connect("redis://:pw@host:6379/0?client_name=opsd", block_ms=100).close()  # options opsd leaves alone pass


def test_run_refuses_a_redis_url_overriding_the_socket_timeout(redis_url, tmp_path, monkeypatch):
    """Against a live server (the pre-flight PING succeeds with ?socket_timeout=1): refused before any role starts."""
    from opsd.supervisor import Services

    started = []
    monkeypatch.setattr("opsd.cli.resolve_models", lambda cfg: {})
    monkeypatch.setattr("opsd.cli.prepare", lambda cfg, models: None)
    monkeypatch.setattr(Services, "start", lambda self, role: started.append(role))
    monkeypatch.setenv("REDIS_URL", redis_url + ("&" if "?" in redis_url else "?") + "socket_timeout=1")
    config = tmp_path / "c.yaml"
    config.write_text(f"run:\n  steps: 1\n  output_dir: {tmp_path}\n")
    result = _cli(str(config))
    assert result.exit_code == 2 and "socket_timeout" in result.output and started == [], result.output
    assert "Traceback" not in result.output


def test_a_timed_out_command_leaves_no_reply_for_the_next_one(redis_url, stream_prefix):
    client = connect(redis_url, block_ms=0)
    other = connect(redis_url, block_ms=0)
    try:
        for block_ms in (0, 2000, 60_000):  # the socket always waits longer than a blocking read asks for
            timeout = connect(redis_url, block_ms).connection_pool.connection_kwargs["socket_timeout"]
            assert timeout >= block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S
        kw = client.connection_pool.connection_kwargs
        kw["socket_timeout"] = 0.2  # a server that stalls past the socket timeout
        name = f"{stream_prefix}-abandoned"
        kw["client_name"] = name  # CLIENT SETNAME on every connection of `client`: findable in CLIENT LIST
        key = f"{stream_prefix}:list"
        with pytest.raises(redis.TimeoutError):
            client.blpop([key], timeout=1)  # the server answers after 1 s, the socket gave up after 0.2 s
        # The server must have dropped the abandoned (closed) connections before the value arrives, or a
        # BLPOP still blocked on one would take it: wait until CLIENT LIST shows none of them.
        deadline = time.monotonic() + 30
        while any(c.get("name") == name for c in other.client_list()):
            assert time.monotonic() < deadline, "the server still lists a connection that timed out 30 s ago"
            time.sleep(0.02)
        other.rpush(key, "value")
        time.sleep(1.2)  # a stale BLPOP reply, had one been left on a connection, has now arrived
        assert client.echo("mine") == b"mine"  # this command's own reply, not the old BLPOP's
        assert client.lrange(key, 0, -1) == [b"value"]  # and no abandoned BLPOP took the value
    finally:
        client.close()
        other.close()


def test_no_module_uses_redis_asyncio():
    # A cancelled asyncio command can leave its reply on a pooled connection for the next command
    # to read: only sync clients are used, and this keeps it so.
    offenders = []
    for path in sorted((ROOT / "opsd").rglob("*.py")) + sorted((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "redis.asyncio" or n.startswith("redis.asyncio.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
    assert len(list((ROOT / "services").rglob("*.py"))) > 5  # the scan did look at the services


# ---------------------------------------------------------------- the CLI's supervisor and resume


def test_supervisor_restarts_a_dead_role_then_gives_up(tmp_path):
    from opsd.supervisor import Services

    (tmp_path / "logs").mkdir()
    crash = "import os, sys; print('boom token=' + os.environ['OPSD_API_TOKEN'], flush=True); sys.exit(1)"
    sleep = "import time; time.sleep(60)"
    services = Services(tmp_path, tmp_path / "config.yaml", "redis://:pw@127.0.0.1:1/0", "tok123", max_restarts=2,
                        command=lambda role: [sys.executable, "-c", crash if role == "rollout" else sleep])
    try:
        services.start("rollout")
        services.start("trainer")
        messages: list[str] = []
        with pytest.raises(RuntimeError) as failure:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                messages += services.supervise()
                time.sleep(0.05)
        assert messages == ["rollout exited with code 1; restarting it (1/2)", "rollout exited with code 1; restarting it (2/2)"]
        assert "rollout exited with code 1 after 2 restart(s)" in str(failure.value)
        assert "boom token=tok123" in str(failure.value)  # the log tail, and the token reached the role
        assert services.restarts == {"rollout": 2, "trainer": 0}
        assert services.procs["trainer"].poll() is None  # a live role is left alone
        log = (tmp_path / "logs" / "rollout.log").read_text()
        assert log.count("boom token=tok123") == 3 and log.count("opsd run: rollout exited with code 1") == 2
        assert len((tmp_path / "logs" / "supervisor.log").read_text().splitlines()) == 2
    finally:
        services.stop(timeout_s=5)
    assert all(p.poll() is not None for p in services.procs.values())


def test_supervisor_does_not_restart_a_role_that_exits_fatal(tmp_path):
    from opsd.supervisor import Services
    from opsd.service import FATAL_EXIT

    (tmp_path / "logs").mkdir()
    fatal = f"import sys; print('CheckpointError: differing fields: trainer.lr', flush=True); sys.exit({FATAL_EXIT})"
    services = Services(tmp_path, tmp_path / "config.yaml", "redis://:pw@127.0.0.1:1/0", "tok123", max_restarts=5,
                        command=lambda role: [sys.executable, "-c", fatal])
    try:
        services.start("trainer")
        with pytest.raises(RuntimeError, match="a restart cannot fix") as failure:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                assert services.supervise() == []
                time.sleep(0.05)
        assert "differing fields: trainer.lr" in str(failure.value)
        assert services.restarts == {"trainer": 0}
    finally:
        services.stop(timeout_s=5)


def test_a_second_run_on_a_run_dir_in_use_is_refused(tmp_path):
    from opsd.cli import lock_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig.model_validate({"run": {"steps": 2}, "redis": {"stream_prefix": "opsd:run"}}).dump(run_dir / "config.yaml")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from opsd.cli import lock_run_dir; "
                               f"f = lock_run_dir(__import__('pathlib').Path({str(run_dir)!r})); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = _cli("--resume", str(run_dir))
        assert result.exit_code == 2 and f"in use by another `opsd run` (pid {holder.pid})" in " ".join(result.output.split())
        assert (run_dir / "config.yaml").exists() and not (run_dir / "logs").exists()  # nothing touched
    finally:
        holder.kill()
        holder.wait()
    lock = lock_run_dir(run_dir)  # free again once its holder is gone
    lock.close()


def test_run_refuses_a_redis_url_without_password_before_starting_roles(tmp_path, monkeypatch):
    from opsd.supervisor import Services

    started = []
    monkeypatch.setattr("opsd.cli.resolve_models", lambda cfg: {})
    monkeypatch.setattr("opsd.cli.prepare", lambda cfg, models: None)
    monkeypatch.setattr(Services, "start", lambda self, role: started.append(role))
    monkeypatch.delenv("OPSD_REDIS_ALLOW_NO_AUTH", raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6399/0")
    config = tmp_path / "c.yaml"
    config.write_text(f"run:\n  steps: 1\n  output_dir: {tmp_path}\n")
    result = _cli(str(config))
    assert result.exit_code == 2 and "password" in result.output and started == [], result.output
    assert "Traceback" not in result.output


def _cli(*args: str):
    from typer.testing import CliRunner

    from opsd.cli import app

    return CliRunner().invoke(app, ["run", *args])


def test_resume_of_a_finished_run_says_so_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run-1"
    (run_dir / "checkpoint").mkdir(parents=True)
    RunConfig.model_validate({"run": {"steps": 2}, "redis": {"stream_prefix": "opsd:run-1"}}).dump(run_dir / "config.yaml")
    (run_dir / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 2, "policy_version": 2}))
    (run_dir / "DONE").write_text("{}")
    result = _cli("--resume", str(run_dir))
    assert result.exit_code == 0 and "already finished: 2 steps" in result.output, result.output
    assert (run_dir / "DONE").exists() and not (run_dir / "logs").exists()  # nothing started, nothing removed


def test_a_finished_run_without_optimizer_state_is_not_resumed_for_more_steps(tmp_path):
    """trainer.keep_optimizer_state false: `--resume --steps N` is refused up front, and the run stays DONE."""
    run_dir = tmp_path / "run-1"
    (run_dir / "checkpoint").mkdir(parents=True)
    RunConfig.model_validate({"run": {"steps": 2}, "redis": {"stream_prefix": "opsd:run-1"}}).dump(run_dir / "config.yaml")
    (run_dir / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 2, "policy_version": 2}))
    (run_dir / "checkpoint" / "optimizer.dropped").write_text("")
    (run_dir / "DONE").write_text("{}")
    result = _cli("--resume", str(run_dir), "--steps", "4")
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "keep_optimizer_state false" in out and "model.name:" in out, result.output
    assert (run_dir / "DONE").exists() and not (run_dir / "logs").exists()


@pytest.mark.parametrize("args, expect", [
    ([], "give exactly one of CONFIG and --resume RUN_DIR"),
    (["CONFIG", "--resume", "RUN"], "give exactly one of CONFIG and --resume RUN_DIR"),
    (["--resume", "RUN", "--output-dir", "x"], "--output-dir cannot be used with --resume"),
    (["--resume", "EMPTY"], "is not a run directory: it has no config.yaml"),
])
def test_run_argument_errors_are_short(tmp_path, args, expect):
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  steps: 1\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("run:\n  steps: 1\n")
    (tmp_path / "empty").mkdir()
    subst = {"CONFIG": str(config), "RUN": str(tmp_path / "run"), "EMPTY": str(tmp_path / "empty")}
    result = _cli(*[subst.get(a, a) for a in args])
    assert result.exit_code == 2 and expect in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


_DUMMY_ROLE = """
import json, os, sys, time
from pathlib import Path
import redis, yaml
role, cfg, run_dir = sys.argv[1], yaml.safe_load(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
(run_dir / f"{role}.token").write_text(os.environ["OPSD_API_TOKEN"])
if role == "rollout":
    if not (run_dir / "rollout.crashed").exists():
        (run_dir / "rollout.crashed").write_text("")
        sys.exit(7)  # dies once: the supervisor must start it again
    (run_dir / "rollout.restarted").write_text("")
if role == "trainer":
    deadline = time.time() + 30
    while not (run_dir / "rollout.restarted").exists() and time.time() < deadline:
        time.sleep(0.05)
    starts = redis.Redis.from_url(os.environ["REDIS_URL"]).incr(cfg["redis"]["stream_prefix"] + ":trainer_starts")
    (run_dir / "trainer.starts").write_text(str(starts))
    state = run_dir / "checkpoint" / "trainer_state.json"
    done = json.loads(state.read_text())["step"] if state.exists() else 0
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in range(done, cfg["run"]["steps"]):
            f.write(json.dumps({"step": step, "loss": 0.5}) + "\\n")
    state.parent.mkdir(exist_ok=True)
    state.write_text(json.dumps({"step": cfg["run"]["steps"]}))
    (run_dir / "DONE").write_text("{}")
time.sleep(120)
"""


def test_run_supervises_and_resumes_with_its_redis_data(tmp_path, monkeypatch):
    """`opsd run` then `opsd run --resume` with stand-in roles (fast): restarts, token, AOF, summary."""
    import signal

    from opsd.supervisor import Services

    script = tmp_path / "dummy_role.py"
    script.write_text(_DUMMY_ROLE)
    monkeypatch.setattr("opsd.cli.resolve_models", lambda cfg: {})  # no model or games needed
    monkeypatch.setattr("opsd.cli.prepare", lambda cfg, models: None)
    monkeypatch.setattr(Services, "role_command",
                        lambda self, role: [sys.executable, str(script), role, str(self.config_path), str(self.run_dir)])
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("OPSD_API_TOKEN", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  name: sup\n  steps: 1\n  max_restarts: 1\n")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first = _cli(str(config), "--output-dir", str(tmp_path / "runs"))
        assert first.exit_code == 0, first.output
        (run_dir,) = (tmp_path / "runs").iterdir()
        assert "rollout exited with code 7; restarting it (1/1)" in first.output
        summary = json.loads((run_dir / "run_summary.json").read_text())
        assert summary["ok"] is True and summary["resumed"] is False
        assert summary["restarts"] == {"embedder": 0, "rollout": 1, "teacher": 0, "trainer": 0}
        tokens = {(run_dir / f"{r}.token").read_text() for r in summary["roles"]}
        assert len(tokens) == 1 and len(tokens.pop()) >= 40  # one fresh token, shared by every role
        assert (run_dir / "trainer.starts").read_text() == "1"
        assert any((run_dir / "redis").iterdir())  # the embedded Redis kept its append-only file here
        first_token = (run_dir / "trainer.token").read_text()

        (run_dir / "rollout.restarted").unlink()
        again = _cli("--resume", str(run_dir), "--steps", "2")
        assert again.exit_code == 0, again.output
        assert (run_dir / "trainer.starts").read_text() == "2"  # same prefix, Redis reloaded from run_dir/redis
        assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
        assert RunConfig.load(run_dir / "config.yaml").run.steps == 2
        summary = json.loads((run_dir / "run_summary.json").read_text())
        assert summary["ok"] is True and summary["resumed"] is True
        assert summary["restarts"]["rollout"] == 0  # it did not crash this time
        assert (run_dir / "trainer.token").read_text() != first_token

        done = _cli("--resume", str(run_dir))
        assert done.exit_code == 0 and "already finished: 2 steps" in done.output, done.output
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_the_cli_reports_progress_inside_a_step(redis_url, redis_client, stream_prefix):
    """Between step lines `opsd run` says how many groups were rolled out and scored since the step began: on a
    terminal at every change, to a file at most every PLAIN_EVERY_S seconds (a log was silent for minutes)."""
    from opsd.progress import StepProgress
    from opsd.config import RunConfig
    from opsd.queue import StreamNames

    cfg = RunConfig.model_validate({"run": {"method": "opd"}, "redis": {"stream_prefix": stream_prefix}})
    names = StreamNames(stream_prefix)
    redis_client.hset(names.counts, mapping={f"produced:{names.rollouts}": 4, f"produced:{names.scored}": 2})
    plain = StepProgress(redis_url, cfg, terminal=False)
    assert plain.poll(1) is None  # a file: not before PLAIN_EVERY_S
    plain.PLAIN_EVERY_S = 0.0
    redis_client.hincrby(names.counts, f"produced:{names.rollouts}", 1)
    assert re.fullmatch(r"1/2 rolled out, 0/2 scored; \d+ s into the step", plain.poll(1))
    assert plain.poll(1) is None  # nothing new (and under HEARTBEAT_S)
    term = StepProgress(redis_url, cfg, terminal=True)
    assert term.poll(2) == "0/2 rolled out, 0/2 scored"
    redis_client.hincrby(names.counts, f"produced:{names.scored}", 2)
    assert term.poll(2) == "0/2 rolled out, 2/2 scored; training"
    assert term.poll(3).startswith("0/2 rolled out, 0/2 scored")  # a new step counts from its start
    # A stalled Redis: the connection is made (the listen queue takes it) and nothing ever answers.
    with socket.create_server(("127.0.0.1", 0), backlog=16) as stalled:
        dead = StepProgress(f"redis://:pw@127.0.0.1:{stalled.getsockname()[1]}/0", cfg, terminal=True)
        polls: list[str | None] = []
        poller = threading.Thread(target=lambda: polls.extend([dead.poll(1), dead.poll(1)]), daemon=True)
        poller.start()
        poller.join(30)  # a hang guard only
        assert not poller.is_alive() and polls == [None, None]
        # How long one stalled read holds the supervisor's loop is the client's own bound, not a figure
        # measured here: redis-py's default would be 5 s a read.
        kwargs = dead.client.connection_pool.connection_kwargs
        timeouts = {k: kwargs.get(k) for k in ("socket_timeout", "socket_connect_timeout")}
        assert all(t is not None and t <= 1.0 for t in timeouts.values()), timeouts
        # One connection in all: no retry after the timeout, and the second poll waits RETRY_AFTER_S
        # instead of trying again. Every connect the client made is in the listen queue by now.
        stalled.setblocking(False)
        made = []
        with contextlib.suppress(BlockingIOError):
            while True:
                made.append(stalled.accept()[0])
        for conn in made:
            conn.close()
        assert len(made) == 1

