"""Run the trainer role (and the step controller): `python -m services.trainer --config C --run-dir D`.

One policy version per step. Step n: issue the tasks of steps n..n+k not
issued yet (k = run.max_staleness; k = 0 is synchronous) -> wait for step
n's groups -> wait for the checkpoint being written, ack the groups it
covers -> credit assignment -> PPO update -> publish weights v+1 -> start
writing a checkpoint in the background (every trainer.checkpoint_every steps
and the last) -> metrics.jsonl.

Started on a run dir that holds a checkpoint (`opsd run --resume`, or a
restart after a crash), it resumes from it by itself: weights, optimizer,
RNG, counters and the applied groups, at the checkpoint's step. After the
last step it writes <run_dir>/DONE, deletes the Redis list <prefix>:active it
set at start (KEDA's signal that the run is active), and keeps serving
/metrics until stopped; with OPSD_EXIT_WHEN_DONE=1 it exits 0 instead (a
Kubernetes Job completes and frees its GPUs).

Several GPUs: `torchrun --nproc-per-node N -m services.trainer --config C --run-dir D`; several
nodes: add `--nnodes M --node-rank R --master-addr A --master-port P` on each (node rank 0 holds the
run dir). Rank 0 does all of the above; ranks > 0 only take part in each PPO update
(FSDP2 on CUDA, DDP on CPU; services/trainer/distributed.py) and need no run dir.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opsd import metrics
from opsd.auth import api_token
from opsd.config import config_hash, hashed_config
from opsd.credit.diagnostics import DIAGNOSTICS
from opsd.envs import EnvContext, get_adapter
from opsd.footprint import checkpoint_interval
from opsd.models import ModelUnavailableError, resolve_model, served_dtype
from opsd.queue import StreamNames
from opsd.service import EXIT_WHEN_DONE_ENV, FATAL_EXIT, RoleProcess, fatal, load_worker_backend
from opsd.skills import privileged_text
from opsd.tracking import missing_trackers
from opsd.types import RolloutGroup, ScoredGroup
from opsd.weights import ema_path, keep_snapshot, prune_versions, published_versions, weights_path
from opsd.weights_http import weights_transport
from services.trainer.checkpoint import (
    Checkpointer, CheckpointError, TrainerState, drop_optimizer_state, resume_checkpoint, save_checkpoint,
)
from services.trainer.controller import (
    Backoff, Collector, DeadLetters, RunConflict, StepFailed, TaskIssuer, claim_prefix, lock_trainer, mark_active, set_changed,
    step_tasks, wait_for_groups,
)
from services.trainer.distributed import Parallel, World, init_from_env, parallelize, share_resume
from services.trainer.ema import CHECKPOINT_FILE as EMA_CHECKPOINT_FILE
from services.trainer.ema import PolicyEMA
from services.trainer.report import append_metrics, model_records, plot_metrics, read_metrics, summarize, write_records
from services.trainer.reference import ReferencePolicy
from services.trainer.reporting import Reporter, stage_report
from services.trainer.step import learn
from services.trainer.update import enable_gradient_checkpointing, follow
from services.trainer.weights_api import weights_app

ROLE = "trainer"
RECLAIM_AT_START = 4096  # entries claimed at once from the dead trainer consumers
log = logging.getLogger(ROLE)


def publish(backend, run_dir, client, prefix: str, version: int, keep: int, backoff: Backoff,
            snapshot_every: int = 0, ema: PolicyEMA | None = None) -> None:
    """Write policy `version`'s weights file, delete those no in-flight task can carry, set the Redis version key.

    trainer.snapshot_every: every Nth version's file is also kept in <run_dir>/snapshots/ (learning curves).
    ema (teacher.version ema:D): its average, already updated with this version, is published first beside it.
    With trainer.lora the file holds the adapter only (opsd-lora format, `backend.save_weights`); workers
    merge it onto their base weights, so names and pruning are the same in both modes.
    """
    backend.policy_version = version
    if ema is not None:
        ema.save(ema_path(run_dir, version), version, dtype=served_dtype(backend.cfg))
    backend.save_weights(weights_path(run_dir, version), dtype=served_dtype(backend.cfg))
    keep_snapshot(run_dir, version, snapshot_every)
    prune_versions(run_dir, version, keep)
    backoff.retry(lambda: set_changed(client, f"{prefix}:policy_version", version))


def check_disk(cfg, model_dir, run_dir) -> None:
    """Log the run's disk peak (opsd.footprint) and stop, fatal, when the run directory's filesystem cannot hold it
    (free space plus what the directory holds already, which the run replaces). `opsd run` checks the same before
    it starts anything; compose and k8s start the trainer directly, on a volume of a fixed size."""
    from opsd import footprint

    try:
        terms = footprint.run_disk_peak(cfg, model_dir)
    except (KeyError, ValueError, OSError) as e:  # an architecture transformers cannot build: no estimate
        log.warning("disk peak not estimated: %s", e)
        return
    held = 0
    for f in Path(run_dir).rglob("*"):
        try:
            held += f.stat().st_size if f.is_file() else 0
        except OSError:  # a file another role removed meanwhile
            pass
    free = footprint.free_bytes(Path(run_dir))
    log.info("disk peak %s; %.1f GB free at %s", footprint.describe(terms), free / footprint.GB, run_dir)
    problem = footprint.disk_problem(terms["total"], free + held, Path(run_dir))
    if problem:
        fatal(ROLE, problem)


def settle(writer: Checkpointer, collector: Collector, backoff: Backoff) -> None:
    """Wait for the checkpoint `writer` is writing (if any), then ack the groups it covers.

    Raises what the write raised (OSError): that checkpoint does not exist and its groups stay unacked."""
    covered = writer.wait()
    if covered is not None:
        collector.release_trained(covered)
        backoff.retry(collector.flush)


def trainer_max_deliveries(cfg) -> int:
    """Deliveries after which the trainer dead-letters one of its input entries (its task is then issued again,
    at most redis.max_deliveries times before the step fails with the reason).

    A group the trainer holds across a restart is delivered again once per restart, so the bound sits above
    what run.max_restarts allows (`opsd run` fails before a held group could reach it); under a platform that
    restarts without limit (docker, k8s), an entry that kills the trainer every time ends in the dead-letter
    stream instead of a crash loop."""
    return cfg.redis.max_deliveries + cfg.run.max_restarts + 1


def exit_when_done() -> bool:
    """OPSD_EXIT_WHEN_DONE: "1"/"true" -> exit 0 after DONE (a Kubernetes Job), "0"/"false"/unset -> serve on.

    Raises ValueError naming the variable for any other value."""
    value = os.environ.get(EXIT_WHEN_DONE_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true"):
        raise ValueError(f"{EXIT_WHEN_DONE_ENV}={value!r}: expected 1 or 0 (true or false)")
    return value in ("1", "true")


def main() -> None:
    try:
        train()
    except (CheckpointError, StepFailed, RunConflict) as e:
        # Restarting cannot help (a refused checkpoint or config, a group that keeps dying, another run's
        # prefix or trainer): say so and stop.
        log.error("%s: %s", type(e).__name__, e)
        sys.exit(FATAL_EXIT)


@dataclass
class _Run:
    """Rank 0's pieces of a run, wired up once by `train`: what each step and the end of the run work with."""

    proc: RoleProcess
    backend: Any
    par: Parallel
    optimizer: torch.optim.Optimizer
    reference: ReferencePolicy | None
    world: World
    ema: PolicyEMA | None
    hashed: dict
    state: TrainerState
    checkpoint_every: int
    records: list[dict]
    models: dict
    reporter: Reporter | None
    games: list
    streams: StreamNames
    client: Any
    backoff: Backoff
    issuer: TaskIssuer
    collector: Collector
    dead: DeadLetters
    keep: int
    writer: Checkpointer
    plotter: ThreadPoolExecutor
    plotting: Future | None = None
    saved_step: int = 0

    @property
    def cfg(self):
        return self.proc.cfg

    @property
    def run_dir(self) -> Path:
        return self.proc.run_dir


def train() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg, run_dir = proc.cfg, proc.run_dir
    exit_at_done = _check_launch(cfg)
    world = init_from_env(cfg.model.device)  # torchrun's ranks; a plain process is rank 0 of 1
    main = world.rank == 0
    lock = _lock_and_serve(proc) if main else None  # held until train() returns (or the process dies)
    _seed(cfg)

    proc.unready = "loading the model and its checkpoint"
    # The transformers model, fp32 master weights (bf16 compute under autocast / FSDP2's policy with model.dtype bf16)
    backend = load_worker_backend(ROLE, cfg, backend="hf", weights_dtype=torch.float32)
    if main:
        check_disk(cfg, backend.path, run_dir)
    model = backend.model
    _make_trainable(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    checkpoint_every = checkpoint_interval(cfg.trainer.checkpoint_every, sum(p.numel() for p in model.parameters()))
    optimizer = torch.optim.AdamW(trainable, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    # The KL term and ExOPD's base need the initial policy, frozen: built before a resume loads newer weights.
    reference = None
    if main and (cfg.trainer.kl_coef > 0 or (cfg.run.method == "ex_opd" and cfg.credit.ex_opd.base == "initial")):
        reference = ReferencePolicy.build(model, cfg, world)
    hashed = hashed_config(cfg)
    state, ckpt = _resume(run_dir, model, optimizer, world, hashed, cfg.run.method)
    ema = _teacher_average(model, cfg, ckpt) if main else None
    par = parallelize(world, model, optimizer, cfg.trainer.data_parallel, cfg.model.dtype)
    if not main:
        follow(par, cfg)
        return
    if par.mirror is not None:  # FSDP2 sharded `model`: publish the full copy `par.gather` keeps current
        backend.model = par.mirror
    records, models, reporter = _open_records(cfg, run_dir, state, ckpt)
    games = _training_tasks(cfg)
    run = _join_queue(proc, backend, par, optimizer, reference, world, ema, hashed, state, checkpoint_every,
                      records, models, reporter, games)
    _announce_ready(run)
    _train_steps(run)
    _finish(run, lock, exit_at_done)


def _check_launch(cfg) -> bool:
    """Stop, fatal, on a launch that cannot work (settings, tracker packages, ranks, the model); return exit_when_done()."""
    try:
        exit_at_done = exit_when_done()
    except ValueError as e:
        fatal(ROLE, str(e))
    if missing_trackers(cfg.run.report_to):  # started without `opsd run` (compose, k8s): the same one line
        fatal(ROLE, missing_trackers(cfg.run.report_to))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun
    if local != cfg.trainer.nproc_per_node:  # a silent single process would train N times slower
        fatal(ROLE, f"trainer.nproc_per_node is {cfg.trainer.nproc_per_node} but {local} rank(s) run on this node: "
                    f"start it as `torchrun --nproc-per-node {cfg.trainer.nproc_per_node} -m services.trainer ...` "
                    "(`opsd run` does; several nodes: add --nnodes, --node-rank, --master-addr, --master-port)")
    try:
        # The model's files before the process group: transformers (5.x) writes a model only on rank 0 of a world,
        # so a rank > 0 converting a packaged model (its own node's cache) would leave it without config or weights.
        resolve_model(cfg.model)
    except ModelUnavailableError as e:  # a Hub model this machine cannot have: a restart cannot help
        fatal(ROLE, str(e))
    return exit_at_done


def _lock_and_serve(proc: RoleProcess):
    """Rank 0: lock the run dir to this trainer, then serve /metrics (and the weights files over HTTP); the lock."""
    cfg = proc.cfg
    # Locked before serving: a refused second trainer must not overwrite the running one's port file.
    lock = lock_trainer(proc.run_dir)
    app = None
    try:
        if weights_transport(cfg) == "http":  # rollout and teacher fetch the published files from this app
            app = weights_app(proc.run_dir, api_token())
    except (RuntimeError, ValueError) as e:  # no OPSD_API_TOKEN, a bad OPSD_WEIGHTS_TRANSPORT
        fatal(ROLE, str(e))
    proc.serve(app, port=cfg.trainer.metrics_port)
    return lock


def _seed(cfg) -> None:
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)


def _make_trainable(model: torch.nn.Module, cfg) -> None:
    """trainer.lora and trainer.gradient_checkpointing, applied to `model` in place."""
    if cfg.trainer.lora is not None:  # in place: only the adapters train; save_weights then publishes them alone
        from opsd.lora import apply_lora

        apply_lora(model, cfg.trainer.lora)
    if cfg.trainer.gradient_checkpointing:  # before any wrapping: FSDP2/DDP then see the checkpointed layers
        enable_gradient_checkpointing(model)


def _resume(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World, hashed: dict,
            method: str) -> tuple[TrainerState, Path | None]:
    """Load the newest checkpoint that loads into `model` and `optimizer` on every rank: (state, checkpoint or None).

    A corrupt newer checkpoint falls back to an older kept one; ranks > 0 get rank 0's weights and optimizer state
    over the process group (they need no run dir: other nodes) and return the fresh state with no checkpoint."""
    state = TrainerState(method=method, config_hash=config_hash(hashed))
    ckpt = None
    if world.rank == 0:
        ckpt, resumed = resume_checkpoint(run_dir, model, optimizer, hashed)
        state = resumed or state
        if ckpt is not None:
            log.info("resuming from %s at step %d (policy version %d)", ckpt, state.step, state.policy_version)
    shared_step = share_resume(world, model, optimizer, state.step if ckpt is not None else None, config_hash(hashed))
    if world.rank != 0 and shared_step is not None:
        log.info("rank %d: resumed rank 0's checkpoint of step %d over the process group", world.rank, shared_step)
    return state, ckpt


def _teacher_average(model: torch.nn.Module, cfg, ckpt: Path | None) -> PolicyEMA | None:
    """The teacher's moving average of the policy (teacher.version ema:D; services/trainer/ema.py), resumed from `ckpt`."""
    if cfg.teacher_ema is None:
        return None
    ema = PolicyEMA(model, cfg.teacher_ema)
    if ckpt is not None and (ckpt / EMA_CHECKPOINT_FILE).is_file():
        try:
            ema.load(ckpt / EMA_CHECKPOINT_FILE)
        except Exception as e:  # safetensors' own error, ValueError, KeyError, OSError: a restart cannot help
            raise CheckpointError(f"{ckpt / EMA_CHECKPOINT_FILE}: the teacher's average does not load: {e}") from e
    elif ckpt is not None:
        log.warning("%s holds no %s: the teacher's average restarts from the resumed policy", ckpt, EMA_CHECKPOINT_FILE)
    return ema


def _open_records(cfg, run_dir: Path, state: TrainerState, ckpt: Path | None) -> tuple[list[dict], dict, Reporter | None]:
    """metrics.jsonl as of the checkpoint, the models' record, and the trackers' reporter (None without run.report_to)."""
    records = read_metrics(ckpt) if ckpt is not None else []
    models = model_records(run_dir, cfg)  # step 0's record (metrics.jsonl's first line) names the models
    write_records(run_dir / "metrics.jsonl", records)  # records of steps after the checkpoint: those steps run again
    if state.step < cfg.run.steps:
        (run_dir / "DONE").unlink(missing_ok=True)
    reporter = None
    if cfg.run.report_to:  # one writer per run: rank 0, on a thread of its own (services/trainer/reporting.py)
        try:
            reporter = Reporter(cfg, run_dir, {**cfg.model_dump(mode="json"), "models": models}, state.step, records, ckpt)
        except OSError as e:  # <run_dir>/tracking not a directory, ...: the trackers are off, training goes on
            log.warning("the experiment trackers are off for this session: %s", e)
    return records, models, reporter


def _training_tasks(cfg) -> list:
    """The env's train tasks; every task type's skill files are read now (opsd/skills: refusals), not when a later
    step first issues it."""
    games = get_adapter(cfg.env.name).make_tasks(cfg.env, EnvContext(cache_dir=cfg.cache_root), "train")
    try:
        for task in {t.skill_key: t for t in games}.values():
            privileged_text(cfg.env.name, task, cfg.env.privileged)
    except ValueError as e:
        fatal(ROLE, str(e))
    return games


def _join_queue(proc: RoleProcess, backend, par: Parallel, optimizer, reference, world: World, ema, hashed: dict,
                state: TrainerState, checkpoint_every: int, records: list[dict], models: dict, reporter, games) -> _Run:
    """Open the trainer's input stream, claim the Redis prefix for this run and build what the steps use."""
    cfg, run_dir = proc.cfg, proc.run_dir
    streams = StreamNames(cfg.redis.stream_prefix)
    proc.unready = "waiting for Redis"
    queue = proc.open_queue(streams.scored if cfg.needs_teacher else streams.rollouts,
                            ScoredGroup if cfg.needs_teacher else RolloutGroup, backend.vocab_size,
                            max_deliveries=trainer_max_deliveries(cfg))
    client = queue.client
    backoff = Backoff(ROLE, proc.stop, beat=proc.liveness.beat)
    run_id = claim_prefix(client, streams, run_dir, config_hash(hashed), backoff)
    if state.step < cfg.run.steps:  # KEDA keeps the workers up while this list holds the run (k8s/)
        mark_active(client, streams, run_id, backoff)
    issuer = TaskIssuer(client, cfg, games, cfg.redis.max_message_bytes)
    collector = Collector(queue, cfg.run.max_staleness, state.applied, state.counts, ROLE,
                          newest_published=max([*published_versions(run_dir), state.policy_version]))
    dead = DeadLetters(client, streams.dead)
    keep = cfg.run.max_staleness + 2 + cfg.teacher_lag  # teacher.version lag:K scores with a version K back
    # A worker may need this version's file (module docstring of opsd.weights); a lagging teacher needs version 0's.
    if state.policy_version >= 1 or cfg.run.max_staleness >= 1 or cfg.teacher_lag or ema is not None:
        publish(backend, run_dir, client, cfg.redis.stream_prefix, state.policy_version, keep, backoff,
                cfg.trainer.snapshot_every, ema)
    # The trainer is a singleton: whatever a dead trainer consumer held is ours now.
    backoff.retry(lambda: [collector.offer(d, state.policy_version, state.step)
                           for d in queue.reclaim(0, count=RECLAIM_AT_START)])
    writer = Checkpointer(run_dir, hashed, backend.tokenizer, cfg.trainer.keep_checkpoints,
                          on_written=reporter.commit if reporter is not None else None)
    # metrics.png is drawn off the step's path (matplotlib took 1-2.5 s a step on 2 busy cores, which held back
    # the next step's tasks); a plot still drawing is not queued behind, and the last one is drawn at the end.
    plotter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plot")
    return _Run(proc, backend, par, optimizer, reference, world, ema, hashed, state, checkpoint_every, records, models,
                reporter, games, streams, client, backoff, issuer, collector, dead, keep, writer, plotter,
                saved_step=state.step)


def _announce_ready(run: _Run) -> None:
    """The first gauges and status, then /readyz: model and checkpoint loaded, Redis answered, the prefix is this run's."""
    cfg, proc, version = run.cfg, run.proc, run.state.policy_version
    metrics.POLICY_VERSION.labels(ROLE).set(version)
    for event in CREDIT_EVENTS:  # at 0 from the start: the first event must show as an increase
        metrics.CREDIT_EVENTS.labels(ROLE, event)
    proc.status.update(policy_version=version, step=run.state.step)
    proc.unready = None
    if cfg.simulate.enabled:
        log.warning("simulated compute: each step's credit + update is held for %.2f s (simulate.trainer_s), model %s",
                    cfg.simulate.trainer_s, cfg.model.name)


def _train_steps(run: _Run) -> None:
    """Steps from the resumed one to run.steps, or until a stop; run.state holds the last one finished."""
    cfg, proc = run.cfg, run.proc
    while run.state.step < cfg.run.steps:
        t_step = time.perf_counter()
        step, version = run.state.step, run.state.policy_version
        ids = [t.group_id for t in step_tasks(cfg, run.games, step, version)]
        ordered = wait_for_groups(proc.stop, cfg, run.issuer, run.collector, run.backoff, run.dead, ids, step, version,
                                  beat=proc.liveness.beat)
        if ordered is None:
            break
        _train_step(run, ordered, t_step)


def _train_step(run: _Run, ordered: list, t_step: float) -> None:
    """One step on its groups (arrived at t_step's wait): credit + update, publish, checkpoint when due, report."""
    cfg, proc, run_dir = run.cfg, run.proc, run.run_dir
    step, version = run.state.step, run.state.policy_version
    with proc.liveness.guard("waiting for the checkpoint write", cfg.probes.update_s):
        settle(run.writer, run.collector, run.backoff)  # `learn` changes the model and optimizer the checkpoint is written from
    t_compute = time.perf_counter()
    log.info("step %d: %d groups in after %.1f s; training", step, len(ordered), t_compute - t_step)
    scored = ordered if cfg.needs_teacher else None
    groups = [s.rollout for s in ordered] if cfg.needs_teacher else ordered
    dump = run_dir / "credit" / f"step_{step:05d}.json" if cfg.trainer.dump_credit else None
    # A hung collective or update fails /livez on rank 0; ranks > 0 serve no HTTP: the process group's
    # timeout ends them (k8s/README.md, Probes).
    with proc.liveness.guard("credit assignment and PPO update", cfg.probes.update_s):
        result = learn(cfg, run.par.module, run.optimizer, groups, scored, run.reference, dump, run.world)
        if cfg.simulate.enabled:  # simulated compute (opsd.config.SimulateSection): credit + update take trainer_s in all
            proc.stop.wait(max(0.0, cfg.simulate.trainer_s - (time.perf_counter() - t_compute)))
    record = _step_record(run, result, groups, scored, t_step, t_compute)
    step, version = step + 1, version + 1
    state = run.state
    state.step, state.policy_version, state.applied, state.counts = step, version, run.collector.applied, dict(run.collector.counts)
    run.records.append(record)
    if run.reporter is not None:  # sent once a checkpoint holds the step
        stage_report(run.reporter, record, result, groups, scored, cfg)
    _publish_and_checkpoint(run)
    run.backoff.retry(run.collector.flush)
    append_metrics(run_dir, record)
    if run.plotting is None or run.plotting.done():
        run.plotting = run.plotter.submit(plot_metrics, run_dir)
    if run.writer.done():  # a small checkpoint is on disk already: ack its groups now
        settle(run.writer, run.collector, run.backoff)
    export_step(record, len(groups))
    proc.status.update(policy_version=version, step=step)
    log.info("step %d done: %s", step - 1, json.dumps({k: record[k] for k in ("success_rate", "reward_mean", "loss", "step_seconds")}))


def _step_record(run: _Run, result, groups: list, scored: list | None, t_step: float, t_compute: float) -> dict:
    """The step's metrics.jsonl record (run.state: the step before it is counted)."""
    cfg, collector, step = run.cfg, run.collector, run.state.step
    record = {"step": step, "policy_version": run.state.policy_version + 1, **(run.models if step == 0 else {}),
              **summarize(groups, scored, cfg.credit.diagnostic_prompt_buckets)}
    record.update({k: float(v) for k, v in result.credit_metrics.items()})
    if "alignopsd/mean_span_turns" in result.credit_metrics:
        record["mean_span_length"] = float(result.credit_metrics["alignopsd/mean_span_turns"])
    record.update(result.update)
    mask = result.batch.loss_mask_ML > 0
    record.update(
        staleness_max=collector.last_staleness, groups_dropped_stale=collector.counts["dropped_stale"],
        groups_dropped_duplicate=collector.counts["dropped_duplicate"],
        groups_dropped_future=collector.counts["dropped_future"], wait_seconds=t_compute - t_step,
        train_seconds=time.perf_counter() - t_compute, step_seconds=time.perf_counter() - t_step,
        advantage_abs_mean=float(np.abs(result.advantages_ML[mask]).mean()) if mask.any() else 0.0,
    )
    if cfg.simulate.enabled:
        record["simulated_compute"] = True
    # Wall clock (unix s) once the step's update is applied: throughput. Set before the checkpoint copies
    # the records, so a resumed run keeps it for every step (its checkpoint and publish follow: seconds).
    record["finished_at"] = time.time()
    return record


def _publish_and_checkpoint(run: _Run) -> None:
    """Publish the new policy version (and the teacher's average); start writing a checkpoint when one is due."""
    cfg, step = run.cfg, run.state.step
    due = step % run.checkpoint_every == 0 or step == cfg.run.steps
    with run.proc.liveness.guard("gathering and publishing the weights", cfg.probes.update_s):
        full_model, full_optimizer = run.par.gather(optimizer=due)  # FSDP2: all-gathered (into backend.model); else the model
        if run.ema is not None:
            run.ema.update(full_model)
        publish(run.backend, run.run_dir, run.client, cfg.redis.stream_prefix, run.state.policy_version, run.keep,
                run.backoff, cfg.trainer.snapshot_every, run.ema)
    if due:
        # Written from the live model and optimizer, which stay unchanged until `settle` (before the next
        # `learn` and `par.gather`): a snapshot would add a host copy of the fp32 weights and AdamW moments
        # (12 bytes/param, ~91 GB at 7B) for no gain, since waiting for the next step's groups normally
        # outlasts the write. Its groups are acked once it is complete (settle): a kill re-delivers them.
        run.writer.start(full_model, full_optimizer, run.state, run.records, run.ema, covered=len(run.collector.trained))
        run.saved_step = step


def _finish(run: _Run, lock, exit_at_done: bool) -> None:
    """After the last step or a stop: the last plot and checkpoint; then, once all steps ran, DONE and the final files."""
    cfg, run_dir, step = run.cfg, run.run_dir, run.state.step
    finishing = partial(run.proc.liveness.guard, "writing the run's last checkpoint", cfg.probes.update_s)
    with finishing():
        _save_last_checkpoint(run)
    run.par.stop()  # the other ranks' `follow` returns
    if run.reporter is not None:  # what is checkpointed is sent; W&B and MLflow mark the run finished (or not)
        with finishing():
            run.reporter.close(finished=step >= cfg.run.steps, timeout_s=120.0 if step >= cfg.run.steps else 5.0)
    if step < cfg.run.steps:
        log.info("stopped before step %d; resume with the same run dir", step)
        lock.close()
        return
    _leave_final_files(run, finishing)
    (run_dir / "DONE").write_text(json.dumps({"steps": cfg.run.steps, "policy_version": run.state.policy_version}))
    mark_active(run.client, run.streams, None, run.backoff)  # after DONE: a crash in between leaves it for the restart to delete
    run.proc.status["finished"] = True
    log.info("finished %d steps; final checkpoint in %s", cfg.run.steps, run_dir / "checkpoint")
    if exit_at_done:
        log.info("%s: exiting at DONE", EXIT_WHEN_DONE_ENV)
        lock.close()
        return
    while not run.proc.stop.wait(1.0):
        run.proc.liveness.beat()
    lock.close()


def _save_last_checkpoint(run: _Run) -> None:
    """The last plot; the checkpoint being written completed, and one of the steps since the last, if any."""
    run.plotter.shutdown(wait=True)
    if run.plotting is not None:
        plot_metrics(run.run_dir)  # every record, and a plotting error surfaces here
    settle(run.writer, run.collector, run.backoff)  # the last step's checkpoint, or the one a stop interrupted the wait for
    if run.state.step > run.saved_step:  # stopped between checkpoints: keep the finished steps
        save_checkpoint(run.run_dir, *run.par.gather(optimizer=True), run.state, run.hashed, run.records,
                        run.backend.tokenizer, run.ema, keep=run.cfg.trainer.keep_checkpoints)
        if run.reporter is not None:
            run.reporter.commit(run.state.step)
        run.collector.release_trained()
        run.backoff.retry(run.collector.flush)


def _leave_final_files(run: _Run, finishing) -> None:
    """A finished run's files: the checkpoint holds the final policy; the per-version files only served the roles."""
    cfg, run_dir = run.cfg, run.run_dir
    shutil.rmtree(run_dir / "weights", ignore_errors=True)
    if cfg.trainer.lora is not None:  # the checkpoint keeps peft's names: also leave a plain model of the policy
        from opsd.lora import save_merged

        with finishing():
            save_merged(run.backend.model, run.backend.tokenizer, run_dir / "final_model", cfg.model.trust_remote_code)
    if not cfg.trainer.keep_optimizer_state:
        with finishing():
            freed = drop_optimizer_state(run_dir / "checkpoint")
        log.info("trainer.keep_optimizer_state false: dropped the optimizer state (%.2f GB) from the finished run's "
                 "checkpoint", freed / 1e9)


# Credit metrics that count edge cases an estimator handled (spec: degenerate groups and turns), as
# `<method>/<event>` keys of the step record; each step adds them to opsd_credit_events_total{event}.
CREDIT_EVENTS = ("turns_without_loss_tokens", "single_trajectory_tasks", "single_turn_trajectories", "nonfinite_metrics_dropped")


def export_step(record: dict, n_groups: int) -> None:
    """Set the Prometheus series of a finished step from its metrics record.

    record: one metrics.jsonl line (floats; see `train`); n_groups: groups
    trained in the step. Counters are incremented, gauges set; edge-case
    counts among the credit metrics (CREDIT_EVENTS) go to
    opsd_credit_events_total{role="trainer", event=...}.
    """
    metrics.POLICY_VERSION.labels(ROLE).set(record["policy_version"])
    metrics.GROUPS.labels(ROLE).inc(n_groups)
    metrics.TOKENS.labels(ROLE).inc(int(record["loss_tokens"]))
    metrics.STEP_SECONDS.labels(ROLE, "waiting").set(record["wait_seconds"])
    metrics.STEP_SECONDS.labels(ROLE, "computing").set(record["train_seconds"])
    metrics.SUCCESS_RATE.labels(ROLE).set(record["success_rate"])
    metrics.INVALID_ACTION_RATE.labels(ROLE).set(1.0 - record["format_valid_rate"])
    metrics.SAMPLER_MISMATCH_KL.labels(ROLE).set(record["mismatch_kl"])
    if "kl" in record:
        metrics.REFERENCE_KL.labels(ROLE).set(record["kl"])
    if "teacher_student_gap" in record:
        metrics.TEACHER_STUDENT_GAP.labels(ROLE).set(record["teacher_student_gap"])
    if record.get("privileged_signal") is not None:
        metrics.PRIVILEGED_SIGNAL.labels(ROLE).set(record["privileged_signal"])
    # Teacher-verifier diagnostics: every bucket of the step has a "groups" key; NaN where it has no value.
    for bucket in [k.split("/")[1] for k in record if k.startswith("teacher_verifier/") and k.endswith("/groups")]:
        value = {name: record.get(f"teacher_verifier/{bucket}/{name}", math.nan) for name in DIAGNOSTICS}
        metrics.TEACHER_VERIFIER_DISAGREEMENT.labels(ROLE, "pairwise", bucket).set(value["pairwise_disagreement"])
        metrics.TEACHER_VERIFIER_DISAGREEMENT.labels(ROLE, "top1", bucket).set(value["top1_mismatch"])
        metrics.TEACHER_VERIFIER_GAP.labels(ROLE, bucket).set(value["preference_gap"])
    if "mean_span_length" in record:
        metrics.MEAN_SPAN_LENGTH.labels(ROLE).set(record["mean_span_length"])
    for key, value in record.items():
        event = key.partition("/")[2]
        if event in CREDIT_EVENTS and value > 0:
            metrics.CREDIT_EVENTS.labels(ROLE, event).inc(value)


if __name__ == "__main__":
    main()
