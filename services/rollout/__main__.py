"""Run the rollout role: `python -m services.rollout --config C --run-dir D`.

Reads TaskGroups from `<prefix>:tasks`, plays G sibling episodes with the
task's policy version, writes a RolloutGroup to `<prefix>:rollouts`. With
`rollout.max_groups_in_flight` K > 1 it holds up to K groups at once, each
episode on its own through one shared engine (services/rollout/inflight.py),
one policy version at a time (opsd.weights.VersionGate); with K = 1 it plays
one group at a time in lockstep (services/rollout/episodes.py).
"""

from __future__ import annotations

import logging
import time
import zlib
from functools import partial

from opsd import metrics
from opsd.auth import api_token
from opsd.chat import ChatFormat
from opsd.envs import EnvContext
from opsd.queue import StreamNames
from opsd.service import RoleProcess, consume_forever, embedder_url, fatal, load_worker_backend
from opsd.types import RolloutGroup, TaskGroup
from opsd.models import load_engine
from opsd.weights import VersionGate, ensure_version
from opsd.weights_http import weight_source
from services.rollout.episodes import run_group
from services.rollout.inflight import play_group

ROLE = "rollout"


def env_context(cfg, run_dir) -> EnvContext:
    """This role's EnvContext: the game cache, and for Search the embedder's /retrieve (found like the teacher finds it)."""
    retriever = None
    if cfg.env.name == "search":
        from opsd.envs.search import HTTPRetriever

        retriever = HTTPRetriever(lambda: embedder_url(run_dir), api_token(), cfg.teacher.embedder_timeout_s,
                                  retry_s=cfg.teacher.embedder_deadline_s)
    return EnvContext(cache_dir=cfg.cache_root, retriever=retriever)


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg
    log = logging.getLogger(ROLE)
    proc.serve(port=cfg.rollout.metrics_port)

    proc.unready = "loading the model"
    backend = load_worker_backend(ROLE, cfg)
    chat = ChatFormat.for_env(backend.tokenizer, cfg.env, cfg.model)
    ctx = env_context(cfg, proc.run_dir)
    metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
    streams = StreamNames(cfg.redis.stream_prefix)
    proc.unready = "waiting for Redis"
    queue = proc.open_queue(streams.tasks, TaskGroup, backend.vocab_size)
    proc.status.update(policy_version=backend.policy_version)
    if cfg.simulate.enabled:
        log.warning("simulated compute: each group is held for %.2f s (simulate.rollout_s), model %s", cfg.simulate.rollout_s, cfg.model.name)

    def version_switched(drain_s: float, load_s: float) -> None:
        metrics.VERSION_SWITCH_SECONDS.labels(ROLE, "drain").observe(drain_s)
        metrics.VERSION_SWITCH_SECONDS.labels(ROLE, "load").observe(load_s)
        metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
        proc.status["policy_version"] = backend.policy_version
        log.info("switched to policy version %d: drained in %.2f s, loaded in %.2f s", backend.policy_version,
                 drain_s, load_s)

    in_flight = cfg.groups_in_flight("rollout")
    try:  # weights.transport: the run dir's files, or the trainer over HTTP
        source = weight_source(cfg, proc.run_dir)
    except (RuntimeError, ValueError) as e:  # http without OPSD_API_TOKEN, a bad OPSD_WEIGHTS_TRANSPORT
        fatal(ROLE, str(e))
    # Liveness guards (opsd.probes): an engine call or a version load that never returns fails /livez.
    engine_guard = partial(proc.liveness.guard, "engine generate", cfg.probes.generate_s)
    load_guard = partial(proc.liveness.guard, "policy version load", cfg.probes.generate_s)
    engine = gate = None
    if in_flight > 1:
        engine = load_engine(backend, cfg.rollout.batch_size, cfg.rollout.kv_cache_mb << 20)
        gate = VersionGate(engine, source, on_switch=version_switched, guard=load_guard)
        metrics.watch_engine(ROLE, engine, proc.stop)
        log.info("holding up to %d groups in flight", in_flight)
    proc.check_engine(backend, engine)  # ready (/readyz) once the engine the groups use answered
    log.info("ready: consuming %s", streams.tasks)

    def play(task: TaskGroup, seed: int):
        if gate is None:
            t0 = time.perf_counter()
            with load_guard():
                switched = ensure_version(backend, source, task.policy_version)
            if switched:  # one group at a time: nothing to drain
                version_switched(0.0, time.perf_counter() - t0)
            return run_group(task, backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed, ctx=ctx,
                             guard=engine_guard)
        with gate.serving(task.policy_version):
            return play_group(task, engine, backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed, ctx,
                              guard=engine_guard)

    def handle(task: TaskGroup) -> RolloutGroup:
        seed = cfg.run.seed * 1_000_003 + task.step * 1009 + zlib.crc32(task.group_id.encode()) % 1000
        group, stats = play(task, seed)
        if cfg.simulate.enabled:  # simulated compute (opsd.config.SimulateSection): the group takes rollout_s in all
            proc.stop.wait(max(0.0, cfg.simulate.rollout_s - group.rollout_seconds))
            group.rollout_seconds = max(group.rollout_seconds, cfg.simulate.rollout_s)
        metrics.GROUPS.labels(ROLE).inc()
        metrics.TOKENS.labels(ROLE).inc(stats.generated_tokens)
        metrics.ENV_SECONDS.labels(ROLE).inc(stats.env_seconds)
        metrics.JOB_SECONDS.labels(ROLE).observe(group.rollout_seconds)
        n_turns = max(stats.turns, 1)
        # Invalid = no well-formed action, or one the environment did not accept (spec section 0).
        metrics.INVALID_ACTION_RATE.labels(ROLE).set(1.0 - (stats.valid_turns - stats.env_invalid_actions) / n_turns)
        metrics.SUCCESS_RATE.labels(ROLE).set(stats.wins / max(len(group.trajectories), 1))
        if stats.nonfinite_logprobs:
            metrics.NONFINITE_LOGPROBS.labels(ROLE).inc(stats.nonfinite_logprobs)
        log.info("group %s: %d wins / %d, %d/%d valid turns, %.1fs", task.group_id, stats.wins,
                 len(group.trajectories), stats.valid_turns, stats.turns, group.rollout_seconds)
        return group

    consume_forever(proc, queue, streams.rollouts, handle, cfg.redis.reclaim_idle_ms, cfg.redis.block_ms,
                    out_group="teacher" if cfg.needs_teacher else "trainer", max_in_flight=in_flight)
    if engine is not None and engine is not backend:
        engine.close()
    log.info("stopped")


if __name__ == "__main__":
    main()
