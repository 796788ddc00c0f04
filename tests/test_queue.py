"""opsd.queue and opsd.redis_server against a real redis-server (LocalRedis), never fakeredis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY
from redis.backoff import NoBackoff
from redis.retry import Retry

from opsd.queue import Delivery, StreamNames, StreamQueue, produce_message
from opsd.redis_server import OVERCOMMIT_NOTE, LocalRedis, connect, resolve_redis_url
from opsd.types import RolloutGroup, ScoredGroup, TaskGroup
from opsd.wire import WireError, decode, encode
from tests.factories import make_rollout_group, make_scored_group, make_task

pytestmark = pytest.mark.redis
LIMIT = 1 << 20
NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries even auth errors by default: fail fast here
ROOT = Path(__file__).resolve().parents[1]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def queue(client, names: StreamNames, consumer: str, cls=RolloutGroup, stream=None, **kw) -> StreamQueue:
    q = StreamQueue(
        client, stream or names.rollouts, "teacher", consumer, cls, role="teacher",
        max_bytes=kw.pop("max_bytes", LIMIT), dead_stream=names.dead, **kw,
    )
    q.ensure_group()
    return q


def test_stream_names():
    n = StreamNames("opsd:run1")
    assert (n.tasks, n.rollouts, n.scored, n.dead) == ("opsd:run1:tasks", "opsd:run1:rollouts", "opsd:run1:scored", "opsd:run1:dead")
    assert n.counts == "opsd:run1:counts"


def test_produce_consume_ack(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    # produced before any consumer group exists: must still be delivered
    first = produce_message(redis_client, names.rollouts, make_rollout_group(seed=1), LIMIT)
    q = queue(redis_client, names, "teacher-0")
    q.ensure_group()  # idempotent (BUSYGROUP ignored)
    second = q.produce(make_rollout_group(seed=2))
    assert q.depth() == (2, 0)
    assert metric("opsd_queue_depth", stream=names.rollouts) == 2

    (d,) = q.consume(block_ms=100)
    assert isinstance(d, Delivery) and d.entry_id == first and d.deliveries == 1
    assert d.msg.group_id == make_rollout_group(seed=1).group_id
    np.testing.assert_array_equal(d.msg.trajectories[2].token_ids_S, make_rollout_group(seed=1).trajectories[2].token_ids_S)
    assert q.depth() == (1, 1)
    assert metric("opsd_queue_pending", stream=names.rollouts) == 1

    assert q.ack(d.entry_id) is True
    assert q.ack(d.entry_id) is False  # no longer pending
    (d2,) = q.consume(block_ms=100, count=5)
    assert d2.entry_id == second
    q.ack(d2.entry_id)
    assert q.depth() == (0, 0)
    assert redis_client.xlen(names.rollouts) == 0  # delete_on_ack keeps Redis memory bounded

    t0 = time.monotonic()
    assert q.consume(block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15  # it did block
    assert q.consume(block_ms=0) == []  # and 0 does not block forever


def test_consume_refuses_block_longer_than_socket_timeout(redis_url, stream_prefix):
    client = connect(redis_url, block_ms=100)
    try:
        timeout = client.connection_pool.connection_kwargs["socket_timeout"]
        assert timeout > 0.1
        q = queue(client, StreamNames(stream_prefix), "c")
        with pytest.raises(ValueError, match="socket timeout"):
            q.consume(block_ms=int(timeout * 1000) + 1)
    finally:
        client.close()


def test_unacked_entry_is_reclaimed_by_another_consumer(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    a = queue(redis_client, names, "teacher-a")
    b = queue(redis_client, names, "teacher-b")
    entry = a.produce(make_rollout_group(seed=3))
    (got_a,) = a.consume(block_ms=100)  # teacher-a reads, then "dies" without acking

    assert b.reclaim(min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.15)
    before = metric("opsd_messages_reclaimed_total", role="teacher", stream=names.rollouts)
    (got_b,) = b.reclaim(min_idle_ms=100)
    assert got_b.entry_id == entry == got_a.entry_id and got_b.deliveries == 2
    assert got_b.msg.group_id == got_a.msg.group_id
    assert metric("opsd_messages_reclaimed_total", role="teacher", stream=names.rollouts) == before + 1

    # teacher-a comes back late: its output must not be written twice
    scored = make_scored_group(seed=3)
    assert a.produce_then_ack(names.scored, scored, entry) is None
    assert redis_client.xlen(names.scored) == 0
    out_id = b.produce_then_ack(names.scored, scored, entry)
    assert out_id is not None and redis_client.xlen(names.scored) == 1
    assert b.depth() == (0, 0)


def test_keep_alive_protects_held_entries_from_reclaim(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    a = queue(redis_client, names, "a")
    b = queue(redis_client, names, "b")
    a.produce(make_rollout_group(seed=1))
    (held,) = a.consume(block_ms=100)
    # The reclaims right after the keep-alive must come within IDLE_MS of it: 2 s is far more than
    # a few Redis calls take on a loaded machine (100 ms was not); the sleeps make the entry idle past it.
    IDLE_MS = 2000
    time.sleep(IDLE_MS / 1000 + 0.1)  # without a keep-alive it could be reclaimed now
    assert a.keep_alive([held.entry_id, "0-1"]) == 1  # an id it does not hold is ignored
    assert b.reclaim(min_idle_ms=IDLE_MS) == [] and a.reclaim(min_idle_ms=IDLE_MS) == []
    ((info,),) = [redis_client.xpending_range(names.rollouts, "teacher", "-", "+", 10)]
    assert info["consumer"] == b"a" and info["times_delivered"] == 1  # a keep-alive is not a delivery
    assert info["time_since_delivered"] < IDLE_MS  # the keep-alive reset its idle time
    time.sleep(IDLE_MS / 1000 + 0.1)
    (taken,) = b.reclaim(min_idle_ms=IDLE_MS)  # no keep-alive any more: b takes it over
    assert taken.entry_id == held.entry_id and taken.deliveries == 2
    assert a.keep_alive([held.entry_id]) == 0  # and a cannot pull it back


def test_produce_to_another_stream_uses_the_queue_limit(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    trainer = queue(redis_client, names, "trainer-0", cls=ScoredGroup, stream=names.scored, max_bytes=2048)
    entry = trainer.produce_to(names.tasks, make_task(seed=2))
    ((got_id, fields),) = redis_client.xrange(names.tasks)
    assert got_id.decode() == entry and decode(fields[b"data"], TaskGroup, LIMIT) == make_task(seed=2)
    with pytest.raises(WireError, match="limit 2048"):
        trainer.produce_to(names.tasks, make_rollout_group(G=8))
    assert redis_client.xlen(names.tasks) == 1


def test_too_many_deliveries_goes_to_dead_letter(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    a = queue(redis_client, names, "a", max_deliveries=2)
    b = queue(redis_client, names, "b", max_deliveries=2)
    entry = a.produce(make_rollout_group(seed=4))
    assert len(a.consume(block_ms=100)) == 1  # delivery 1
    assert [d.deliveries for d in b.reclaim(min_idle_ms=0)] == [2]  # delivery 2: still allowed
    before = metric("opsd_messages_rejected_total", role="teacher", stream=names.rollouts, reason="too_many_deliveries")
    assert a.reclaim(min_idle_ms=0) == []  # delivery 3 > 2: a poison message
    assert metric("opsd_messages_rejected_total", role="teacher", stream=names.rollouts, reason="too_many_deliveries") == before + 1
    assert a.depth() == (0, 0)
    ((_, dead),) = redis_client.xrange(names.dead)
    assert dead[b"entry_id"].decode() == entry and b"too many deliveries" in dead[b"error"]
    assert decode(dead[b"data"], RolloutGroup, LIMIT).group_id == make_rollout_group(seed=4).group_id


def test_reclaim_drops_pending_entries_deleted_from_the_stream(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    a = queue(redis_client, names, "a")
    b = queue(redis_client, names, "b")
    gone = a.produce(make_rollout_group(seed=1))
    kept = a.produce(make_rollout_group(seed=2))
    assert len(a.consume(block_ms=100, count=2)) == 2
    redis_client.xdel(names.rollouts, gone)  # e.g. trimmed by an operator while pending
    assert [d.entry_id for d in b.reclaim(min_idle_ms=0)] == [kept]
    assert a.depth() == (0, 1)  # the deleted entry left the pending list; only `kept` remains
    assert [d.entry_id for d in a.reclaim(min_idle_ms=0)] == [kept]


def test_a_held_job_deleted_from_its_stream_still_finishes(redis_client, stream_prefix):
    """An operator deletes the entry of a job a live worker holds: the heartbeat leaves it pending (Redis 7's XCLAIM
    would drop it from the pending list and the finished output would be refused), so the worker's output is
    written and its input acknowledged as usual."""
    names = StreamNames(stream_prefix)
    q = queue(redis_client, names, "teacher-0")
    q.produce(make_rollout_group(G=2, turns=1, seed=3))
    (d,) = q.consume(block_ms=100)
    redis_client.xdel(names.rollouts, d.entry_id)
    assert q.keep_alive([d.entry_id]) == 0  # not refreshed: deleted
    assert redis_client.xpending(names.rollouts, "teacher")["pending"] == 1  # still ours
    assert q.produce_then_ack(names.scored, make_rollout_group(G=2, turns=1, seed=4), d.entry_id) is not None
    assert redis_client.xpending(names.rollouts, "teacher")["pending"] == 0 and redis_client.xlen(names.scored) == 1


def test_queue_refuses_a_str_decoding_client(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="bytes replies"):
        StreamQueue(client, "s", "g", "c", RolloutGroup, "teacher", LIMIT, "d")
    client.close()


def test_bad_entries_are_dead_lettered_and_the_worker_keeps_going(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    q = queue(redis_client, names, "teacher-0", max_bytes=4096)
    s = names.rollouts
    garbage = redis_client.xadd(s, {"data": b"\x93not msgpack at all"}).decode()
    no_data = redis_client.xadd(s, {"payload": b"x"}).decode()
    wrong_type = produce_message(redis_client, s, make_task(), LIMIT)
    big = produce_message(redis_client, s, make_rollout_group(G=8, turns=4), LIMIT)  # > 4096 B
    good = q.produce(make_rollout_group(G=2, turns=2, seed=5))
    reasons = ("malformed", "oversized")
    before = {r: metric("opsd_messages_rejected_total", role="teacher", stream=s, reason=r) for r in reasons}

    got = q.consume(block_ms=100, count=10)

    assert [d.entry_id for d in got] == [good]
    after = {r: metric("opsd_messages_rejected_total", role="teacher", stream=s, reason=r) for r in reasons}
    assert after["malformed"] == before["malformed"] + 3 and after["oversized"] == before["oversized"] + 1
    dead = {f[b"entry_id"].decode(): f for _, f in redis_client.xrange(names.dead)}
    assert set(dead) == {garbage, no_data, wrong_type, big}
    assert dead[garbage][b"data"] == b"\x93not msgpack at all" and b"undecodable msgpack" in dead[garbage][b"error"]
    assert b"no 'data' field" in dead[no_data][b"error"]
    assert b"expected message type RolloutGroup, got 'TaskGroup'" in dead[wrong_type][b"error"]
    assert dead[big][b"reason"] == b"oversized"
    assert all(f[b"source_stream"] == s.encode() and f[b"role"] == b"teacher" for f in dead.values())
    assert q.depth() == (0, 1)  # only the good entry is pending; the bad ones are acknowledged


def test_a_schema_valid_group_over_the_runs_limits_is_dead_lettered(redis_client, stream_prefix):
    """A message the schema accepts but this run's config never makes (many more turns or tokens than env.max_turns
    and model.max_model_len allow: the trainer's credit path would allocate gigabytes) is dead-lettered with its
    group id (so the trainer re-issues its task), never handed to the consumer."""
    from opsd.config import RunConfig
    from opsd.types import MessageLimits

    cfg = RunConfig.model_validate({"env": {"max_turns": 2, "max_observation_chars": 100}, "model": {"max_model_len": 256},
                                    "rollout": {"group_size": 2}})
    limits = MessageLimits.for_config(cfg)
    assert limits == MessageLimits(max_tokens=256 + 400 + 1024, max_turns=2, max_group_size=2)
    names = StreamNames(stream_prefix)
    q = queue(redis_client, names, "teacher-0", limits=limits)
    s = names.rollouts
    many_turns = q.produce(make_rollout_group(G=2, turns=3, seed=1))  # its turns fit its task's max_turns (3), not ours
    long = make_rollout_group(G=2, turns=1, seed=2)
    t = long.trajectories[0]
    pad = limits.max_tokens + 1 - t.token_ids_S.shape[0]  # a prompt this run could never have sent
    t.token_ids_S = np.concatenate([np.zeros(pad, np.int32), t.token_ids_S])
    t.sampler_logprobs_S = np.concatenate([np.zeros(pad, np.float32), t.sampler_logprobs_S])
    t.loss_mask_S = np.concatenate([np.zeros(pad, np.uint8), t.loss_mask_S])
    t.sampler_entropy_S = np.concatenate([np.zeros(pad, np.float32), t.sampler_entropy_S])
    for rec in t.turns:
        rec.response_start, rec.response_end = rec.response_start + pad, rec.response_end + pad
    too_long = q.produce(long)
    big_group = q.produce(make_rollout_group(G=3, turns=1, seed=3))
    good = q.produce(make_rollout_group(G=2, turns=2, seed=4))
    before = metric("opsd_messages_rejected_total", role="teacher", stream=s, reason="over_limits")
    assert [d.entry_id for d in q.consume(block_ms=100, count=10)] == [good]
    assert metric("opsd_messages_rejected_total", role="teacher", stream=s, reason="over_limits") == before + 3
    dead = {f[b"entry_id"].decode(): f for _, f in redis_client.xrange(names.dead)}
    assert set(dead) == {many_turns, too_long, big_group} and all(f[b"reason"] == b"over_limits" for f in dead.values())
    assert b"max_turns 3 > this run's env.max_turns 2" in dead[many_turns][b"error"]
    assert b"tokens > this run's bound 1680" in dead[too_long][b"error"]
    assert b"group_size 3 > this run's rollout.group_size 2" in dead[big_group][b"error"]
    assert dead[many_turns][b"group_id"] != b""


def test_nan_on_the_wire_is_dead_lettered(redis_client, stream_prefix):
    import msgpack

    names = StreamNames(stream_prefix)
    q = queue(redis_client, names, "t")
    env = msgpack.unpackb(encode(make_rollout_group(G=2, turns=2)), raw=False)
    lp = np.frombuffer(env["body"]["trajectories"][0]["sampler_logprobs_S"]["data"], "<f4").copy()
    lp[-1] = np.nan
    env["body"]["trajectories"][0]["sampler_logprobs_S"]["data"] = lp.tobytes()
    redis_client.xadd(names.rollouts, {"data": msgpack.packb(env, use_bin_type=True)})
    assert q.consume(block_ms=50) == []
    ((_, dead),) = redis_client.xrange(names.dead)
    assert b"contains NaN" in dead[b"error"]


def test_produce_then_ack_is_all_or_nothing(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    q = queue(redis_client, names, "teacher-0")
    q.produce(make_rollout_group(seed=6))
    (d,) = q.consume(block_ms=100)

    # an invalid output is refused before anything is written
    bad = make_scored_group(seed=6)
    bad.alpha_M[0] = np.nan
    with pytest.raises(WireError):
        q.produce_then_ack(names.scored, bad, d.entry_id)
    # the output write fails on the server: the input must stay unacknowledged
    redis_client.set(names.scored, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        q.produce_then_ack(names.scored, make_scored_group(seed=6), d.entry_id)
    assert q.depth() == (0, 1)
    redis_client.delete(names.scored)

    out = q.produce_then_ack(names.scored, make_scored_group(seed=6), d.entry_id)
    assert q.depth() == (0, 0)
    ((out_id, fields),) = redis_client.xrange(names.scored)
    assert out_id.decode() == out
    assert decode(fields[b"data"], ScoredGroup, LIMIT).group_id == d.msg.group_id
    assert q.produce_then_ack(names.scored, make_scored_group(seed=6), d.entry_id) is None  # a retry writes nothing
    assert redis_client.xlen(names.scored) == 1


# ---------------------------------------------------------------- the server itself


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it


def test_local_redis_requires_password_and_stops(tmp_path):
    log = tmp_path / "redis.log"
    with LocalRedis(log) as server:
        pid, port = server.process.pid, server.port
        assert server.url.startswith("redis://:") and f"@127.0.0.1:{port}/0" in server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=NO_RETRY).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="wrong", socket_timeout=2, retry=NO_RETRY).ping()
        client = connect(server.url, block_ms=100)
        assert client.ping()
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("save") == {"save": ""} and client.config_get("appendonly") == {"appendonly": "no"}
        assert server.password not in Path(f"/proc/{pid}/cmdline").read_text()
        client.close()
    assert not _alive(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=NO_RETRY).ping()
    assert "Ready to accept connections" in log.read_text()
    server.stop()  # idempotent
    # Redis's own overcommit warning is followed by what it means for opsd, on machines where Redis warns.
    warned = "overcommit" in log.read_text().replace(OVERCOMMIT_NOTE, "")
    assert warned == (Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1")
    assert log.read_text().count(f"opsd: {OVERCOMMIT_NOTE}") == int(warned)


def test_local_redis_dies_with_a_killed_parent(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from opsd.redis_server import LocalRedis;"
        "s = LocalRedis(sys.argv[2]).start(); print(s.process.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path / "r.log")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
    finally:
        parent.send_signal(signal.SIGKILL)  # no atexit runs
        parent.wait()
    # Milliseconds (the kernel's SIGTERM at once); without the parent-death signal the server would
    # live on for good, so a generous 30 s only spares a loaded machine and still tells the two apart.
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):  # do not leak it even when the test fails
        os.kill(pid, signal.SIGKILL)
        pytest.fail("redis-server outlived its killed parent")


def test_local_redis_reports_a_server_that_cannot_start(tmp_path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start (test)'\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with code 3[\s\S]*FATAL: cannot start \(test\)"):
        LocalRedis(tmp_path / "log", binary=str(fake)).start()


def test_resolve_redis_url_order(monkeypatch, tmp_path):
    monkeypatch.setenv("REDIS_URL", "redis://env:6379/0")
    assert resolve_redis_url("redis://cfg:6379/0", tmp_path / "l") == ("redis://env:6379/0", None)
    monkeypatch.delenv("REDIS_URL")
    assert resolve_redis_url("redis://cfg:6379/0", tmp_path / "l") == ("redis://cfg:6379/0", None)
    url, server = resolve_redis_url(None, tmp_path / "l")
    try:
        assert server is not None and url == server.url
        pid = server.process.pid
        assert connect(url, block_ms=100).ping()
    finally:
        server.stop()
    assert not _alive(pid)
