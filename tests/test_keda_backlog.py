"""The metric KEDA scales rollout and teacher on (k8s/components/keda/keda.yaml) equals the backlog, on a real Redis.

KEDA v2.20.2's redis-streams scaler (pkg/scalers/redis_streams_scaler.go, commit 68a5b50, as at 8b4f083): a trigger
without `consumerGroup` issues XLEN on the stream; with `consumerGroup` and `lagCount` it issues XINFO GROUPS and
takes the group's `lag` (nil read as 0). opsd's workers ack AND delete each entry (`StreamQueue.ack`), so the
backlog (entries waiting + in flight) is what XLEN counts, whatever order the jobs finish in; the lag is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opsd.queue import StreamNames, StreamQueue
from opsd.types import TaskGroup
from tests.factories import make_task

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[1]


ABSENT = "absent"  # Redis < 7 reports no lag (KEDA's lagCount mode then refuses to scale at all)


def _lag(client, stream: str, group: str):
    """XINFO GROUPS' lag of `group`, as KEDA's lagCount mode reads it (None: Redis 7 reports nil)."""
    (info,) = [g for g in client.xinfo_groups(stream) if g["name"].decode() == group]
    return info.get("lag", ABSENT)


def test_xlen_counts_waiting_and_in_flight_work_when_jobs_finish_out_of_order(redis_client, stream_prefix):
    names = StreamNames(stream_prefix)
    q = StreamQueue(redis_client, names.tasks, "rollout", "rollout-0", TaskGroup, role="rollout",
                    max_bytes=1 << 20, dead_stream=names.dead)
    q.ensure_group()
    for seed in range(4):
        q.produce(make_task(seed=seed))
    first, second = q.consume(block_ms=100, count=2)  # one worker holds two groups in flight
    redis7 = _lag(redis_client, names.tasks, "rollout") != ABSENT  # the lag exists from Redis 7 on
    assert redis_client.xlen(names.tasks) == 4 and _lag(redis_client, names.tasks, "rollout") in (2, ABSENT)
    assert q.ack(second.entry_id)  # the later job finishes first: acked and deleted
    # 3 entries of work left (1 in flight, 2 waiting). On Redis 7 the group's lag goes nil (KEDA's lagCount
    # reads 0: no scale-out, even scale-in) and stays nil as more work arrives (the reproduction on
    # 7.0.15); on every version the stream's length is the backlog.
    assert _lag(redis_client, names.tasks, "rollout") == (None if redis7 else ABSENT)
    assert redis_client.xlen(names.tasks) == 3
    for seed in range(4, 7):
        q.produce(make_task(seed=seed))
    assert _lag(redis_client, names.tasks, "rollout") == (None if redis7 else ABSENT)
    assert redis_client.xlen(names.tasks) == 6 == q.depth()[0] + q.depth()[1]  # waiting + in flight
    assert q.ack(first.entry_id)
    assert redis_client.xlen(names.tasks) == 5
    while batch := q.consume(block_ms=100, count=2):
        for d in batch:
            q.ack(d.entry_id)
    assert redis_client.xlen(names.tasks) == 0  # no work, no pods wanted beyond minReplicaCount


def test_the_shipped_scaled_objects_read_the_stream_length_and_the_run_marker():
    """The backlog trigger names no consumer group (so KEDA issues XLEN, the test above) and aims at one pod per
    `streamLength` entries (tests/test_deploy_k8s.py ties it to the run config's groups in flight); the marker
    trigger reads the list <prefix>:active, one pod per entry."""
    docs = [d for d in yaml.safe_load_all((ROOT / "k8s/components/keda/keda.yaml").read_text())
            if d["kind"] == "ScaledObject"]
    assert {d["metadata"]["name"] for d in docs} == {"rollout", "teacher"}
    for d in docs:
        backlog, marker = d["spec"]["triggers"]
        assert backlog["type"] == "redis-streams"
        assert "consumerGroup" not in backlog["metadata"] and int(backlog["metadata"]["streamLength"]) >= 1
        assert marker["type"] == "redis" and marker["metadata"]["listName"].endswith(":active")
        assert marker["metadata"]["listLength"] == "1" and d["spec"]["minReplicaCount"] == 0


def test_the_marker_trigger_reads_one_while_the_list_exists_and_zero_once_it_is_gone(redis_client, stream_prefix):
    """KEDA v2.20's redis scaler (pkg/scalers/redis_scaler.go) runs a script of TYPE, then LLEN for a list or a
    missing key, and counts the trigger active while that is above activationListLength (0): on a real Redis,
    a list of one entry wants one pod; a deleted one reads 0, and the workers may go to zero."""
    key = f"{stream_prefix}:active"
    assert redis_client.type(key) == b"none" and redis_client.llen(key) == 0  # before the trainer starts
    redis_client.rpush(key, "trainer")
    assert redis_client.type(key) == b"list" and redis_client.llen(key) == 1  # the run is active: 1 pod
    redis_client.delete(key)  # DONE
    assert redis_client.type(key) == b"none" and redis_client.llen(key) == 0
