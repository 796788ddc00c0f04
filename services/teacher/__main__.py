"""Run the teacher role: `python -m services.teacher --config C --run-dir D`.

Reads RolloutGroups from `<prefix>:rollouts`, scores them with the privileged
teacher (teacher.source self: the group's own policy version; model: a frozen
external model of the student's tokenizer, checked at start), writes ScoredGroups to
`<prefix>:scored`. Finds the embedder (AlignOPSD) through the
OPSD_EMBEDDER_URL environment variable or `<run_dir>/ports/embedder.json`,
looked up again for every group: the teacher starts and keeps scoring
(identity views only, counted in opsd_embedder_fallbacks_total) while the
embedder is down, and uses it again once it is back. Calls it with the
run's OPSD_API_TOKEN, without which it refuses to start. With a method that
needs no teacher (grpo) it stays idle: it serves /health and consumes nothing.
"""

from __future__ import annotations

import logging
import time
import sys
from functools import partial

from opsd import metrics
from opsd.auth import api_token
from opsd.chat import ChatFormat
from opsd.config import RunConfig
from opsd.models import check_teacher_model
from opsd.queue import StreamNames
from opsd.service import FATAL_EXIT, RoleProcess, consume_forever, embedder_url, fatal, load_worker_backend
from opsd.types import RolloutGroup, ScoredGroup
from opsd.weights import VersionGate, ensure_version
from opsd.weights_http import weight_source
from services.teacher.scoring import EmbedderAuthError, EmbedderClient, score_group

ROLE = "teacher"


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg
    log = logging.getLogger(ROLE)
    if not cfg.needs_teacher:
        _serve_idle(proc, log)
        return
    token = None
    if cfg.run.method == "alignopsd":
        try:
            token = api_token()
        except RuntimeError as e:  # before loading the model: fail in a second, with the reason
            fatal(ROLE, str(e))
    proc.serve(port=cfg.teacher.metrics_port)

    proc.unready = "loading the model"
    external = cfg.teacher.source == "model"
    if external:
        try:
            check_teacher_model(cfg.model, cfg.teacher_model)
        except (ValueError, OSError) as e:
            fatal(ROLE, str(e))
    backend = load_worker_backend(ROLE, cfg, cfg.teacher_model)
    chat = ChatFormat.for_env(backend.tokenizer, cfg.env, cfg.model)
    metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
    embedder = None
    if token:
        embedder = EmbedderClient(lambda: embedder_url(proc.run_dir), token, cfg.teacher.embedder_timeout_s,
                                  cfg.teacher.embedder_deadline_s)
    streams = StreamNames(cfg.redis.stream_prefix)
    proc.unready = "waiting for Redis"
    queue = proc.open_queue(streams.rollouts, RolloutGroup, backend.vocab_size)
    proc.status.update(policy_version=backend.policy_version)
    _log_teacher_version(cfg, log)
    if cfg.simulate.enabled:
        log.warning("simulated compute: each group is held for %.2f s (simulate.teacher_s), model %s", cfg.simulate.teacher_s, cfg.model.name)

    def version_switched(drain_s: float, load_s: float) -> None:
        metrics.VERSION_SWITCH_SECONDS.labels(ROLE, "drain").observe(drain_s)
        metrics.VERSION_SWITCH_SECONDS.labels(ROLE, "load").observe(load_s)
        metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
        proc.status["policy_version"] = backend.policy_version

    # Several groups in flight: each in a job thread, one policy version at a time. On vLLM their requests
    # batch in the engine; on transformers they take turns on the model (HFBackend.lock) while the others
    # wait on the embedder.
    in_flight = cfg.groups_in_flight("teacher")
    # weights.transport: the run dir's files, or the trainer over HTTP; ema:D scores with the trainer's average.
    try:
        source = weight_source(cfg, proc.run_dir, ema=cfg.teacher_ema is not None)
    except (RuntimeError, ValueError) as e:  # http without OPSD_API_TOKEN, a bad OPSD_WEIGHTS_TRANSPORT
        fatal(ROLE, str(e))
    # Liveness guards (opsd.probes): a scoring pass or a version load that never returns fails /livez.
    engine_guard = partial(proc.liveness.guard, "teacher scoring pass", cfg.probes.generate_s)
    load_guard = partial(proc.liveness.guard, "policy version load", cfg.probes.generate_s)
    gate = VersionGate(backend, source, version_switched, guard=load_guard) if in_flight > 1 else None
    if in_flight > 1:
        log.info("holding up to %d groups in flight", in_flight)
        if hasattr(backend, "stats"):  # an engine of its own (vLLM)
            metrics.watch_engine(ROLE, backend, proc.stop)
    proc.check_engine(backend)  # ready (/readyz) once the model answered
    log.info("ready: consuming %s", streams.rollouts)

    def score(group: RolloutGroup):
        # An external or frozen teacher's version is always 0, the weights it started with: it never loads.
        version = cfg.teacher_version(group.task.policy_version)
        if gate is None:
            t0 = time.perf_counter()
            with load_guard():
                switched = ensure_version(backend, source, version)
            if switched:  # one group at a time: nothing to drain
                version_switched(0.0, time.perf_counter() - t0)
            return score_group(group, backend, chat, cfg, embedder, engine_guard)
        with gate.serving(version):
            return score_group(group, backend, chat, cfg, embedder, engine_guard)

    def handle(group: RolloutGroup) -> ScoredGroup:
        try:
            scored, stats = score(group)
        except EmbedderAuthError as e:
            # A refused token fails every group alike: stop the run with the reason (the job stays pending).
            log.error("%s", e)
            sys.exit(FATAL_EXIT)
        if cfg.simulate.enabled:  # simulated compute (opsd.config.SimulateSection): the group takes teacher_s in all
            proc.stop.wait(max(0.0, cfg.simulate.teacher_s - scored.teacher_seconds))
            scored.teacher_seconds = max(scored.teacher_seconds, cfg.simulate.teacher_s)
        metrics.GROUPS.labels(ROLE).inc()
        metrics.TOKENS.labels(ROLE).inc(stats.scored_tokens)
        metrics.JOB_SECONDS.labels(ROLE).observe(scored.teacher_seconds)
        if stats.gap_tokens:
            metrics.TEACHER_STUDENT_GAP.labels(ROLE).set(stats.gap_sum / stats.gap_tokens)
        log.info("group %s: %d sources matched (%d dropped), gap %.3f nats/token, %.1fs", group.group_id, stats.sources,
                 stats.dropped_sources, stats.gap_sum / max(stats.gap_tokens, 1), scored.teacher_seconds)
        return scored

    consume_forever(proc, queue, streams.scored, handle, cfg.redis.reclaim_idle_ms, cfg.redis.block_ms, out_group="trainer",
                    max_in_flight=in_flight)
    log.info("stopped")


def _serve_idle(proc: RoleProcess, log: logging.Logger) -> None:
    """A method without a teacher (grpo): serve /health, /metrics and the probes until stopped, consume nothing.

    Rollouts go straight to the trainer; a teacher reading them (a compose or k8s stack that starts every
    role) would take and delete the trainer's groups."""
    cfg = proc.cfg
    proc.status.update(idle=True, reason=f"run.method {cfg.run.method} needs no teacher")
    proc.unready = None  # it has nothing to serve: a rolling update need not wait for it
    proc.serve(port=cfg.teacher.metrics_port)
    log.info("run.method %s needs no teacher: idle (serving /health, /metrics and the probes only)", cfg.run.method)
    while not proc.stop.wait(1.0):
        proc.liveness.beat()


def _log_teacher_version(cfg: RunConfig, log: logging.Logger) -> None:
    """Say which weights score when they are not the group's own policy version (an external or older teacher)."""
    if cfg.teacher.source == "model":
        log.info("external teacher %s (%s, frozen: never reloaded on policy versions)", cfg.teacher_model.name,
                 cfg.teacher_model.backend)
    elif cfg.teacher.version != "live":
        log.info("self teacher, version %s (%s)", cfg.teacher.version,
                 "the initial policy" if cfg.teacher.version == "frozen" else "the trainer's moving average of the policy"
                 if cfg.teacher_ema is not None else "the policy that many versions before the group's")


if __name__ == "__main__":
    main()
