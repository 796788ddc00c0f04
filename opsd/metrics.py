"""Prometheus metrics shared by the roles (one registry per process).

Names are `opsd_<what>_<unit>`; every role labels its own series with
`role`. The Grafana dashboard (deploy/) may only query names defined here.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

GROUPS = Counter("opsd_groups_total", "Groups a role finished", ["role"])
TOKENS = Counter("opsd_tokens_total", "Tokens a role processed (generated, scored or trained on)", ["role"])
MESSAGES_REJECTED = Counter(
    "opsd_messages_rejected_total", "Malformed or oversized messages moved to the dead-letter stream", ["role", "stream", "reason"]
)
MESSAGES_RECLAIMED = Counter("opsd_messages_reclaimed_total", "Pending entries re-claimed from dead consumers", ["role", "stream"])
QUEUE_DEPTH = Gauge("opsd_queue_depth", "Entries in a stream not yet delivered to the consumer group (lag)", ["stream"])
QUEUE_PENDING = Gauge("opsd_queue_pending", "Entries delivered but not yet acknowledged", ["stream"])
POLICY_VERSION = Gauge("opsd_policy_version", "Policy version the role currently holds", ["role"])
STEP_SECONDS = Gauge("opsd_step_seconds", "Last step's wall time by phase (waiting for input vs computing)", ["role", "phase"])
JOB_SECONDS = Histogram("opsd_job_seconds", "Seconds spent on one job (a group)", ["role"], buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800))
TEACHER_STUDENT_GAP = Gauge("opsd_teacher_student_gap", "Mean teacher minus student log-prob over loss tokens (nats)", ["role"])
PRIVILEGED_SIGNAL = Gauge(
    "opsd_privileged_signal", "Teacher-student gap on turns taking the privileged hint's action minus on the others "
    "(nats/token, last step; near 0: the teacher ignores its privileged context)", ["role"])
TEACHER_VERIFIER_DISAGREEMENT = Gauge(
    "opsd_teacher_verifier_disagreement_ratio", "Teacher vs verifier ranking of a group's responses (last step, macro "
    "mean over groups with distinct rewards): diagnostic=pairwise (share of reward-ordered pairs the teacher orders "
    "the other way) or top1 (share of the teacher's top responses below the best reward); bucket = prompt length",
    ["role", "diagnostic", "bucket"])
TEACHER_VERIFIER_GAP = Gauge(
    "opsd_teacher_verifier_preference_gap_nats", "Mean teacher score (teacher - student, nats/token) of the better "
    "response minus the worse one over a group's reward-ordered pairs (last step, macro mean; < 0: the teacher prefers "
    "the worse response)", ["role", "bucket"])
SUCCESS_RATE = Gauge("opsd_success_rate", "Fraction of episodes won in the last step", ["role"])
INVALID_ACTION_RATE = Gauge("opsd_invalid_action_rate", "Fraction of turns without a valid action in the last step", ["role"])
MEAN_SPAN_LENGTH = Gauge("opsd_mean_span_length_turns", "Mean AlignOPSD span length in turns (last step)", ["role"])
CREDIT_EVENTS = Counter("opsd_credit_events_total", "Edge cases the credit code handled (e.g. turns without loss tokens)", ["role", "event"])
EMBEDDER_FALLBACKS = Counter("opsd_embedder_fallbacks_total", "Groups scored with identity views because the embedder failed", ["role"])
NONFINITE_LOGPROBS = Counter("opsd_nonfinite_logprobs_total", "Log-probs that came out NaN/inf and were masked", ["role"])
GROUPS_DROPPED = Counter(
    "opsd_groups_dropped_total", "Groups the trainer did not train on: too stale, already applied (a redelivery), or claiming a policy version "
    "never published (future)", ["role", "reason"]
)
GROUP_STALENESS = Gauge("opsd_group_staleness_versions", "Largest policy-version lag of the groups in the last step", ["role"])
BACKPRESSURE_SECONDS = Counter(
    "opsd_backpressure_seconds_total", "Seconds a producer waited because its output stream's lag was over the bound", ["role", "stream"]
)
REDIS_RECONNECTS = Counter("opsd_redis_reconnects_total", "Redis connection losses a role rode out (retried with backoff)", ["role"])
SAMPLER_MISMATCH_KL = Gauge(
    "opsd_sampler_mismatch_kl", "KL(sampler || trainer) estimate on the last step's loss tokens (k3, nats/token)", ["role"]
)
REFERENCE_KL = Gauge(
    "opsd_reference_kl", "KL(policy || reference) estimate on the last step's loss tokens (trainer.kl_estimator, nats/token; "
    "only with trainer.kl_coef > 0)", ["role"]
)
TRACKER_ERRORS = Counter(
    "opsd_tracker_errors_total", "Calls to an experiment tracker (run.report_to) that failed; training went on without them",
    ["role", "tracker"])
GROUPS_IN_FLIGHT = Gauge("opsd_groups_in_flight", "Groups a worker holds now (at most its max_groups_in_flight)", ["role"])
ENGINE_REQUESTS = Gauge("opsd_engine_requests", "Requests in the worker's inference engine, by state (running, waiting)",
                        ["role", "state"])
KV_CACHE_USAGE = Gauge("opsd_kv_cache_usage_ratio", "Share of the engine's KV-cache budget in use", ["role"])
PREFIX_CACHE_HIT_RATE = Gauge(
    "opsd_prefix_cache_hit_ratio", "Prompt tokens served from the engine's prefix cache / prompt tokens looked up, "
    "since the engine started", ["role"])
ENV_SECONDS = Counter("opsd_env_seconds_total", "Seconds episodes spent waiting on their environments (start, steps)",
                      ["role"])
VERSION_SWITCH_SECONDS = Histogram(
    "opsd_version_switch_seconds", "A worker's switch to another policy version: draining the groups of the old one "
    "(drain), loading the new weights (load)", ["role", "phase"], buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
HTTP_REJECTED = Counter("opsd_http_rejected_total", "HTTP requests refused before the handler (auth, size)", ["role", "status"])


def init_series(role: str) -> None:
    """Create `role`'s event counters at 0 when the role starts.

    A labelled counter has no series until its first increment, and Prometheus's
    rate()/increase() need a sample before the jump: without a 0 first, the first
    Redis outage or embedder fallback of a run would never show on the dashboard.
    """
    for counter in (GROUPS, TOKENS, REDIS_RECONNECTS):
        counter.labels(role)
    if role == "rollout":
        NONFINITE_LOGPROBS.labels(role)
    if role == "teacher":
        EMBEDDER_FALLBACKS.labels(role)
    if role == "embedder":
        for status in ("401", "413"):
            HTTP_REJECTED.labels(role, status)
    if role == "trainer":
        for reason in ("duplicate", "stale", "future"):
            GROUPS_DROPPED.labels(role, reason)


def watch_engine(role: str, engine, stop, period_s: float = 1.0) -> None:
    """Export `engine.stats()` (opsd.models.engine.EngineStats) to the engine gauges every `period_s` until
    `stop` (a threading.Event) is set. Runs in a daemon thread of its own (returns at once)."""
    import threading

    running, waiting = ENGINE_REQUESTS.labels(role, "running"), ENGINE_REQUESTS.labels(role, "waiting")
    kv, hits = KV_CACHE_USAGE.labels(role), PREFIX_CACHE_HIT_RATE.labels(role)

    def loop() -> None:
        while True:
            s = engine.stats()
            running.set(s.running)
            waiting.set(s.waiting)
            kv.set(s.kv_cache_usage)
            hits.set(s.prefix_hit_rate)
            if stop.wait(period_s):
                return

    threading.Thread(target=loop, name=f"{role}-engine-stats", daemon=True).start()
