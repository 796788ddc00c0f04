"""Transport: pipeline messages through the roles' Redis path, next to redis-benchmark on the same server.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transport.py [--quick] [--json OUT] [--step-seconds 190]

Messages are real `opsd.types` messages with valid arrays and text, built from
a fixed seed:
- ALFWorld scale (the papers' setting): G = 8 trajectories x 50 turns in the
  think format, ~500 prompt ids, ~96 response ids (a ~60-word thinking + the
  action) and ~48 observation ids a turn, ~7,700 ids a trajectory. The
  RolloutGroup (rollout -> teacher) and the ScoredGroup built on it (teacher
  -> trainer: teacher and corrected log-probs and entropies per token, the
  400 x 400 similarity and eligibility, 2 matched sources per turn and their
  cross log-probs; no embeddings, which only `--dump-credit` runs send).
- quickstart size (configs/quickstart.yaml): G = 4 x 4 turns in the action
  format, ~300 prompt ids, ~12 response ids, ~70 observation ids a turn
  (a rendered quickstart prompt is 211 ids with a short observation); its
  TaskGroup, RolloutGroup and ScoredGroup.

Each message goes the way a role sends and takes it: `opsd.queue.produce_message`
(wire.encode with validation, XADD), `StreamQueue.consume` (XREADGROUP, wire.decode
with validation), `StreamQueue.ack` (the roles' Lua step: ownership check, XACK,
XDEL), one message at a time from one process, against a real redis-server
(`opsd.redis_server.LocalRedis`) configured as `opsd run` configures it:
append-only file, fsync on every write (`--no-appendonly`: none). Figures:
messages/s and MB/s (encoded bytes) over `--messages` messages after one
warm-up, with encode / decode / Redis milliseconds per message. Every decoded
message is re-encoded and must equal the original byte for byte (the
self-check row; the script exits 1 otherwise).

redis-benchmark (Debian `redis-tools`; `make bench` installs it) runs on the
same server with one client: SET and GET of a value of the ALFWorld
RolloutGroup's encoded size, i.e. the same bytes in and out of Redis. Its
message-equivalent rate is 1 / (1/SET/s + 1/GET/s); the ratio row is our
messages/s over that (1.0 = the cost of moving the bytes through Redis alone).
Without redis-benchmark those rows have no value and say why.

Quickstart share: a quickstart step moves 2 TaskGroups (trainer -> rollout),
2 RolloutGroups (rollout -> teacher) and 2 ScoredGroups (teacher -> trainer);
their measured per-message times summed, over `--step-seconds` (default 190 s,
the fastest quickstart step in README.md's measured 190-234 s), is the share
of a step spent in transport. Target: < 2 %. Control traffic (config hash
reads, heartbeats, queue depth polls) is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import numpy as np  # noqa: E402
import redis  # noqa: E402

from benchmarks.common import Row, command_line, print_rows, write_json  # noqa: E402
from opsd import wire  # noqa: E402
from opsd.config import RedisSection  # noqa: E402
from opsd.queue import StreamQueue, produce_message  # noqa: E402
from opsd.redis_server import LocalRedis, connect  # noqa: E402
from opsd.types import RolloutGroup, ScoredGroup, TaskGroup, Trajectory, TurnRecord  # noqa: E402

VOCAB_SIZE = 49_152  # SmolLM2's vocabulary
MAX_BYTES = RedisSection().max_message_bytes
DEFAULT_STEP_S = 190.0  # README.md: quickstart steps took 190-234 s on 2 cores; the fastest gives the largest share
TARGET_SHARE = "< 2 %"
WORDS = ("the", "apple", "is", "probably", "in", "fridge", "so", "I", "should", "go", "to", "countertop", "first",
         "then", "open", "it", "and", "take", "mug", "clean", "with", "sinkbasin", "before", "putting", "on",
         "coffeemachine", "task", "requires", "a", "cool", "object", "check", "cabinet", "drawer", "next")
ACTIONS = ("go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to countertop 2",
           "clean mug 1 with sinkbasin 1", "put mug 1 in/on coffeemachine 1", "look", "inventory")


@dataclass(frozen=True)
class Shape:
    """Sizes of one group's messages: G trajectories of `turns` turns; ids per prompt / response / observation."""

    name: str
    G: int
    turns: int
    prompt_ids: int
    response_ids: int
    obs_ids: int
    think: bool  # think format (thinking text in every turn) or action-only
    env: str


ALFWORLD = Shape("ALFWorld", G=8, turns=50, prompt_ids=500, response_ids=96, obs_ids=48, think=True, env="alfworld")
QUICKSTART = Shape("quickstart", G=4, turns=4, prompt_ids=300, response_ids=12, obs_ids=70, think=False, env="textworld")


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=n))


def _vary(rng: np.random.Generator, n: int) -> int:
    """n +- 25%, at least 1: real turns differ in length."""
    return max(1, int(round(n * rng.uniform(0.75, 1.25))))


def make_task(shape: Shape, seed: int) -> TaskGroup:
    """The TaskGroup a trainer issues for `shape` (a game spec and ~1 KB of privileged text)."""
    rng = np.random.default_rng(seed)
    walkthrough = " > ".join(ACTIONS[i] for i in rng.integers(len(ACTIONS), size=12))
    return TaskGroup(
        group_id=f"{shape.env}-{seed:05d}-s0", task_id=f"{shape.env}-{seed:05d}", step=0, policy_version=0,
        group_size=shape.G, env=shape.env, max_turns=shape.turns, category="pick",
        game={"seed": 1234 + seed, "split": "train", "task_type": "pick_and_place", "scene": f"FloorPlan{seed % 30}",
              "goal": "put a clean mug in coffeemachine", "objects": [f"obj{i}" for i in range(20)]},
        privileged_info="[skills] " + _words(rng, 120) + "\nWalkthrough: " + walkthrough,
    )


def _hint_kw(rng: np.random.Generator) -> dict:
    # TurnRecord.hint (the remaining gold path) exists from the learning-benchmark work on; older types lack it.
    if "hint" in {f.name for f in dataclasses.fields(TurnRecord)}:
        return {"hint": [ACTIONS[i] for i in rng.integers(len(ACTIONS), size=int(rng.integers(1, 6)))]}
    return {}


def make_trajectory(shape: Shape, rollout_id: str, rng: np.random.Generator) -> Trajectory:
    """One valid episode of `shape.turns` turns: token layout prompt + (response + observation) * turns."""
    ids, mask, records = [rng.integers(3, VOCAB_SIZE, _vary(rng, shape.prompt_ids))], [], []
    mask.append(np.zeros(len(ids[0]), np.uint8))
    pos = len(ids[0])
    for k in range(shape.turns):
        n_resp = _vary(rng, shape.response_ids)
        ids.append(rng.integers(3, VOCAB_SIZE, n_resp))
        mask.append(np.ones(n_resp, np.uint8))
        action = ACTIONS[int(rng.integers(len(ACTIONS)))]
        thinking = _words(rng, _vary(rng, 60)) if shape.think else ""
        text = (f"<think>{thinking}</think>" if shape.think else "") + f"<action>{action}</action>"
        last = k == shape.turns - 1
        records.append(TurnRecord(
            turn_id=k, response_start=pos, response_end=pos + n_resp, text=text, thinking=thinking, action=action,
            format_valid=bool(rng.random() < 0.9), finish_reason="stop",
            observation="" if last else "You arrive at countertop 1. " + _words(rng, _vary(rng, 30)), **_hint_kw(rng)))
        pos += n_resp
        if not last:
            n_obs = _vary(rng, shape.obs_ids)
            ids.append(rng.integers(3, VOCAB_SIZE, n_obs))
            mask.append(np.zeros(n_obs, np.uint8))
            pos += n_obs
    token_ids = np.concatenate(ids).astype(np.int32)
    loss_mask = np.concatenate(mask)
    logprobs = np.where(loss_mask == 1, -rng.exponential(1.0, len(token_ids)), 0.0).astype(np.float32)
    entropy = np.where(loss_mask == 1, rng.uniform(0.0, 3.0, len(token_ids)), 0.0).astype(np.float32)
    won = bool(rng.random() < 0.3)
    return Trajectory(rollout_id=rollout_id, token_ids_S=token_ids, sampler_logprobs_S=logprobs, loss_mask_S=loss_mask,
                      turns=records, reward=float(won), won=won, ending="won" if won else "max_turns",
                      sampler_entropy_S=entropy)


def make_rollout_group(shape: Shape, seed: int) -> RolloutGroup:
    """G sibling trajectories of `make_task(shape, seed)`."""
    rng = np.random.default_rng(seed + 1)
    task = make_task(shape, seed)
    trajs = [make_trajectory(shape, f"{task.group_id}-r{i}", rng) for i in range(shape.G)]
    return RolloutGroup(task=task, trajectories=trajs, prompt_format="think" if shape.think else "action",
                        rollout_seconds=60.0)


def make_scored_group(shape: Shape, seed: int, top_k: int = 2) -> ScoredGroup:
    """`make_rollout_group(shape, seed)` plus the teacher's view: per-token log-probs and entropies, H and
    eligibility [M, M], `top_k` matched sources per turn with weights, rho, alpha and cross log-probs."""
    rollout = make_rollout_group(shape, seed)
    rng = np.random.default_rng(seed + 2)
    trajs = rollout.trajectories
    turns = rollout.canonical_turns()
    M = len(turns)
    teacher, corrected, entropy = [], [], []
    for t in trajs:
        on = t.loss_mask_S == 1
        teacher.append(np.where(on, (t.sampler_logprobs_S + rng.normal(0, 0.3, on.shape)).clip(max=0), 0).astype(np.float32))
        corrected.append((teacher[-1] * 0.9).astype(np.float32))
        entropy.append(np.where(on, rng.uniform(0.0, 3.0, on.shape), 0).astype(np.float32))
    owner = np.array([i for i, _ in turns])
    emb = rng.normal(size=(M, 16))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    H = (emb @ emb.T).astype(np.float32).clip(-1, 1)
    eligible = owner[:, None] != owner[None, :]
    sources, weights, cross = [], [], []
    for m, (i, k) in enumerate(turns):
        cand = [int(s) for s in np.argsort(-np.where(eligible[:, m], H[:, m], -2))[:top_k]]
        w = np.exp(H[cand, m] / 0.1)
        sources.append(cand)
        weights.append([float(x) for x in w / w.sum()])
        rec = trajs[i].turns[k]
        cross.append(-rng.exponential(1.0, (len(cand), rec.response_end - rec.response_start)).astype(np.float32))
    rho = np.array([max(w) for w in weights], np.float32)
    thinking = [trajs[i].turns[k].thinking or trajs[i].turns[k].action for i, k in turns]
    return ScoredGroup(
        rollout=rollout, teacher_version=0, teacher_logprobs_S=teacher, corrected_logprobs_S=corrected,
        teacher_thinking_M=thinking, similarity_MM=H, eligible_MM=eligible, selected_sources_M=sources,
        source_weights_M=weights, rho_M=rho, alpha_M=(0.8 * rho).astype(np.float32), teacher_seconds=50.0,
        teacher_entropy_S=entropy, teacher_response_M=[trajs[i].turns[k].text for i, k in turns],
        student_thinking_M=thinking, student_action_M=[trajs[i].turns[k].action for i, k in turns],
        teacher_action_M=[trajs[i].turns[k].action for i, k in turns], cross_logprobs_M=cross)


BUILDERS = {TaskGroup: make_task, RolloutGroup: make_rollout_group, ScoredGroup: make_scored_group}


@dataclass
class HopResult:
    """One message kind through produce -> consume -> ack: `n` messages of `mean_bytes` in `seconds`."""

    n: int
    mean_bytes: float
    seconds: float
    encode_ms: float  # median wire.encode per message
    decode_ms: float  # median wire.decode per message
    identical: bool  # every decoded message re-encodes to the original bytes

    @property
    def per_message_ms(self) -> float:
        return 1000 * self.seconds / self.n

    @property
    def messages_per_s(self) -> float:
        return self.n / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.n * self.mean_bytes / 1e6 / self.seconds


def _median_ms(fn, items: list) -> float:
    times = []
    for x in items:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def run_hop(client: redis.Redis, msgs: list, n: int) -> HopResult:
    """Send `n` messages (cycling through `msgs`, all of one class) through a fresh stream, one at a time.

    Raises RuntimeError if a message is lost, rejected or left pending.
    """
    cls = type(msgs[0])
    stream = f"bench:{uuid.uuid4().hex[:8]}:{cls.__name__}"
    queue = StreamQueue(client, stream, "bench", "consumer-1", cls, role="bench", max_bytes=MAX_BYTES,
                        dead_stream=f"{stream}:dead")
    queue.ensure_group()

    def one(msg):
        produce_message(client, stream, msg, MAX_BYTES)
        got = queue.consume(block_ms=1000, count=1)
        if len(got) != 1 or not queue.ack(got[0].entry_id):
            raise RuntimeError(f"{cls.__name__}: message not delivered once and acknowledged ({len(got)} delivered)")
        return got[0].msg

    one(msgs[0])  # warm-up: connection, script load, allocator
    received = []
    t0 = time.perf_counter()
    for i in range(n):
        received.append(one(msgs[i % len(msgs)]))
    seconds = time.perf_counter() - t0
    if client.xlen(stream) or client.xlen(f"{stream}:dead") or queue.depth() != (0, 0):
        raise RuntimeError(f"{stream}: entries left over after the run")
    client.delete(stream, f"{stream}:dead")
    encoded = [wire.encode(m, MAX_BYTES) for m in msgs]
    identical = all(wire.encode(r, MAX_BYTES) == encoded[i % len(msgs)] for i, r in enumerate(received))
    return HopResult(
        n=n, mean_bytes=float(np.mean([len(encoded[i % len(msgs)]) for i in range(n)])), seconds=seconds,
        encode_ms=_median_ms(lambda m: wire.encode(m, MAX_BYTES), msgs),
        decode_ms=_median_ms(lambda b: wire.decode(b, cls, MAX_BYTES, vocab_size=VOCAB_SIZE), encoded),
        identical=identical)


def redis_benchmark(server: LocalRedis, client: redis.Redis, size: int, requests: int,
                    exe: str | None = None) -> tuple[dict[str, float] | None, str]:
    """SET and GET requests/s of `size`-byte values from one redis-benchmark client on `server`.

    exe: the redis-benchmark executable (default: the one on PATH).
    Returns ({"SET": rps, "GET": rps}, version) or (None, the reason it could not run).
    redis-benchmark 7.0 reads no password from the environment: it logs in as a
    throwaway ACL user made for this call and deleted after it, so the run's
    password never appears on a command line.
    """
    exe = shutil.which(exe or "redis-benchmark")
    if exe is None:
        return None, "redis-benchmark not found: install Debian's redis-tools (`make bench` does)"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    user, password = f"bench-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    # redis-benchmark's keys are `key:__rand_int__` (literally, without -r): the user may touch only those.
    client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~key:*", "+@all")
    try:
        cmd = [exe, "-h", "127.0.0.1", "-p", str(server.port), "--user", user, "-a", password, "-t", "set,get",
               "-d", str(size), "-n", str(requests), "-c", "1", "--csv"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        client.execute_command("ACL", "DELUSER", user)
        client.delete("key:__rand_int__")
    rps = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            rps[cells[0]] = float(cells[1])
    if proc.returncode != 0 or set(rps) != {"SET", "GET"}:
        return None, f"redis-benchmark failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-300:]}"
    return rps, version


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer messages and redis-benchmark requests (< 60 s)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    ap.add_argument("--messages", type=int, default=None, help="messages per kind, >= 1 (default 40; --quick 5)")
    ap.add_argument("--step-seconds", type=float, default=DEFAULT_STEP_S,
                    help=f"quickstart step seconds for the share, > 0 (default {DEFAULT_STEP_S:.0f}: README's fastest)")
    ap.add_argument("--redis-benchmark", default=None, metavar="PATH",
                    help="the redis-benchmark executable (default: the one on PATH; a missing one gives rows without values)")
    ap.add_argument("--no-appendonly", action="store_true", help="Redis without the append-only file (not how runs go)")
    args = ap.parse_args()
    if not 0 < args.step_seconds < float("inf"):  # also NaN: the share divides by it
        ap.error(f"--step-seconds must be a number of seconds > 0 (got {args.step_seconds:g})")
    if args.messages is not None and args.messages < 1:
        ap.error(f"--messages must be >= 1 (got {args.messages}); leave it out for the default")
    n = args.messages if args.messages is not None else (5 if args.quick else 40)
    variants = 2 if args.quick else 4  # distinct messages per kind, cycled
    aof = not args.no_appendonly

    t_build = time.perf_counter()
    alf = {cls: [BUILDERS[cls](ALFWORLD, s) for s in range(variants)] for cls in (RolloutGroup, ScoredGroup)}
    qs = {cls: [BUILDERS[cls](QUICKSTART, s) for s in range(variants)] for cls in (TaskGroup, RolloutGroup, ScoredGroup)}
    print(f"built messages in {time.perf_counter() - t_build:.1f} s", file=sys.stderr)

    rows: list[Row] = []
    data_dir = tempfile.mkdtemp(prefix="opsd-bench-redis-")
    try:
        with LocalRedis(data_dir=data_dir, appendonly=aof) as server:
            client = connect(server.url, block_ms=2000)
            redis_note = f"redis-server {client.info('server')['redis_version']}, " + (
                "append-only file fsynced on every write (as `opsd run`)" if aof else "no persistence")
            hops = {}
            for scale, kinds in (("ALFWorld", alf), ("quickstart", qs)):
                for cls, msgs in kinds.items():
                    hops[(scale, cls)] = r = run_hop(client, msgs, n)
                    print(f"{scale} {cls.__name__}: {r.mean_bytes / 1e6:.3f} MB, {r.per_message_ms:.2f} ms/message "
                          f"(encode {r.encode_ms:.2f}, decode {r.decode_ms:.2f})", file=sys.stderr)
            ref_bytes = int(hops[("ALFWorld", RolloutGroup)].mean_bytes)
            rps, rb_info = redis_benchmark(server, client, ref_bytes, 20 if args.quick else 200,
                                           args.redis_benchmark)
            client.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)

    shape_of = {"ALFWorld": ALFWORLD, "quickstart": QUICKSTART}
    for (scale, cls), r in hops.items():
        s = shape_of[scale]
        label = f"{scale} {cls.__name__} ({r.mean_bytes / 1e6:.3g} MB; G={s.G} x {s.turns} turns)"
        redis_ms = r.per_message_ms - r.encode_ms - r.decode_ms
        note = (f"per message {r.per_message_ms:.2f} ms: encode {r.encode_ms:.2f}, decode {r.decode_ms:.2f}, "
                f"Redis and the rest {redis_ms:.2f}; {r.n} messages; {redis_note}")
        rows.append(Row(f"{label}: messages/s", r.messages_per_s, "msg/s", note=note))
        if scale == "ALFWorld":
            rows.append(Row(f"{label}: MB/s", r.mb_per_s, "MB/s", note="encoded bytes through encode-XADD-XREADGROUP-decode-XACK"))

    alf_rg = hops[("ALFWorld", RolloutGroup)]
    if rps is None:
        rows.append(Row("redis-benchmark SET+GET, same size, 1 client: MB/s", None, "MB/s", note=rb_info))
        rows.append(Row("RolloutGroup messages/s / redis-benchmark", None, "x", note=rb_info))
    else:
        ref_rate = 1.0 / (1.0 / rps["SET"] + 1.0 / rps["GET"])  # one SET + one GET = the message's bytes in and out
        rows.append(Row(f"redis-benchmark SET+GET of {ref_bytes / 1e6:.3g} MB, 1 client: MB/s", ref_rate * ref_bytes / 1e6,
                        "MB/s", note=f"SET {rps['SET']:.0f}/s, GET {rps['GET']:.0f}/s on the same server; {rb_info}"))
        rows.append(Row("ALFWorld RolloutGroup messages/s / redis-benchmark", alf_rg.messages_per_s / ref_rate, "x",
                        note="1.0 = as fast as moving the same bytes through Redis alone; the rest is encode, "
                             "decode, validation and the ack script"))

    counts = {TaskGroup: 2, RolloutGroup: 2, ScoredGroup: 2}  # quickstart: 2 groups a step
    step_ms = sum(c * hops[("quickstart", cls)].per_message_ms for cls, c in counts.items())
    rows.append(Row("quickstart step: transport time", step_ms, "ms",
                    note="2 TaskGroups + 2 RolloutGroups + 2 ScoredGroups at their measured per-message times"))
    rows.append(Row("quickstart step: transport share of step time", 100 * step_ms / 1000 / args.step_seconds, "%",
                    target=TARGET_SHARE, note=f"over a {args.step_seconds:g} s step (--step-seconds; default: the "
                                              f"fastest quickstart step measured in README.md, 190-234 s)"))
    identical = all(r.identical for r in hops.values())
    rows.append(Row("self-check: every decoded message == the original", float(identical), "bool", target="== 1",
                    note="each received message re-encoded byte-identical to what was sent"))

    print_rows(rows, width=78)
    if args.json:
        write_json(args.json, "transport", command_line(), rows)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
