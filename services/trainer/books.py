"""The trainer's books of a finished run: were all groups issued, trained once, or accounted for?

    python -m services.trainer.books --run-dir /data/runs/quickstart [--config /app/configs/quickstart.yaml]

Prints the report (`accounting`) as JSON and exits 1 when it lists a violation, 2 when it cannot be
made (no checkpoint, Redis unreachable). Reads the run's Redis at REDIS_URL, as the roles do; inside a
role container that is `docker compose exec trainer python -m services.trainer.books --run-dir ...`
(scripts/compose_check.py does this after killing a worker). `--config` for a run started by a
deployment, whose run directory holds no config.yaml (`opsd run` writes one). The fault tests
(tests/soak.py, tests/test_faults.py) check their runs with the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

from opsd.config import RunConfig
from opsd.queue import StreamNames


def dead_letters(client, names: StreamNames) -> list[dict]:
    """The dead-letter stream's entries: reason, source stream and (when its bytes decode) the group id."""
    from opsd import wire
    from opsd.types import RolloutGroup, ScoredGroup, TaskGroup

    classes = {names.tasks: TaskGroup, names.rollouts: RolloutGroup, names.scored: ScoredGroup}
    out = []
    for _, fields in client.xrange(names.dead):
        source = fields.get(b"source_stream", b"").decode()
        gid = None
        if source in classes:
            try:
                gid = wire.decode(fields.get(b"data", b""), classes[source], 1 << 30).group_id
            except wire.WireError:
                pass
        out.append({"reason": fields.get(b"reason", b"").decode(), "source": source, "group_id": gid})
    return out


def accounting(run_dir: Path, client, config: Path | None = None) -> dict:
    """The books of a finished run: its Redis counts hash and dead letters against its final checkpoint.

    run_dir: the run directory (checkpoint/, logs/); client: a redis-py client (bytes replies) on the
    run's Redis; config: the run's config (default <run_dir>/config.yaml; its stream prefix, if unset,
    is derived from the run directory's name as the roles do). Returns a dict with `violations`: one
    line per broken invariant (tests/soak.py's docstring), [] if none.
    Raises FileNotFoundError without a checkpoint.
    """
    from opsd.envs import EnvContext, get_adapter
    from services.trainer.controller import step_tasks
    from services.trainer.report import read_metrics

    run_dir = Path(run_dir)
    cfg = RunConfig.load(config or run_dir / "config.yaml")
    cfg.redis.stream_prefix = cfg.redis.stream_prefix or f"opsd:{run_dir.resolve().name}"
    names = StreamNames(cfg.redis.stream_prefix)
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    counts = {k.decode(): int(v) for k, v in client.hgetall(names.counts).items()}
    applied = [key.rsplit("@v", 1)[0] for key in state["applied"]]
    trained = set(applied)
    games = get_adapter(cfg.env.name).make_tasks(cfg.env, EnvContext(cache_dir=cfg.cache_root), "train")
    issued = {t.group_id for s in range(cfg.run.steps) for t in step_tasks(cfg, games, s, 0)}
    dead = dead_letters(client, names)
    dead_ids = {d["group_id"] for d in dead if d["group_id"]}
    input_stream = names.scored if cfg.needs_teacher else names.rollouts
    produced = {s.rsplit(":", 1)[1]: counts.get(f"produced:{s}", 0) for s in (names.tasks, names.rollouts, names.scored)}
    stale = int(state["counts"].get("dropped_stale", 0))
    trainer_log = run_dir / "logs" / "trainer.log"
    logged_duplicates = trainer_log.read_text(errors="replace").count(" as duplicate: ") if trainer_log.exists() else 0
    summary_path = run_dir / "run_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    report = {
        "steps_trained": state["step"], "steps": cfg.run.steps, "finished": (run_dir / "DONE").exists(),
        "produced": produced, "trained": len(trained), "applied_entries": len(applied),
        "dropped_stale": stale,
        "redeliveries_deduplicated": {"checkpoint": int(state["counts"].get("dropped_duplicate", 0)),
                                      "trainer_log": logged_duplicates},
        "dead_lettered": dict(Counter(d["reason"] for d in dead)), "restarts": summary.get("restarts", {}),
        "embedder_fallbacks": sum(int(r.get("embedder_fallbacks") or 0) for r in read_metrics(run_dir)),
    }
    violations = []
    if not report["finished"] or state["step"] != cfg.run.steps:
        violations.append(f"run not finished: checkpoint at step {state['step']} of {cfg.run.steps}, DONE {report['finished']}")
    if produced["tasks"] != len(issued):
        violations.append(f"tasks issued {produced['tasks']} != {len(issued)} (run.steps x env.num_games)")
    n_in = produced[input_stream.rsplit(":", 1)[1]]
    if n_in != len(trained) + stale:
        violations.append(f"produced into {input_stream} {n_in} != trained {len(trained)} + dropped stale {stale}")
    if len(applied) != len(trained):
        twice = sorted(g for g, n in Counter(applied).items() if n > 1)
        violations.append(f"groups trained more than once: {twice}")
    if trained - issued:
        violations.append(f"trained groups that were never issued: {sorted(trained - issued)}")
    unaccounted = issued - trained - dead_ids
    if len(unaccounted) > stale:
        violations.append(f"issued groups neither trained, dead-lettered nor dropped as stale: {sorted(unaccounted)}")
    report["violations"] = violations
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=None, help="the run's config (default RUN_DIR/config.yaml)")
    args = ap.parse_args(argv)
    from opsd.redis_server import connect

    try:
        client = connect(os.environ["REDIS_URL"], 0)
        report = accounting(args.run_dir, client, args.config)
    except Exception as e:  # no REDIS_URL, checkpoint or config; Redis unreachable or refusing the password
        print(f"books: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, sort_keys=True))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
