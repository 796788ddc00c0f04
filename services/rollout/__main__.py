"""Run the rollout role: `python -m services.rollout --config C --run-dir D`.

Reads TaskGroups from `<prefix>:tasks`, plays G sibling episodes with the
task's policy version, writes a RolloutGroup to `<prefix>:rollouts`.
"""

from __future__ import annotations

import logging
import zlib

from opsd import metrics
from opsd.chat import ChatFormat
from opsd.queue import StreamNames
from opsd.service import RoleProcess, consume_forever, load_worker_backend
from opsd.types import RolloutGroup, TaskGroup
from opsd.weights import ensure_version
from services.rollout.episodes import run_group

ROLE = "rollout"


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg
    log = logging.getLogger(ROLE)
    proc.serve(port=cfg.rollout.metrics_port)

    backend = load_worker_backend(ROLE, cfg)
    chat = ChatFormat(backend.tokenizer, cfg.env.prompt_format)
    metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
    streams = StreamNames(cfg.redis.stream_prefix)
    queue = proc.open_queue(streams.tasks, TaskGroup, backend.vocab_size)
    proc.status.update(policy_version=backend.policy_version, ready=True)
    log.info("ready: consuming %s", streams.tasks)

    def handle(task: TaskGroup) -> RolloutGroup:
        if ensure_version(backend, proc.run_dir, task.policy_version):
            metrics.POLICY_VERSION.labels(ROLE).set(backend.policy_version)
            proc.status["policy_version"] = backend.policy_version
        seed = cfg.run.seed * 1_000_003 + task.step * 1009 + zlib.crc32(task.group_id.encode()) % 1000
        group, stats = run_group(task, backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed, cfg.cache_root)
        metrics.GROUPS.labels(ROLE).inc()
        metrics.TOKENS.labels(ROLE).inc(stats.generated_tokens)
        metrics.JOB_SECONDS.labels(ROLE).observe(group.rollout_seconds)
        n_turns = max(stats.turns, 1)
        metrics.INVALID_ACTION_RATE.labels(ROLE).set(1.0 - stats.valid_turns / n_turns)
        metrics.SUCCESS_RATE.labels(ROLE).set(stats.wins / max(len(group.trajectories), 1))
        if stats.nonfinite_logprobs:
            metrics.NONFINITE_LOGPROBS.labels(ROLE).inc(stats.nonfinite_logprobs)
        log.info("group %s: %d wins / %d, %d/%d valid turns, %.1fs", task.group_id, stats.wins,
                 len(group.trajectories), stats.valid_turns, stats.turns, group.rollout_seconds)
        return group

    consume_forever(proc, queue, streams.rollouts, handle, cfg.redis.reclaim_idle_ms, cfg.redis.block_ms,
                    out_group="teacher" if cfg.needs_teacher else "trainer")
    log.info("stopped")


if __name__ == "__main__":
    main()
