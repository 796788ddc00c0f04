"""The trainer's books (services/trainer/books.py `accounting`), the main check of the fault and soak tests: it must
name each broken invariant, not only pass the runs that keep them (issue 37).

Real parts: a redis-server (tests/conftest.py) that the trainer's own TaskIssuer issues the run's tasks into (the
counts hash and the tasks stream), a rollout consumer's real dead letter, and a finished run directory as the
trainer leaves it (config.yaml, checkpoint/trainer_state.json written from TrainerState, DONE). What the teacher
produced is the counts hash's `produced:<scored>` field, which produce_then_ack increments once per output.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from opsd import wire
from opsd.config import RunConfig
from opsd.envs import EnvContext, get_adapter
from opsd.queue import StreamNames, StreamQueue
from opsd.types import TaskGroup
from services.trainer.books import accounting
from services.trainer.checkpoint import TrainerState
from services.trainer.controller import TaskIssuer
from tests.soak import write_config


class Run:
    """A 2-step x 2-game run of tests/configs/faults.yaml (method opd: the trainer reads <prefix>:scored) whose
    four tasks were issued for real; `finish` writes the books as the trainer leaves them."""

    def __init__(self, tmp_path: Path, client, prefix: str):
        self.dir = tmp_path / "run"
        self.dir.mkdir()
        self.client, self.names = client, StreamNames(prefix)
        config = write_config(self.dir / "config.yaml", tmp_path / "model", redis={"stream_prefix": prefix})
        self.cfg = RunConfig.load(config)
        games = get_adapter(self.cfg.env.name).make_tasks(self.cfg.env, EnvContext(cache_dir=self.cfg.cache_root), "train")
        self.issuer = TaskIssuer(client, self.cfg, games, self.cfg.redis.max_message_bytes)
        for step in range(self.cfg.run.steps):  # as the trainer does: step s's tasks with policy version s
            assert self.issuer.top_up(step, step) == [step]
        self.tasks = {t.group_id: (eid.decode(), t) for eid, t in (
            (eid, wire.decode(fields[b"data"], TaskGroup, 1 << 20)) for eid, fields in client.xrange(self.names.tasks))}
        assert len(self.tasks) == 4 and {t.step for _, t in self.tasks.values()} == {0, 1}
        self.ids = sorted(self.tasks)

    def finish(self, applied: list[str], produced: int, stale: int = 0, done: bool = True) -> dict:
        """Books with `applied` group ids trained (in order), `produced` teacher outputs, `stale` groups dropped as
        stale; returns accounting()'s report."""
        self.client.hset(self.names.counts, f"produced:{self.names.scored}", produced)
        keys = [f"{gid}@v{int(gid[1:6])}" for gid in applied]  # s<step>-<task>: trained at version <step> (synchronous)
        state = TrainerState(step=self.cfg.run.steps, policy_version=self.cfg.run.steps, method="opd", applied=keys,
                             counts={"trained": len(keys), "dropped_stale": stale, "dropped_duplicate": 0})
        (self.dir / "checkpoint").mkdir()
        (self.dir / "checkpoint" / "trainer_state.json").write_text(json.dumps(asdict(state)))
        if done:
            (self.dir / "DONE").write_text(json.dumps({"steps": self.cfg.run.steps}))
        return accounting(self.dir, self.client)

    def dead_letter_task(self, gid: str) -> None:
        """A rollout worker gives up on `gid`'s task: it lands in the dead-letter stream as the queue puts it there."""
        queue = StreamQueue(self.client, self.names.tasks, "rollout", "rollout-1", TaskGroup, "rollout",
                            self.cfg.redis.max_message_bytes, self.names.dead)
        queue.ensure_group()
        assert len(queue.consume(0, count=10)) == 4
        assert queue.dead_letter(self.tasks[gid][0], self.client.xrange(self.names.tasks, self.tasks[gid][0])[0][1][b"data"],
                                 "killed the worker 3 times", "too_many_deliveries")


@pytest.fixture
def run(tmp_path, redis_client, stream_prefix) -> Run:
    return Run(tmp_path, redis_client, stream_prefix)


def test_books_of_a_clean_run_balance(run):
    books = run.finish(run.ids, produced=4)
    assert books["violations"] == []
    assert books["produced"] == {"tasks": 4, "rollouts": 0, "scored": 4}
    assert books["trained"] == books["applied_entries"] == 4 and books["finished"] and books["dead_lettered"] == {}


def test_a_lost_group_is_flagged(run):
    """One group never came back: not trained, not dead-lettered, not dropped as stale (the teacher made 3)."""
    lost = run.ids[2]
    books = run.finish([g for g in run.ids if g != lost], produced=3)
    assert books["violations"] == [f"issued groups neither trained, dead-lettered nor dropped as stale: ['{lost}']"]


def test_a_missing_group_with_a_dead_letter_is_accounted_for(run):
    """The same missing group with its reason on record: a rollout worker dead-lettered its task."""
    lost = run.ids[2]
    run.dead_letter_task(lost)
    books = run.finish([g for g in run.ids if g != lost], produced=3)
    assert books["violations"] == [] and books["dead_lettered"] == {"too_many_deliveries": 1}


def test_a_missing_group_dropped_as_stale_is_accounted_for(run):
    """The same missing group, its output dropped as stale: the teacher made 4, the trainer trained 3."""
    books = run.finish([g for g in run.ids if g != run.ids[2]], produced=4, stale=1)
    assert books["violations"] == [] and books["dropped_stale"] == 1


def test_a_duplicate_output_is_flagged(run):
    """The teacher wrote one group twice (5 outputs); the trainer trained 4 and dropped the copy as a duplicate."""
    books = run.finish(run.ids, produced=5)
    assert books["violations"] == [f"produced into {run.names.scored} 5 != trained 4 + dropped stale 0"]


def test_a_group_trained_twice_is_flagged(run):
    """Both copies of one group were trained (the duplicate check failed): applied holds it twice."""
    twice = run.ids[1]
    books = run.finish(run.ids + [twice], produced=5)
    assert books["applied_entries"] == 5 and books["trained"] == 4
    assert books["violations"] == [f"produced into {run.names.scored} 5 != trained 4 + dropped stale 0",
                                   f"groups trained more than once: ['{twice}']"]


def test_a_step_issued_twice_an_unissued_group_and_an_unfinished_run_are_flagged(run):
    step0 = next(g for g in run.ids if run.tasks[g][1].step == 0)
    run.issuer.reissue(0, {step0}, 0)  # a fifth task
    books = run.finish(run.ids + ["s00009-tw-never-issued"], produced=5, done=False)
    assert books["violations"] == [
        "run not finished: checkpoint at step 2 of 2, DONE False",
        "tasks issued 5 != 4 (run.steps x env.num_games)",
        "trained groups that were never issued: ['s00009-tw-never-issued']",
    ]
