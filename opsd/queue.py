"""Redis Streams work queues: produce, consume in a consumer group, ack, reclaim, dead-letter.

One stream per hop (`StreamNames`), one consumer group per stream (the role
that reads it), one entry per message with a single field `data` holding
`opsd.wire` bytes. Delivery is at-least-once: an entry stays pending until
acknowledged, and entries of a dead consumer are re-claimed by a live one
(`reclaim`; a live consumer protects long-held entries with `keep_alive`).
A consumer acknowledges an input only together with writing its output
(`produce_then_ack`), so a crash replays work and never loses it, and an input
re-claimed by another consumer yields one output, not two.

A Redis at `maxmemory` with policy noeviction refuses every write that
would add memory (acks and deletes still pass): the writes here then raise
`RedisFullError` having written nothing, so the caller may retry them.

Bad entries (undecodable, oversized, delivered too often) go to the
dead-letter stream with the error and the raw bytes, and are acknowledged:
they never crash or stall a worker.

Work streams are never trimmed: an entry leaves its stream only once
acknowledged (or dead-lettered); only the dead-letter stream has a MAXLEN.
Producers keep streams bounded by waiting instead (`wait_for_room`:
backpressure). Every output written by `produce_then_ack` also increments the
field `produced:<stream>` of the run's counts hash (`StreamNames.counts`) in
the same atomic step, so totals can be checked against what was consumed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from opsd import wire
from opsd.types import MessageError, MessageLimits, check_limits
from opsd.metrics import BACKPRESSURE_SECONDS, MESSAGES_RECLAIMED, MESSAGES_REJECTED, QUEUE_DEPTH, QUEUE_PENDING

# A job's entry deleted from its stream while a consumer held it (an operator's XDEL/XTRIM, a producer's MAXLEN):
# its data is gone, so the dead letter names no group; the trainer issues its step's missing groups again.
DELETED_ERROR = "entry deleted from the stream while pending (XDEL/XTRIM/MAXLEN): its data is gone"
DEAD_MAXLEN = 1000  # dead letters kept (approximately); they hold whole raw messages
RECLAIM_SCAN_ROUNDS = 100  # XAUTOCLAIM calls per reclaim(): bounds one scan of a long pending list
log = logging.getLogger(__name__)


class RedisFullError(redis.OutOfMemoryError):
    """Redis refused a write because its memory is at `maxmemory` (policy noeviction); nothing was written.

    Safe to retry: readers free memory as they acknowledge (acks and deletes are never refused).
    """


def full_error(e: redis.ResponseError, what: str) -> redis.ResponseError:
    """`e` as a RedisFullError naming `what` was refused, if it is Redis's OOM refusal; else `e` itself.

    Redis replies OOM (redis-py's OutOfMemoryError), except Redis 6.2 from inside a script: an ERR quoting it.
    """
    if not isinstance(e, redis.OutOfMemoryError) and "OOM command not allowed" not in str(e):
        return e
    return RedisFullError(
        f"Redis is full (used memory over maxmemory, policy noeviction): {what} was refused, nothing was "
        f"written. It passes once readers acknowledge (which frees memory); if it lasts, give Redis more "
        f"memory or hold fewer groups in flight (k8s/README.md, 'Redis memory and disk'). Redis said: {e}")


@dataclass(frozen=True)
class StreamNames:
    """The keys of one run: streams `<prefix>:tasks|rollouts|scored|dead`, hash `<prefix>:counts`, strings `owner`,
    `config_hash`, list `active`."""

    prefix: str

    @property
    def tasks(self) -> str:
        return f"{self.prefix}:tasks"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.prefix}:scored"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def counts(self) -> str:
        """Hash of counters: field `produced:<stream>` = outputs written to that stream by produce_then_ack."""
        return f"{self.prefix}:counts"

    @property
    def owner(self) -> str:
        """String: the run id of the run that owns this prefix (set once by its trainer)."""
        return f"{self.prefix}:owner"

    @property
    def config_hash(self) -> str:
        """String: the trainer's `opsd.config.config_hash`; workers with another config refuse jobs."""
        return f"{self.prefix}:config_hash"

    @property
    def active(self) -> str:
        """List of exactly one entry (the run id) while the run's trainer has not finished, absent after DONE:
        KEDA's `redis` list scaler reads its LLEN to keep workers up during a run and scale them to zero after."""
        return f"{self.prefix}:active"


@dataclass(frozen=True)
class Delivery:
    """One decoded entry handed to this consumer.

    entry_id: the stream entry id ("<ms>-<seq>"), to pass to ack/produce_then_ack;
    msg: the decoded, validated message; deliveries: how many times the entry
    has been delivered, this time included (1 = first time); raw: the entry's
    bytes as stored (for `dead_letter`, which keeps them).
    """

    entry_id: str
    msg: Any
    deliveries: int
    raw: bytes = field(default=b"", repr=False)


# Acknowledge KEYS[1]'s entry ARGV[3] for group ARGV[1] (and delete it if
# ARGV[4] == '1'); if fields follow (ARGV[6..], name/value pairs) first append
# them to KEYS[2] (trimmed to about ARGV[5] entries unless ARGV[5] is ''), and
# with KEYS[3] count the output in that hash; all only while consumer ARGV[2]
# still owns the entry. A Lua script runs atomically like MULTI/EXEC, and can
# also make the write conditional: a slow consumer whose entry was re-claimed
# (or already acknowledged by an earlier attempt whose reply was lost) writes
# and counts nothing, so no output is doubled. A failing script is not rolled
# back, so every check comes before the first write and XADD (which fails on a
# wrong key type) before the counter and XACK: a failed write leaves the input
# pending and nothing counted.
_FINISH = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return {0, ''} end
local out = ''
if #ARGV > 5 then
  if KEYS[3] then
    local t = redis.call('TYPE', KEYS[3])['ok']
    if t ~= 'none' and t ~= 'hash' then
      return redis.error_reply('WRONGTYPE counts key ' .. KEYS[3] .. ' holds a ' .. t .. ', not a hash')
    end
  end
  if ARGV[5] == '' then
    out = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 6))
  else
    out = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
  end
  if KEYS[3] then redis.call('HINCRBY', KEYS[3], 'produced:' .. KEYS[2], 1) end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], ARGV[3]) end
return {1, out}
"""

# Reset the idle time of the entries ARGV[3..] that consumer ARGV[2] still owns,
# without counting a delivery (JUSTID); never takes an entry from another consumer. An entry deleted from the
# stream (XDEL/XTRIM) is left alone: Redis 7's XCLAIM would drop it from the pending list, so the holder's
# output would be refused and nobody would know; left idle, the next reclaim reports it as deleted.
_TOUCH = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] and #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# Redis < 7 reports no `lag` in XINFO GROUPS: count the entries after the
# group's last delivered id on the server (the values never cross the network).
_LAG = """
local n, cursor = 0, '(' .. ARGV[1]
while true do
  local r = redis.call('XRANGE', KEYS[1], cursor, '+', 'COUNT', 1000)
  n = n + #r
  if #r < 1000 then return n end
  cursor = '(' .. r[#r][1]
end
"""


def produce_message(client: redis.Redis, stream: str, msg: Any, max_bytes: int) -> str:
    """Encode `msg` and append it to `stream` (field `data`); returns the new entry id.

    Raises WireError (invalid, or more than `max_bytes` bytes: nothing written),
    RedisFullError (Redis at maxmemory: nothing written) or redis.RedisError.
    """
    data = wire.encode(msg, max_bytes)
    try:
        return _s(client.xadd(stream, {"data": data}))
    except redis.ResponseError as e:
        raise full_error(e, f"adding an entry to {stream}") from e


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamQueue:
    """A consumer-group reader of one stream carrying messages of class `cls`.

    client: a redis-py sync client with bytes replies (`opsd.redis_server.connect`);
    stream/group/consumer: the stream key, the group (one per reading role)
    and this worker's unique consumer name; role: metric label;
    max_bytes: message size limit (both ways); dead_stream: where bad entries go;
    max_deliveries: an entry delivered more often than this is dead-lettered
    by `reclaim` (a poison message that keeps killing workers);
    raises ValueError for max_deliveries < 1 or a client decoding replies to str;
    delete_on_ack: delete entries once acknowledged, which bounds Redis memory
    (entries can be MBs); turn off only if a second group reads the stream;
    vocab_size: when given, messages holding a token id >= vocab_size are
    dead-lettered (passed to the message's `validate`), so a consumer never
    indexes an embedding out of range; counts_key: the run's counts hash
    (`StreamNames.counts`), where `produce_then_ack` counts its outputs
    (None: not counted); limits: the run's `MessageLimits` (opsd.types.check_limits), past which a decoded
    message is dead-lettered with reason "over_limits" (None: only the wire's fixed bounds).

    A consumer group that disappeared (Redis restarted without persistence,
    or the group was destroyed) is re-created on the next call instead of
    raising NOGROUP forever: entries it held are gone, so ack/keep_alive
    report them as not held.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        cls: type,
        role: str,
        max_bytes: int,
        dead_stream: str,
        max_deliveries: int = 3,
        delete_on_ack: bool = True,
        vocab_size: int | None = None,
        counts_key: str | None = None,
        limits: MessageLimits | None = None,
    ):
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("StreamQueue needs a client with bytes replies (decode_responses=False): messages are binary")
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.cls = cls
        self.role = role
        self.max_bytes = max_bytes
        self.dead_stream = dead_stream
        self.max_deliveries = max_deliveries
        self.delete_on_ack = delete_on_ack
        self.vocab_size = vocab_size
        self.limits = limits
        self.counts_key = counts_key
        self._finish = client.register_script(_FINISH)
        self._lag = client.register_script(_LAG)
        self._touch = client.register_script(_TOUCH)

    # ------------------------------------------------------------ setup and producing

    def ensure_group(self) -> None:
        """Create the stream (if missing) and the consumer group (if missing).

        The group starts at id 0, so entries produced before any consumer
        started are delivered too. Raises RedisFullError (Redis at maxmemory, the group missing: nothing
        written) or redis.RedisError on other failures.
        """
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" in str(e):
                return
            full = full_error(e, f"creating consumer group {self.group} on {self.stream}")
            # A full Redis refuses the create before it sees the group exists: a restarted reader (the one that
            # would free memory) must still start.
            if isinstance(full, RedisFullError) and self._group_exists():
                return
            raise full from e

    def _group_exists(self) -> bool:
        try:
            return any(_s(g["name"]) == self.group for g in self.client.xinfo_groups(self.stream))
        except redis.ResponseError:  # no such stream
            return False

    def _lost_group(self, e: redis.ResponseError) -> bool:
        """True (after re-creating the group) if `e` says the stream or group is gone."""
        if "NOGROUP" not in str(e):
            return False
        log.warning("consumer group %r on %r vanished (Redis restarted?); re-creating it", self.group, self.stream)
        self.ensure_group()
        return True

    def produce(self, msg: Any) -> str:
        """Append `msg` to this queue's stream; returns the entry id. Raises like `produce_message`."""
        return produce_message(self.client, self.stream, msg, self.max_bytes)

    def produce_to(self, stream: str, msg: Any) -> str:
        """Append `msg` to another stream (e.g. the trainer's tasks) with this queue's size limit; returns the entry id."""
        return produce_message(self.client, stream, msg, self.max_bytes)

    # ------------------------------------------------------------ consuming

    def consume(self, block_ms: int, count: int = 1) -> list[Delivery]:
        """Read up to `count` new entries, waiting at most `block_ms` ms (0 = do not wait).

        Returns the valid ones (possibly none); bad entries are dead-lettered,
        acknowledged and counted in MESSAGES_REJECTED, never raised. The
        returned entries stay pending until `ack`/`produce_then_ack`.
        Raises ValueError if `block_ms` is not below the client's socket
        timeout, redis.RedisError if Redis fails.
        """
        timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is not None and block_ms / 1000 >= timeout:
            raise ValueError(f"block_ms={block_ms} must stay below the socket timeout ({timeout} s): see connect()")
        try:
            reply = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms if block_ms > 0 else None
            )
        except redis.ResponseError as e:
            if self._lost_group(e):
                return []
            raise
        out = []
        for entry_id, fields in _entries(reply):
            delivery = self._decode(_s(entry_id), fields, deliveries=1)
            if delivery is not None:
                out.append(delivery)
        return out

    def reclaim(self, min_idle_ms: int, count: int = 10) -> list[Delivery]:
        """Take over up to `count` entries pending (unacknowledged) for at least `min_idle_ms` ms.

        These are entries of consumers that died or hung, and this consumer's
        own idle ones (a job whose handler failed is retried, also with a
        single worker); protect entries still in use with `keep_alive`. Each
        re-claim counts as a delivery. Entries already
        delivered more than `max_deliveries` times, and undecodable ones, are
        dead-lettered (counted in MESSAGES_REJECTED) instead of returned; the
        others are counted in MESSAGES_RECLAIMED. Raises redis.RedisError.
        """
        claimed: list[tuple[bytes, dict | None]] = []
        cursor = "0-0"
        for _ in range(RECLAIM_SCAN_ROUNDS):
            try:
                reply = self.client.xautoclaim(
                    self.stream, self.group, self.consumer, min_idle_ms, cursor, count=count - len(claimed)
                )
            except redis.ResponseError as e:
                if self._lost_group(e):
                    return []
                raise
            cursor = _s(reply[0])
            claimed += reply[1]
            for entry_id in reply[2] if len(reply) > 2 else []:  # Redis 7: deleted ids, already out of the PEL
                self._report_deleted(_s(entry_id))
            if cursor == "0-0" or len(claimed) >= count:
                break
        if any(entry_id is None for entry_id, _ in claimed):
            self._ack_deleted_pending()
        claimed = [(entry_id, fields) for entry_id, fields in claimed if entry_id is not None]
        if not claimed:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry_id, _ in claimed:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        pending = pipe.execute()
        out = []
        for (entry_id, fields), info in zip(claimed, pending):
            if not info or _s(info[0]["consumer"]) != self.consumer:
                continue  # acknowledged meanwhile, or taken by another consumer
            entry_id = _s(entry_id)
            deliveries = int(info[0]["times_delivered"])
            if deliveries > self.max_deliveries:
                self.dead_letter(
                    entry_id, fields.get(b"data", b""), f"too many deliveries ({deliveries} > {self.max_deliveries})",
                    "too_many_deliveries",
                )
                continue
            delivery = self._decode(entry_id, fields, deliveries)
            if delivery is not None:
                MESSAGES_RECLAIMED.labels(role=self.role, stream=self.stream).inc()
                out.append(delivery)
        return out

    def _ack_deleted_pending(self) -> None:
        # Redis < 7 answers XAUTOCLAIM with a nil, id-less entry for a pending
        # entry deleted from the stream (trimmed by hand), and keeps it pending
        # forever. Find this consumer's pending ids that no longer exist: dead-letter them (acknowledged).
        pending = self.client.xpending_range(self.stream, self.group, "-", "+", 1000, consumername=self.consumer)
        for p in pending:
            if not self.client.xrange(self.stream, p["message_id"], p["message_id"]):
                entry_id = _s(p["message_id"])
                if self.dead_letter(entry_id, b"", DELETED_ERROR, "deleted"):
                    log.warning("%s: pending entry %s was deleted from the stream (XDEL/XTRIM?): its job is lost, "
                                "dead-lettered so the trainer issues it again", self.stream, entry_id)

    def _report_deleted(self, entry_id: str) -> None:
        """A pending entry deleted from the stream that Redis 7's XAUTOCLAIM dropped from the pending list: say so
        in the dead-letter stream (no data, no group id: the trainer issues the missing groups again), count, log."""
        self.client.xadd(self.dead_stream, {
            "source_stream": self.stream, "entry_id": entry_id, "error": DELETED_ERROR, "reason": "deleted",
            "role": self.role, "group": self.group, "consumer": self.consumer, "data": b"", "group_id": ""},
            maxlen=DEAD_MAXLEN, approximate=True)
        MESSAGES_REJECTED.labels(role=self.role, stream=self.stream, reason="deleted").inc()
        log.warning("%s: pending entry %s was deleted from the stream (XDEL/XTRIM?): its job is lost, dead-lettered "
                    "so the trainer issues it again", self.stream, entry_id)

    def _decode(self, entry_id: str, fields: dict, deliveries: int) -> Delivery | None:
        raw = fields.get(b"data")
        if raw is None:
            names = sorted(_s(k) for k in fields)
            self.dead_letter(entry_id, b"", f"entry has no 'data' field (fields: {names})", "malformed")
            return None
        try:
            msg = wire.decode(raw, self.cls, self.max_bytes, vocab_size=self.vocab_size)
        except wire.WireError as e:
            self.dead_letter(entry_id, raw, str(e), e.reason)
            return None
        if self.limits is not None:
            try:
                check_limits(msg, self.limits)
            except MessageError as e:
                self.dead_letter(entry_id, raw, f"{self.cls.__name__}: over this run's limits: {e}", "over_limits")
                return None
        return Delivery(entry_id, msg, deliveries, raw)

    def dead_letter(self, entry_id: str, raw: bytes, error: str, reason: str) -> bool:
        """Move entry `entry_id`, held by this consumer, to the dead-letter stream and acknowledge it.

        The dead-letter entry keeps `raw` (the original bytes), `error`
        (first 2000 characters), `reason` (a short label, also the
        MESSAGES_REJECTED label), and where it came from (source_stream,
        entry_id, role, group, consumer). Both happen in one server-side step
        and only while this consumer owns the entry, so a retry after a lost
        reply adds no second dead letter. Returns False, changing nothing, if
        the entry is not pending for this consumer. Raises RedisFullError (Redis
        at maxmemory: nothing written, the entry stays pending) or redis.RedisError.
        """
        fields = {
            "source_stream": self.stream, "entry_id": entry_id, "error": error[:2000], "reason": reason,
            "role": self.role, "group": self.group, "consumer": self.consumer, "data": raw,
            # So the trainer can re-issue a dead-lettered group's task ("" when the bytes do not decode).
            "group_id": self._group_id(raw),
        }
        args = [self.group, self.consumer, entry_id, int(self.delete_on_ack), DEAD_MAXLEN]
        for name, value in fields.items():
            args += [name, value]
        try:
            done, _ = self._finish(keys=[self.stream, self.dead_stream], args=args)
        except redis.ResponseError as e:
            if self._lost_group(e):
                return False
            raise full_error(e, f"dead-lettering {self.stream}'s entry {entry_id} (it stays pending)") from e
        if done:
            MESSAGES_REJECTED.labels(role=self.role, stream=self.stream, reason=reason).inc()
        return bool(done)

    def _group_id(self, raw: bytes) -> str:
        try:
            return str(wire.decode(raw, self.cls, self.max_bytes).group_id)
        except Exception:  # malformed bytes are exactly what gets dead-lettered: no id then
            return ""

    # ------------------------------------------------------------ finishing

    def ack(self, entry_id: str) -> bool:
        """Acknowledge (and with delete_on_ack delete) an entry this consumer holds.

        Returns False, changing nothing, if the entry is not pending for this
        consumer (already acknowledged, or re-claimed by another consumer,
        which will finish it). Raises redis.RedisError.
        """
        args = [self.group, self.consumer, entry_id, int(self.delete_on_ack)]
        try:
            done, _ = self._finish(keys=[self.stream, self.stream], args=args)
        except redis.ResponseError as e:
            if self._lost_group(e):
                return False
            raise
        return bool(done)

    def produce_then_ack(self, out_stream: str, msg: Any, entry_id: str) -> str | None:
        """Append `msg` to `out_stream` and acknowledge input `entry_id`, atomically.

        Both happen in one server-side step, and only if this consumer still
        owns the input: returns the output entry id, or None if nothing was
        written (the input was re-claimed by another consumer, or already
        acknowledged, e.g. by an earlier attempt of this call that lost its
        reply; either way its output exists or will). With a counts key, the
        same step adds 1 to its field `produced:<out_stream>`. Work streams
        are never trimmed here. Raises WireError (invalid/oversized `msg`,
        nothing written), RedisFullError (Redis at maxmemory: nothing written
        or counted, the input stays pending: retry it) or redis.RedisError
        (nothing written or counted).
        """
        data = wire.encode(msg, self.max_bytes)
        keys = [self.stream, out_stream] + ([self.counts_key] if self.counts_key else [])
        try:
            done, out_id = self._finish(
                keys=keys, args=[self.group, self.consumer, entry_id, int(self.delete_on_ack), "", "data", data]
            )
        except redis.ResponseError as e:
            if self._lost_group(e):
                return None
            raise full_error(e, f"writing to {out_stream} (input {entry_id} of {self.stream} stays pending)") from e
        return _s(out_id) if done else None

    def keep_alive(self, entry_ids: list[str]) -> int:
        """Mark entries this consumer still works on (or holds) as fresh, so `reclaim` leaves them alone.

        Resets their idle time to 0 ms without counting a delivery. Call it
        more often than every `min_idle_ms` for a job that may run longer, and
        for entries held across a wait (the trainer's step). Entries now owned
        by another consumer are left untouched. Returns how many were
        refreshed. Raises redis.RedisError.
        """
        if not entry_ids:
            return 0
        try:
            return int(self._touch(keys=[self.stream], args=[self.group, self.consumer, *entry_ids]))
        except redis.ResponseError as e:
            if self._lost_group(e):
                return 0
            raise

    # ------------------------------------------------------------ monitoring

    def depth(self) -> tuple[int, int]:
        """(lag, pending) of this group: entries not yet delivered, and delivered but unacknowledged.

        Also sets the QUEUE_DEPTH and QUEUE_PENDING gauges of this stream.
        Returns (0, 0) if the stream does not exist; re-creates the group if
        the stream exists without it (see the class docstring); raises
        redis.RedisError otherwise.
        """
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                return 0, 0
            raise
        info = next((g for g in groups if _s(g["name"]) == self.group), None)
        if info is None:
            log.warning("consumer group %r on %r vanished (Redis restarted?); re-creating it", self.group, self.stream)
            self.ensure_group()
            groups = self.client.xinfo_groups(self.stream)
            info = next(g for g in groups if _s(g["name"]) == self.group)
        lag, pending = self._group_lag(self.stream, info), int(info["pending"])
        QUEUE_DEPTH.labels(stream=self.stream).set(lag)
        QUEUE_PENDING.labels(stream=self.stream).set(pending)
        return lag, pending

    def _group_lag(self, stream: str, info: dict) -> int:
        lag = info.get("lag")
        if lag is None:  # Redis < 7, or a lag Redis 7 cannot compute (deletions after the group's position)
            lag = self._lag(keys=[stream], args=[_s(info["last-delivered-id"])])
        return int(lag)

    def stream_lag(self, stream: str, group: str) -> int:
        """Entries of `stream` not yet delivered to consumer group `group` (any stream, e.g. this role's output).

        0 if the stream does not exist; its length if the group does not
        exist yet (its reader has not started: everything is undelivered).
        Creates nothing. Raises redis.RedisError.
        """
        try:
            groups = self.client.xinfo_groups(stream)
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                return 0
            raise
        info = next((g for g in groups if _s(g["name"]) == group), None)
        if info is None:
            return int(self.client.xlen(stream))
        return self._group_lag(stream, info)

    def wait_for_room(
        self, stream: str, group: str, max_lag: int, stop: threading.Event, poll_s: float = 0.2,
        on_poll: Callable[[], None] = lambda: None,
    ) -> bool:
        """Backpressure: wait while `stream_lag(stream, group)` exceeds `max_lag` entries.

        Call it before taking work whose output goes to `stream`, so a fast
        producer waits for its slower reader instead of growing the stream
        without bound (streams are never trimmed). Polls every `poll_s`
        seconds, calling `on_poll` each time (a worker's liveness beat: a
        slow reader downstream is no hang of this one); the seconds waited are added to
        BACKPRESSURE_SECONDS{role, stream} as they pass. Returns True when
        there is room, False if `stop` was set while waiting. Raises
        ValueError for max_lag < 1 or poll_s <= 0, redis.RedisError if Redis fails.
        """
        if max_lag < 1 or poll_s <= 0:
            raise ValueError(f"need max_lag >= 1 and poll_s > 0, got {max_lag}, {poll_s}")
        waited = BACKPRESSURE_SECONDS.labels(role=self.role, stream=stream)
        while self.stream_lag(stream, group) > max_lag:
            on_poll()
            t0 = time.monotonic()
            stopped = stop.wait(poll_s)
            waited.inc(time.monotonic() - t0)
            if stopped:
                return False
        return True


def _entries(reply: Any) -> list[tuple[bytes, dict]]:
    """The (id, fields) pairs of an XREADGROUP reply for one stream, RESP2 or RESP3 shaped."""
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3: {stream: [[(id, fields), ...]]}
        (batches,) = reply.values()
        return [e for batch in batches for e in batch]
    return reply[0][1]  # RESP2: [[stream, [(id, fields), ...]]]
