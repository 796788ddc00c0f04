"""The trainer's controller: which tasks go out (admission), which delivered groups are kept.

`TaskIssuer` keeps the tasks of steps [n, n + max_staleness] issued while
step n is waiting, and records the last issued step in Redis in the same
MULTI/EXEC as that step's tasks (and their count, field
`produced:<tasks stream>` of the run's counts hash), so a resumed trainer
never issues a step twice and a Redis that lost its data gets the missing
tasks again.

`Collector` holds every delivered group from delivery to acknowledgement:
buffered (waiting for its step), trained (waiting for a checkpoint that
covers it) or dropped (waiting for its ack). It refreshes all of them while
waiting, so `reclaim` never hands a held group to anyone, and it drops, acks,
counts and logs duplicates and stale groups.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from opsd import metrics, wire
from opsd.config import REDIS_RETRY_WAIT_MAX_S
from opsd.queue import Delivery, RedisFullError, StreamNames, StreamQueue, full_error
from opsd.envs import task_group
from opsd.types import TaskGroup

log = logging.getLogger("trainer")
# A lost connection, or a full Redis (maxmemory) that refused a write, writing nothing: both pass with time.
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, RedisFullError)


def group_id(step: int, task_id: str) -> str:
    """A group's id: the same in every run of a config (rollout and teacher derive their seeds from it)."""
    return f"s{step:05d}-{task_id}"


def step_tasks(cfg, tasks: list, step: int, version: int) -> list[TaskGroup]:
    """The step's TaskGroups: `env.num_games` distinct tasks (opsd.envs.base.Task) drawn from the pool with a
    per-step seed, policy `version`."""
    rng = random.Random(cfg.run.seed * 7919 + step)
    picked = rng.sample(tasks, k=min(cfg.env.num_games, len(tasks)))
    return [
        task_group(cfg, t, group_id=group_id(step, t.task_id), step=step, policy_version=version,
                   group_size=cfg.rollout.group_size)
        for t in picked
    ]


# Issue one step's tasks: append ARGV[3..] (encoded TaskGroups) to stream KEYS[2], count them in hash KEYS[3]
# under field ARGV[2] and record step ARGV[1] in KEYS[1], unless KEYS[1] already says that step (or a later
# one) was issued. Atomic like MULTI/EXEC, and idempotent: redis-py re-sends a command whose reply a stalled
# Redis never gave (its retry on TimeoutError), and a MULTI/EXEC sent twice issued the step twice; the second
# run of this script finds the step issued and writes nothing. Every check comes before the first write.
_ISSUE = """
local issued = redis.call('GET', KEYS[1])
if issued and tonumber(issued) >= tonumber(ARGV[1]) then return 0 end
for i, key in ipairs({KEYS[2], KEYS[3]}) do
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= (i == 1 and 'stream' or 'hash') then
    return redis.error_reply('WRONGTYPE ' .. key .. ' holds a ' .. t)
  end
end
for i = 3, #ARGV do redis.call('XADD', KEYS[2], '*', 'data', ARGV[i]) end
redis.call('HINCRBY', KEYS[3], ARGV[2], #ARGV - 2)
redis.call('SET', KEYS[1], ARGV[1])
return #ARGV - 2
"""
# Re-issue dead-lettered tasks once per call: ARGV[1] is the call's own token, kept a day in KEYS[1]; a re-sent
# script (the client's retry) finds it and writes nothing. Otherwise as _ISSUE, without the step record.
_REISSUE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', 86400) then return 0 end
for i = 3, #ARGV do redis.call('XADD', KEYS[2], '*', 'data', ARGV[i]) end
redis.call('HINCRBY', KEYS[3], ARGV[2], #ARGV - 2)
return #ARGV - 2
"""


class TaskIssuer:
    """Issues each step's tasks once, ahead of training by at most `cfg.run.max_staleness` steps.

    client: redis-py client (bytes replies); cfg: RunConfig; games: the task
    pool (the env adapter's `make_tasks`); max_bytes: message size limit.
    """

    def __init__(self, client: redis.Redis, cfg, games: list, max_bytes: int):
        self.client = client
        self.cfg = cfg
        self.games = games
        self.max_bytes = max_bytes
        self.streams = StreamNames(cfg.redis.stream_prefix)
        self.key = f"{cfg.redis.stream_prefix}:issued_step"
        self._issue = client.register_script(_ISSUE)
        self._reissue = client.register_script(_REISSUE)

    def top_up(self, step: int, version: int) -> list[int]:
        """Issue, with policy `version`, the tasks of every step in [step, step + max_staleness] (below run.steps)
        not issued yet; returns the steps issued now.

        Issued means at most `<prefix>:issued_step`; when that key is missing
        (a fresh run, or a Redis that lost its data) issuing starts at `step`.
        Raises RedisFullError (Redis at maxmemory: nothing issued), redis.RedisError (a step is issued whole or
        not at all, and once however often the client re-sends it) or WireError.
        """
        raw = self.client.get(self.key)
        first = step if raw is None else max(int(raw) + 1, step)
        last = min(step + self.cfg.run.max_staleness, self.cfg.run.steps - 1)
        if raw is None and first <= last and step > 0:
            log.warning("%s is missing (Redis lost its data?): issuing steps %d..%d again", self.key, first, last)
        for s in range(first, last + 1):
            payloads = [wire.encode(t, self.max_bytes) for t in step_tasks(self.cfg, self.games, s, version)]
            try:
                self._issue(keys=[self.key, self.streams.tasks, self.streams.counts],
                            args=[s, f"produced:{self.streams.tasks}", *payloads])
            except redis.ResponseError as e:
                raise full_error(e, f"issuing step {s}'s tasks to {self.streams.tasks}") from e
        return list(range(first, last + 1))

    def reissue(self, step: int, group_ids: set[str], version: int) -> None:
        """Issue again, with policy `version`, the tasks of `step` whose group id is in `group_ids`
        (their earlier copy was dead-lettered), once however often the client re-sends the call. Raises
        RedisFullError (Redis at maxmemory: nothing issued), redis.RedisError or WireError."""
        payloads = [wire.encode(t, self.max_bytes) for t in step_tasks(self.cfg, self.games, step, version)
                    if t.group_id in group_ids]
        token = f"{self.cfg.redis.stream_prefix}:reissue:{uuid.uuid4().hex}"
        try:
            self._reissue(keys=[token, self.streams.tasks, self.streams.counts],
                          args=["-", f"produced:{self.streams.tasks}", *payloads])
        except redis.ResponseError as e:
            raise full_error(e, f"issuing step {step}'s tasks {sorted(group_ids)} again") from e


    def reissue_missing(self, step: int, arrived: set[str], version: int) -> None:
        """Issue again, with policy `version`, every task of `step` whose group id is not in `arrived` (a job was
        lost without a name: its entry deleted while pending). A copy still in flight makes a duplicate the
        trainer drops; a later step's lost job is issued again when that step waits for it (its timeout).
        Raises redis.RedisError or WireError."""
        missing = {t.group_id for t in step_tasks(self.cfg, self.games, step, version)} - arrived
        if missing:
            log.warning("step %d: a job was lost: issuing its groups %s again", step, sorted(missing))
            self.reissue(step, missing, version)


class StepFailed(RuntimeError):
    """A step cannot complete: one of its groups keeps failing in a worker (dead-lettered too often)."""


class RunConflict(RuntimeError):
    """Another run (or another trainer) holds this run's stream prefix or run directory."""


def lock_trainer(run_dir: Path, wait_s: float = 300.0, poll_s: float = 0.5):
    """Hold an exclusive lock on `<run_dir>/.trainer.lock` for this process's life (returned: keep it open).

    The trainer is a singleton: a second one on the same run directory (`docker
    compose up --scale trainer=2`, a stray `docker compose run trainer`) would
    issue every task twice and interleave checkpoints. A trainer that is still
    finishing its step and checkpoint after a stop (`opsd run --resume` right
    after the CLI died) is waited for, up to `wait_s` seconds. Raises
    RunConflict naming the holder's pid when the lock stays taken.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".trainer.lock", "a+")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "?"
            if time.monotonic() >= deadline:
                f.close()
                raise RunConflict(f"another trainer (pid {holder}) is running on {run_dir}") from None
            log.info("waiting for the trainer (pid %s) still running on %s to stop", holder, run_dir)
            time.sleep(poll_s)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def claim_prefix(client: redis.Redis, names: StreamNames, run_dir: Path, config_hash: str, backoff: "Backoff") -> str:
    """Make this run the owner of `names.prefix` in Redis and publish its config hash; returns the run id.

    The run id is `<run_dir>/run_id` (made on the run's first start, kept
    across restarts and resumes). `<prefix>:owner` is set to it only if unset;
    if it holds another id, the prefix's streams and `issued_step` belong to
    another run whose run directory is gone (a deleted run dir with Redis
    kept, two run dirs of one name): training on would take that run's groups
    as this run's, or wait for tasks never issued. Raises RunConflict saying
    how to start clean. `<prefix>:config_hash` tells the workers which config
    the run trains with (opsd.service.consume_forever checks it).
    """
    id_file = run_dir / "run_id"
    if not id_file.exists():
        tmp = run_dir / f".run_id.{os.getpid()}.tmp"
        tmp.write_text(secrets.token_hex(8))
        tmp.replace(id_file)
    run_id = id_file.read_text().strip()
    owner = backoff.retry(lambda: client.get(names.owner))
    if owner is None:
        backoff.retry(lambda: set_changed(client, names.owner, run_id, nx=True))
        owner = backoff.retry(lambda: client.get(names.owner))
    if owner is not None and owner.decode() != run_id:
        raise RunConflict(
            f"Redis already holds stream prefix {names.prefix!r} for another run (its run id {owner.decode()}, this run "
            f"directory's {run_id}): start with another run directory name or set redis.stream_prefix, or delete the "
            f"old run's keys: redis-cli --scan --pattern '{names.prefix}:*' | xargs redis-cli del (if it is this "
            f"same run and its run_id file was lost: redis-cli get {names.owner} > {id_file})"
        )
    backoff.retry(lambda: set_changed(client, names.config_hash, config_hash))
    return run_id


def set_changed(client: redis.Redis, key: str, value: str | int, nx: bool = False) -> None:
    """SET `key` to `value` (only if unset with `nx`) unless it holds that already.

    A full Redis (maxmemory, noeviction) refuses every SET, even one that changes nothing: a restarted trainer,
    the reader that frees memory, must get through its start without writing. Raises RedisFullError (Redis
    refused a change: nothing written) or redis.RedisError.
    """
    if client.get(key) == str(value).encode():
        return
    try:
        client.set(key, value, nx=nx)
    except redis.ResponseError as e:
        raise full_error(e, f"setting {key}") from e



def mark_active(client: redis.Redis, names: StreamNames, run_id: str | None, backoff: "Backoff") -> None:
    """`run_id`: make `names.active` a list of exactly one entry, `run_id`; None: delete it (the run is DONE).

    KEDA's `redis` list scaler reads LLEN of this key (k8s/): 1 keeps the workers up while the run trains,
    0 lets them scale to zero after DONE. Written as DEL + RPUSH in one MULTI/EXEC, so no reader ever sees
    0 or 2 entries from a restarted trainer writing it again; nothing is written when it holds that already.
    Redis connection errors and a full Redis are ridden out with `backoff` (given up once the trainer is
    stopping: the next start writes it again).
    """
    def write():
        if run_id is None:
            client.delete(names.active)  # alone, not in MULTI: a full Redis refuses everything queued in one
            return
        if client.type(names.active) == b"list" and client.lrange(names.active, 0, -1) == [run_id.encode()]:
            return  # a restart on a full Redis, which would refuse the MULTI: nothing to change
        pipe = client.pipeline(transaction=True)
        pipe.delete(names.active)
        pipe.rpush(names.active, run_id)
        try:
            pipe.execute()
        except redis.ResponseError as e:
            raise full_error(e, f"marking the run active in {names.active}") from e

    backoff.retry(write)


class DeadLetters:
    """The groups the run's dead-letter stream reports (field `group_id`, set by `StreamQueue.dead_letter`).

    `poll()` reads entries added since the last call; `take(gid)` returns
    (reason, error) of the newest unhandled dead letter of `gid`, once; `lost` counts the jobs lost since this
    trainer started without a group id (their entry deleted from a stream while pending: reason "deleted").
    """

    def __init__(self, client: redis.Redis, dead_stream: str):
        self.client, self.stream = client, dead_stream
        self.last = "0-0"  # from the start: a restarted trainer sees what died before it
        self.unhandled: dict[str, tuple[str, str]] = {}
        self.lost = 0
        # Lost jobs count from this trainer's start: a restarted one must not re-issue for old deletions again.
        self.since_ms = int(time.time() * 1000)

    def poll(self) -> None:
        """Read new dead letters (at most a few hundred a call). Raises redis.RedisError."""
        for _ in range(4):
            entries = self.client.xrange(self.stream, f"({self.last}", "+", count=64)
            for entry_id, fields in entries:
                self.last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                gid = fields.get(b"group_id", b"").decode(errors="replace")
                if gid:
                    self.unhandled[gid] = (fields.get(b"reason", b"").decode(errors="replace"),
                                           fields.get(b"error", b"").decode(errors="replace"))
                elif fields.get(b"reason") == b"deleted" and int(self.last.split("-")[0]) >= self.since_ms:
                    self.lost += 1
            if len(entries) < 64:
                return

    def take(self, gid: str) -> tuple[str, str] | None:
        return self.unhandled.pop(gid, None)




def _task(msg) -> TaskGroup:
    """The TaskGroup of a RolloutGroup or ScoredGroup."""
    return msg.rollout.task if hasattr(msg, "rollout") else msg.task


class Collector:
    """The trainer's delivered groups from delivery to acknowledgement (module docstring).

    queue: the StreamQueue of the trainer's input (rollouts or scored);
    max_staleness: k, the largest accepted `trainer version - group version`;
    applied / counts: restored from a checkpoint (`TrainerState`);
    newest_published: the newest policy version published so far (a resumed trainer may have published
      versions past its checkpoint's); a group claiming a newer one was made by no policy of this run.
    """

    def __init__(self, queue: StreamQueue, max_staleness: int, applied: list[str] | None = None,
                 counts: dict[str, int] | None = None, role: str = "trainer", newest_published: int = 0):
        self.queue = queue
        self.max_staleness = max_staleness
        self.role = role
        self.newest_published = newest_published
        self.applied: list[str] = list(applied or [])
        self._applied_ids = {key.rsplit("@v", 1)[0] for key in self.applied}
        self.counts = {"trained": 0, "dropped_stale": 0, "dropped_duplicate": 0, "dropped_future": 0, **(counts or {})}
        self.buffer: dict[str, tuple[str, object]] = {}  # group id -> (entry id, message)
        self.trained: list[str] = []  # entry ids trained on, held until a checkpoint covers them
        self.to_ack: list[str] = []  # entry ids to acknowledge (dropped, or covered by a checkpoint)
        self.last_staleness = 0  # max (trainer version - group version) of the last step taken

    def held(self) -> list[str]:
        """Entry ids this collector holds (pending for this consumer, not to be reclaimed)."""
        return [eid for eid, _ in self.buffer.values()] + self.trained + self.to_ack

    def poll(self, version: int, step: int, block_ms: int, reclaim_idle_ms: int, count: int = 8) -> None:
        """Refresh held entries, ack what waits for it, then take in up to `count` reclaimed and `count` new deliveries.

        version: the trainer's policy version now; step: the next step to
        train. Raises redis.RedisError; state stays consistent (call again).
        """
        self.queue.keep_alive(self.held())
        self.flush()
        for d in self.queue.reclaim(reclaim_idle_ms, count) + self.queue.consume(block_ms, count):
            self.offer(d, version, step)
        self.flush()

    def offer(self, d: Delivery, version: int, step: int) -> str:
        """Classify one delivery; returns "held" (an entry already held), "buffered", "duplicate", "stale" or
        "future".

        In this order: future if its policy version is newer than any published (`version` and
        `newest_published`: no policy of this run made it); duplicate if its group was trained before (in
        `applied`, any version: a step trains each of its tasks once); stale
        if more than max_staleness versions behind `version`; duplicate if
        another entry of it is buffered; stale if its step is already trained
        (it was never one of that step's tasks). Dropped entries are queued
        for ack (`flush`), counted and logged.
        """
        eid, gid = d.entry_id, d.msg.group_id
        if eid in self.held():
            return "held"  # re-claimed after a long step: still ours, nothing new
        task = _task(d.msg)
        lag = version - task.policy_version
        self.newest_published = max(self.newest_published, version)
        if task.policy_version > self.newest_published:
            reason, why = "future", f"policy version {task.policy_version} was never published (newest {self.newest_published})"
        elif gid in self._applied_ids:
            reason, why = "duplicate", f"already trained ({self._applied_key(gid)})"
        elif lag > self.max_staleness:
            reason, why = "stale", f"policy version {task.policy_version} is {lag} behind {version} (max {self.max_staleness})"
        elif gid in self.buffer:
            reason, why = "duplicate", f"entry {self.buffer[gid][0]} of it is buffered"
        elif task.step < step:
            reason, why = "stale", f"its step {task.step} is already trained and it was not one of its tasks"
        else:
            self.buffer[gid] = (eid, d.msg)
            return "buffered"
        self._drop(eid, gid, reason, why)
        return reason

    def _applied_key(self, gid: str) -> str:
        return next(key for key in reversed(self.applied) if key.rsplit("@v", 1)[0] == gid)

    def take(self, group_ids: list[str], step: int, version: int) -> list | None:
        """The messages of `group_ids` in that order once all are buffered (else None, nothing changes).

        They move to `trained` (held until `release_trained`) and into
        `applied` as "group_id@v<group version>"; buffered groups of `step` or
        earlier that are not among them are dropped as stale. Also sets the
        GROUP_STALENESS gauge; `last_staleness` is the step's max lag.
        """
        if any(gid not in self.buffer for gid in group_ids):
            return None
        msgs = []
        self.last_staleness = 0
        for gid in group_ids:
            eid, msg = self.buffer.pop(gid)
            msgs.append(msg)
            self.trained.append(eid)
            v = _task(msg).policy_version
            self.applied.append(f"{gid}@v{v}")
            self._applied_ids.add(gid)
            self.last_staleness = max(self.last_staleness, version - v)
        self.counts["trained"] += len(msgs)
        for gid, (eid, msg) in list(self.buffer.items()):
            if _task(msg).step <= step:
                del self.buffer[gid]
                self._drop(eid, gid, "stale", f"not one of step {step}'s tasks")
        metrics.GROUP_STALENESS.labels(self.role).set(self.last_staleness)
        return msgs

    def release_trained(self, count: int | None = None) -> None:
        """A checkpoint now covers the first `count` trained groups (None: every one): queue their entries for
        ack (see `flush`). Groups trained after that checkpoint began stay held."""
        n = len(self.trained) if count is None else count
        self.to_ack += self.trained[:n]
        self.trained = self.trained[n:]

    def flush(self) -> int:
        """Acknowledge the queued entries; returns how many Redis still had pending for this consumer.

        Raises redis.RedisError; the entries not acknowledged yet stay queued.
        """
        done = 0
        while self.to_ack:
            done += int(self.queue.ack(self.to_ack[0]))
            self.to_ack.pop(0)
        return done

    def _drop(self, eid: str, gid: str, reason: str, why: str) -> None:
        self.counts[f"dropped_{reason}"] += 1
        metrics.GROUPS_DROPPED.labels(self.role, reason).inc()
        log.warning("dropped group %s (entry %s) as %s: %s", gid, eid, reason, why)
        self.to_ack.append(eid)


class Backoff:
    """Waits after a Redis connection failure or a full Redis: 1 s, doubling to 30 s; `reset` after a success.

    beat: called before each wait (the trainer's `Liveness.beat`): riding out a Redis outage is not a hang.
    """

    def __init__(self, role: str, stop: threading.Event, first_s: float = 1.0, max_s: float = REDIS_RETRY_WAIT_MAX_S,
                 beat: Callable[[], None] = lambda: None):
        self.role, self.stop, self.first_s, self.max_s, self.beat = role, stop, first_s, max_s, beat
        self.delay = first_s

    def wait(self, error: Exception) -> None:
        """Log and count the failure (a full Redis is no reconnect), then sleep (returns early when `stop` is set)."""
        self.beat()
        if not isinstance(error, RedisFullError):
            metrics.REDIS_RECONNECTS.labels(self.role).inc()
        log.warning("redis unavailable (%s: %s); retrying in %.0fs", type(error).__name__, error, self.delay)
        self.stop.wait(self.delay)
        self.delay = min(self.delay * 2, self.max_s)

    def reset(self) -> None:
        self.delay = self.first_s

    def retry(self, fn):
        """fn() until it succeeds without a Redis connection error; None if it failed once `stop` was set.

        Always tries at least once, so a stopping trainer still acks what its last checkpoint covers.
        """
        while True:
            try:
                out = fn()
            except REDIS_ERRORS as e:
                if self.stop.is_set():
                    log.warning("redis unavailable while stopping (%s); left for the next start", e)
                    return None
                self.wait(e)
                continue
            self.reset()
            return out


def wait_for_groups(stop: threading.Event, cfg, issuer: TaskIssuer, collector: Collector, backoff: Backoff,
                    dead: DeadLetters, group_ids: list[str], step: int, version: int,
                    beat: Callable[[], None] = lambda: None) -> list | None:
    """Issue what the window allows and collect until every group of `group_ids` (step `step`) is here.

    `beat` is called every round (about every redis.block_ms): waiting for groups, however long, is not a hang.

    Returns their messages in `group_ids` order, or None when `stop` was set.
    A group dead-lettered by a worker has its task issued again, at most
    redis.max_deliveries times (then StepFailed, with the dead letter's reason).
    Redis connection failures are ridden out with `backoff` (state kept).
    After `cfg.run.step_timeout_s` without all groups, the missing ones are issued again once (a job can
    vanish without a trace: an entry deleted from a stream in a way no worker saw); TimeoutError after a
    second `step_timeout_s`.
    """
    deadline = time.monotonic() + cfg.run.step_timeout_s
    rescued = False
    reissued: dict[str, int] = {}
    while not stop.is_set():
        beat()
        try:
            issuer.top_up(step, version)  # every round: a Redis that lost its data must get the tasks again
            msgs = collector.take(group_ids, step, version)
            if msgs is not None:
                return msgs
            # A group whose job was dead-lettered never arrives by itself: issue its task again, a few times.
            dead.poll()
            for gid in group_ids:
                died = dead.take(gid) if gid not in collector.buffer else None
                if died is None:
                    continue
                reissued[gid] = reissued.get(gid, 0) + 1
                if reissued[gid] > cfg.redis.max_deliveries:
                    raise StepFailed(f"step {step}: group {gid} was dead-lettered {reissued[gid]} times; "
                                     f"last reason {died[0]}: {died[1][:500]}")
                log.warning("group %s was dead-lettered (%s: %s); issuing its task again (%d/%d)",
                            gid, died[0], died[1][:200], reissued[gid], cfg.redis.max_deliveries)
                issuer.reissue(step, {gid}, version)
            collector.poll(version, step, cfg.redis.block_ms, cfg.redis.reclaim_idle_ms)
            if dead.lost:  # a job deleted while pending names no group: issue the step's missing ones again
                lost = dead.lost
                issuer.reissue_missing(step, set(collector.buffer), version)
                dead.lost -= lost  # only once it is done: a Redis error above keeps the count for the next round
            collector.queue.depth()
            backoff.reset()
        except REDIS_ERRORS as e:
            backoff.wait(e)
        if time.monotonic() > deadline and not rescued:
            # Lost without any trace (a job deleted in a way no worker could report): issue it again, once.
            rescued = True
            deadline = time.monotonic() + cfg.run.step_timeout_s
            log.warning("step %d: groups %s did not arrive within %.0f s; issuing them again once", step,
                        sorted(set(group_ids) - set(collector.buffer)), cfg.run.step_timeout_s)
            backoff.retry(lambda: issuer.reissue_missing(step, set(collector.buffer), version))
        elif time.monotonic() > deadline:
            missing = sorted(set(group_ids) - set(collector.buffer))
            raise TimeoutError(
                f"step {step}: groups {missing} did not arrive within {cfg.run.step_timeout_s:.0f}s "
                f"(see the dead-letter stream {collector.queue.dead_stream} and the workers' logs)"
            )
    return None
