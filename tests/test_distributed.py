"""The multi-rank trainer (services/trainer/distributed.py) on CPU: a gloo world of 2 ranks makes the update 1 rank makes.

One world of 2 worker processes (this file run as `python -m tests.test_distributed --worker OUT`, with
the variables torchrun sets) runs every scenario once per session; the tests compare what rank 0 wrote
(weights, optimizer state, metrics) with a single process running the same batches. A world that
deadlocks is killed after WORLD_TIMEOUT_S and every test fails.

Model: a 2-layer tied-embedding Llama (vocab 64, hidden 32). Batches: 5 sequences of unequal
lengths and loss-token counts (the token-mean over both ranks matters), and a 1-sequence batch (one
rank trains nothing but must still join every collective). Each scenario runs two steps: step 1 with
both ranks calling ppo_update, step 2 as the trainer does it (rank 0 sends the sequences, rank 1
`follow`s), then rank 0 gathers the full weights and optimizer state (FSDP2: all-gathered) and stops
rank 1. Then a resume as on two nodes: rank 0 loads a checkpoint only it is told of and deletes it, and
rank 1 (no run dir) gets its weights and AdamW state over the process group (`share_resume`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the worker runs as `python -m tests.test_distributed`
    sys.path.insert(0, str(REPO))

from services.trainer.distributed import Message, decode_message, encode_message, shard  # noqa: E402
from services.trainer.update import Sequence, ppo_update  # noqa: E402

# Both ranks' whole run: measured 25-45 s on an idle 2-core machine, most of it importing transformers,
# and a loaded CI machine can take several times that. A deadlock never finishes, so 300 s still tells
# one apart, well inside pytest-timeout's 900 s (pyproject.toml) for the whole module fixture.
WORLD_TIMEOUT_S = 300
# Weights (and optimizer state) 1 vs 2 ranks, max abs difference. The ranks' gradients are summed in
# another order than one process accumulates its micro-batches (DDP: each rank's sum, then the two), so
# float32 rounding differs: measured 1.5e-8 with SGD. SGD keeps that difference linear in the gradient's;
# AdamW divides by sqrt(v) + 1e-8 and turns rounding noise on near-zero gradients into steps of up to lr
# (measured 7e-7 at lr 1e-3 with DDP), so AdamW runs only where the order is the same (fsdp2-resume: FSDP2
# reduces every micro-batch, and this sharding gives each rank the single process's micro-batches): 0 there.
WEIGHT_ATOL = 1e-6
SCENARIOS = {  # name: (strategy, batch, resume, optimizer, loss)
    "ddp-odd": ("ddp", "odd", False, "sgd", "spec"),
    "ddp-single": ("ddp", "single", False, "sgd", "spec"),
    "fsdp2-odd": ("fsdp2", "odd", False, "sgd", "spec"),
    "fsdp2-single": ("fsdp2", "single", False, "sgd", "spec"),
    # Step 1 runs before wrapping (as a resumed checkpoint's state): FSDP2 shards the existing AdamW state.
    "fsdp2-resume": ("fsdp2", "odd", True, "adamw", "spec"),
    # The sequence-level options: their denominators (sequences) and ratios must span both ranks too.
    "ddp-seq": ("ddp", "odd", False, "sgd", "seq"),
}
# Every scenario trains with the KL to the reference and records the first epoch (the credit dump's loss inputs).
TRAINER = {"micro_batch_size": 2, "ppo_epochs": 2, "entropy_coef": 0.01, "truncated_is": True, "kl_coef": 0.05,
           "dump_credit": True}
LOSSES = {"spec": {}, "seq": {"loss_agg": "seq-mean-token-mean", "importance_level": "sequence", "tis_level": "sequence",
                              "tis_mode": "mask", "tis_cap": 3.0, "clip_ratio_c": None, "kl_estimator": "k2"}}
RESUME_ENV = "OPSD_TEST_RESUME_RUN_DIR"  # rank 0's environment only: the run dir holding the checkpoint to resume


def run_config(loss: str = "spec"):
    from opsd.config import RunConfig

    return RunConfig.model_validate({"trainer": TRAINER | LOSSES[loss], "credit": {"sdar": {"coef": 0.1}}})


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def batch(kind: str, step: int) -> list[Sequence]:
    """Step `step`'s sequences: "odd" = 5 of lengths 9..23 with 1 to 3 loss spans each, "single" = 1."""
    rng = np.random.default_rng(10 * step + (kind == "single"))
    lengths = (9, 23, 14, 6, 17) if kind == "odd" else (13,)
    out = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        for _ in range(rng.integers(1, 4)):
            a = int(rng.integers(1, n - 1))
            mask[a : a + int(rng.integers(1, 5))] = 1
        out.append(Sequence(
            token_ids_S=rng.integers(0, 64, n).astype(np.int32),
            loss_mask_S=mask,
            advantages_S=np.where(mask == 1, rng.normal(0, 1, n), 0).astype(np.float32),
            sampler_logprobs_S=np.where(mask == 1, -rng.uniform(2, 5, n), 0).astype(np.float32),
            teacher_logprobs_S=np.where(mask == 1, -rng.uniform(2, 5, n), 0).astype(np.float32),
            ref_logprobs_S=np.where(mask == 1, -rng.uniform(2, 5, n), 0).astype(np.float32),
        ))
    return out


def optimizer_of(model: torch.nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def flat_state(optimizer_state: dict) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors as "<param index>.<name>" (the checkpoint's layout)."""
    return {f"{i}.{k}": v for i, st in optimizer_state["state"].items() for k, v in st.items() if torch.is_tensor(v)}


def update(model, opt, seqs, world=None, dtype: str | None = None, loss: str = "spec") -> dict[str, float]:
    """ppo_update with the scenario's config; the metrics plus the first epoch's record (pi_old, entropies, loss, kl)."""
    from services.trainer.update import FirstEpoch, loss_norm_tokens

    cfg = run_config(loss)
    record = FirstEpoch()
    m = ppo_update(model, opt, seqs, cfg.trainer, dtype or cfg.model.dtype, cfg.rollout.temperature, cfg.credit.sdar, world,
                   loss_norm_tokens(cfg), record)
    return m | {"record_loss": record.loss, "record_kl": record.kl,
                "record_old": float(np.concatenate(record.old_logprobs).astype(np.float64).sum()),
                "record_entropy": float(np.concatenate(record.entropy).astype(np.float64).sum()),
                "record_tokens": float(sum(len(a) for a in record.old_logprobs))}


# ---------------------------------------------------------------------------
# The worker (one rank)


def worker(out: Path) -> None:
    from safetensors.torch import save_file

    from services.trainer.distributed import init_from_env, parallelize, receive, send
    from services.trainer.update import follow

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO)  # the rank's log lines, which scripts/compose_check.py reads
    print(f"{time.perf_counter() - T0:.1f}s: imported", flush=True)
    world = init_from_env("cpu")
    assert world.distributed and world.device.type == "cpu"
    # The wire: rank 0's message as rank 1 decodes it, written back for the test to compare.
    wire = Message("update", batch("odd", 1) + [Sequence(*(np.zeros(0, np.float32),) * 4)], {"n": 7, "s": "x"})
    if world.rank == 0:
        send(world, wire)
    else:
        (out / "wire.msgpack").write_bytes(encode_message(receive(world)))

    for name, (strategy, kind, resume, optimizer, loss) in SCENARIOS.items():
        print(f"{time.perf_counter() - T0:.1f}s: {name}", flush=True)
        model = tiny_model()
        opt = optimizer_of(model, optimizer)
        metrics = {}
        if resume:
            metrics["step1"] = update(model, opt, batch(kind, 1), loss=loss)  # every rank alone, as each loads the checkpoint
        par = parallelize(world, model, opt, strategy)
        assert par.strategy == strategy
        if not resume:
            metrics["step1"] = update(par.module, opt, batch(kind, 1), world, loss=loss)
        if world.rank == 0:
            send(world, Message("update", batch(kind, 2)))
            metrics["step2"] = update(par.module, opt, batch(kind, 2), world, loss=loss)
            full_model, full_opt = par.gather(optimizer=True)
            par.stop()
            save_file({k: v.detach().clone() for k, v in full_model.state_dict().items()}, str(out / f"{name}.safetensors"))
            save_file(flat_state(full_opt.state_dict()), str(out / f"{name}.opt.safetensors"))
        else:
            metrics["updates_followed"] = follow(par, run_config(loss))
        (out / f"{name}.rank{world.rank}.json").write_text(json.dumps(metrics))

    # model.dtype bfloat16 under FSDP2: MixedPrecisionPolicy(bf16 params, fp32 reduce), fp32 shards as the master.
    model = tiny_model()
    opt = optimizer_of(model)
    par = parallelize(world, model, opt, "fsdp2", dtype="bfloat16")
    update(par.module, opt, batch("odd", 1), world, dtype="bfloat16")
    shard_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if world.rank == 0:
        full_model, _ = par.gather()  # rank 1 joins it in `follow`
        save_file({k: v.detach().clone() for k, v in full_model.state_dict().items()}, str(out / "fsdp2-bf16.safetensors"))
        par.stop()
    else:
        follow(par, run_config())
    (out / f"fsdp2-bf16.rank{world.rank}.json").write_text(json.dumps({"shards": shard_dtypes}))

    # Ranks given different batches: every rank raises, none hangs.
    model = tiny_model()
    par = parallelize(world, model, optimizer_of(model), "ddp")
    try:
        update(par.module, par.optimizer, batch("odd", world.rank), world)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    (out / f"mismatch.rank{world.rank}.json").write_text(json.dumps(outcome))

    resume_on_two_nodes(world, out)
    hostile_resume_headers(world, out)
    torch.distributed.destroy_process_group()
    print(f"{time.perf_counter() - T0:.1f}s: done", flush=True)


def resume_on_two_nodes(world, out: Path) -> None:
    """Rank 0 resumes the checkpoint in $RESUME_ENV and deletes it; rank 1, never told of it, gets it through
    `share_resume`, writes what it holds, then its FSDP2 shards of it; then a rank with another config is refused."""
    from safetensors.torch import save_file

    from opsd.config import config_hash, hashed_config
    from services.trainer.checkpoint import resume_checkpoint
    from services.trainer.distributed import parallelize, share_resume

    hashed = hashed_config(run_config())
    model = tiny_model()
    opt = optimizer_of(model, "adamw")
    step = None
    if world.rank == 0:
        run_dir = Path(os.environ[RESUME_ENV])
        _, state = resume_checkpoint(run_dir, model, opt, hashed)
        shutil.rmtree(run_dir)  # the only copy rank 0 was given: rank 1 cannot read it from disk
        step = state.step
    else:
        assert RESUME_ENV not in os.environ
    got = share_resume(world, model, opt, step, config_hash(hashed))
    if world.rank == 1:
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(out / "resume.rank1.safetensors"))
        save_file(flat_state(opt.state_dict()), str(out / "resume.rank1.opt.safetensors"))
        (out / "resume.rank1.json").write_text(json.dumps({"step": got, "param_groups": opt.state_dict()["param_groups"]}))
    parallelize(world, model, opt, "fsdp2")  # FSDP2 shards what the share put on each rank, in place
    if world.rank == 1:
        params = [p for g in opt.param_groups for p in g["params"]]
        save_file({n: p.to_local().detach().clone() for n, p in model.named_parameters()}
                  | {f"{i}.{k}": v.to_local().clone() for i, p in enumerate(params) for k, v in opt.state[p].items()
                     if k != "step"}, str(out / "resume.rank1.fsdp2.safetensors"))
    other = tiny_model()
    try:  # rank 1 runs another config: every rank refuses, none waits in a broadcast
        share_resume(world, other, optimizer_of(other, "adamw"), 1 if world.rank == 0 else None,
                     config_hash(hashed) if world.rank == 0 else "f" * 64)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    (out / f"resume-refused.rank{world.rank}.json").write_text(json.dumps(outcome))


def hostile_resume_headers(world, out: Path) -> None:
    """Rank 0 sends resume headers rank 1 cannot read or must not trust, then joins share_resume's agreement as
    share_resume's rank 0 does; rank 1 runs share_resume. Each must be refused on both ranks, none crash or wait."""
    from opsd.config import config_hash, hashed_config
    from services.trainer.distributed import all_reduce, send, share_resume

    model = tiny_model()
    opt = optimizer_of(model, "adamw")
    good = {"step": 1, "config_hash": config_hash(hashed_config(run_config())), "scalars": {},
            "param_groups": opt.state_dict()["param_groups"],
            "tensors": [[f"model.{k}", "float32", list(v.shape)] for k, v in model.state_dict().items()]}
    first = good["tensors"][0]
    headers = [
        Message("resume", args={**good, "tensors": [[first[0], ["float32"], first[2]]]}),  # unhashable dtype
        Message("resume", args={**good, "tensors": 7}),
        Message("resume", args={**good, "tensors": [*good["tensors"], ["optimizer.\u00b2.exp_avg", "float32", [1]]]}),
        Message("resume", args={**good, "tensors": [*good["tensors"], first]}),  # one name twice: one broadcast too many
        Message("resume", args={**good, "tensors": [*good["tensors"], ["optimizer.0.step", "float32", [1] * 100]]}),
        Message("update"),
    ]
    outcomes = []
    for msg in headers:
        if world.rank == 0:
            send(world, msg)
            outcomes.append(all_reduce([0.0], "max", world)[0])  # 1.0: a rank refused it
            continue
        try:
            share_resume(world, model, opt, None, good["config_hash"])
            outcomes.append("no error")
        except RuntimeError as e:
            outcomes.append(str(e))
    (out / f"resume-hostile.rank{world.rank}.json").write_text(json.dumps(outcomes))


def write_resume_checkpoint(out: Path) -> Path:
    """A checkpoint of step 1 (one AdamW update of the tiny model) in out/resume-ref/, the untouched reference;
    returns a copy of its run dir for rank 0 alone."""
    from opsd.config import config_hash, hashed_config
    from services.trainer.checkpoint import TrainerState, save_checkpoint

    cfg = run_config()
    model = tiny_model()
    opt = optimizer_of(model, "adamw")
    update(model, opt, batch("odd", 1))
    state = TrainerState(step=1, policy_version=1, method=cfg.run.method, config_hash=config_hash(hashed_config(cfg)),
                         applied=["s00000-tw-0001@v0"], counts={"trained": 1, "dropped_stale": 0, "dropped_duplicate": 0})
    save_checkpoint(out / "resume-ref", model, opt, state, hashed_config(cfg), [])
    shutil.copytree(out / "resume-ref", out / "resume-rank0")
    return out / "resume-rank0"


# ---------------------------------------------------------------------------
# The tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world_run(tmp_path_factory) -> tuple[Path, float]:
    """Run the 2-rank world once; returns (its output dir, its wall time in s). Fails on a deadlock or a crash."""
    out = tmp_path_factory.mktemp("world")
    resume_dir = write_resume_checkpoint(out)
    port = free_port()
    procs = []
    t0 = time.perf_counter()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env.pop(RESUME_ENV, None)
        if rank == 0:
            env[RESUME_ENV] = str(resume_dir)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_distributed", "--worker", str(out)], cwd=REPO, env=env,
                                      stdout=open(out / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.kill()
            p.wait()
    logs = "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-3000:]}" for r in range(2))
    assert not hung, f"the 2-rank world did not finish in {WORLD_TIMEOUT_S} s (deadlock?)\n{logs}"
    assert all(p.returncode == 0 for p in procs), logs
    return out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, no process group: per (batch, optimizer), (metrics per step, weights, optimizer state) after two steps."""
    ref = {}
    for _, kind, _, optimizer, loss in SCENARIOS.values():
        model = tiny_model()
        opt = optimizer_of(model, optimizer)
        metrics = {"step1": update(model, opt, batch(kind, 1), loss=loss), "step2": update(model, opt, batch(kind, 2), loss=loss)}
        ref[kind, optimizer, loss] = (metrics, model.state_dict(), flat_state(opt.state_dict()))
    return ref


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_make_the_update_one_rank_makes(name, world_run, reference):
    from safetensors.torch import load_file

    out, seconds = world_run
    _, kind, resume, optimizer, loss = SCENARIOS[name]
    ref_metrics, ref_weights, ref_opt = reference[kind, optimizer, loss]
    weights = load_file(str(out / f"{name}.safetensors"))
    diff = _max_abs_diff(weights, ref_weights)
    opt_diff = _max_abs_diff(load_file(str(out / f"{name}.opt.safetensors")), ref_opt)
    print(f"{name}: max |w_2ranks - w_1rank| = {diff:.3g}, optimizer state {opt_diff:.3g} (world ran {seconds:.1f} s)")
    assert diff < WEIGHT_ATOL
    assert _max_abs_diff(ref_weights, tiny_model().state_dict()) > 1e-3  # the update did move the weights
    assert opt_diff < WEIGHT_ATOL  # momentum / AdamW moments and step count, in torch's index order
    rank0 = json.loads((out / f"{name}.rank0.json").read_text())
    rank1 = json.loads((out / f"{name}.rank1.json").read_text())
    assert rank1["updates_followed"] == 1
    steps = ("step2",) if resume else ("step1", "step2")
    for step in steps:
        ranks = (rank0[step], rank1[step]) if step == "step1" else (rank0[step],)
        for got in ranks:
            assert set(got) == set(ref_metrics[step])
            for k, v in ref_metrics[step].items():
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (step, k)
    assert ref_metrics["step1"]["loss_tokens"] > 0 and ref_metrics["step2"]["sdar_loss"] != 0.0
    assert ref_metrics["step2"]["kl"] > 0 and ref_metrics["step2"]["record_tokens"] == ref_metrics["step2"]["loss_tokens"]


def test_fsdp2_bf16_computes_in_bf16_and_keeps_fp32_master_weights(world_run):
    from safetensors.torch import load_file

    out, _ = world_run
    for rank in range(2):
        assert json.loads((out / f"fsdp2-bf16.rank{rank}.json").read_text())["shards"] == ["torch.float32"]
    weights = load_file(str(out / "fsdp2-bf16.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    start = tiny_model()
    ref32 = tiny_model()
    update(ref32, optimizer_of(ref32), batch("odd", 1))  # one process, fp32
    ref16 = tiny_model()
    update(ref16, optimizer_of(ref16), batch("odd", 1), dtype="bfloat16")  # one process, bf16 autocast
    moved = _max_abs_diff(ref32.state_dict(), start.state_dict())
    # bf16 compute: not the fp32 update, but within a few % of the step (SGD: the weights move by the gradient).
    assert 0 < _max_abs_diff(weights, ref32.state_dict()) < 0.1 * moved
    assert _max_abs_diff(weights, ref16.state_dict()) < 0.1 * moved


def test_ranks_given_different_batches_all_raise(world_run):
    out, _ = world_run
    for rank in range(2):
        assert "different batches" in json.loads((out / f"mismatch.rank{rank}.json").read_text())


def test_a_rank_without_the_run_dir_resumes_rank_0s_checkpoint_over_the_process_group(world_run):
    from safetensors.torch import load_file

    out, _ = world_run
    ref = out / "resume-ref" / "checkpoint"
    assert not (out / "resume-rank0").exists()  # rank 0 deleted the only copy it was given before sharing
    saved, got = load_file(str(ref / "model.safetensors")), load_file(str(out / "resume.rank1.safetensors"))
    assert saved and set(saved) <= set(got)  # the file leaves out the tied lm_head.weight
    assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert torch.equal(got["lm_head.weight"], saved["model.embed_tokens.weight"])  # still tied
    initial = tiny_model().state_dict()
    assert max(float((saved[k] - initial[k]).abs().max()) for k in saved) > 1e-4  # the checkpoint is not the start
    saved_opt, got_opt = load_file(str(ref / "optimizer.safetensors")), load_file(str(out / "resume.rank1.opt.safetensors"))
    assert set(saved_opt) == set(got_opt) and {k.split(".", 1)[1] for k in saved_opt} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(saved_opt[k], got_opt[k]) and saved_opt[k].dtype == got_opt[k].dtype for k in saved_opt)
    assert all(float(v) == TRAINER["ppo_epochs"] for k, v in got_opt.items() if k.endswith(".step"))  # an update's AdamW steps
    meta = json.loads((out / "resume.rank1.json").read_text())
    assert meta["step"] == 1
    assert meta["param_groups"] == json.loads((ref / "optimizer.json").read_text())["param_groups"]


def test_fsdp2_shards_the_resumed_state_on_a_rank_without_the_run_dir(world_run):
    from safetensors.torch import load_file

    out, _ = world_run
    ref = out / "resume-ref" / "checkpoint"
    saved, saved_opt = load_file(str(ref / "model.safetensors")), load_file(str(ref / "optimizer.safetensors"))
    shards = load_file(str(out / "resume.rank1.fsdp2.safetensors"))
    names = [n for n, _ in tiny_model().named_parameters()]  # the optimizer's parameter order
    for i, name in enumerate(names):  # FSDP2 shards dim 0 in world-size chunks: rank 1 holds the second
        assert torch.equal(shards[name], torch.chunk(saved[name], 2, dim=0)[1]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(shards[f"{i}.{moment}"], torch.chunk(saved_opt[f"{i}.{moment}"], 2, dim=0)[1]), (name, moment)


def test_a_rank_with_another_config_refuses_the_resume_and_every_rank_raises(world_run):
    out, _ = world_run
    outcomes = [json.loads((out / f"resume-refused.rank{r}.json").read_text()) for r in range(2)]
    assert "every node must run the same config file" in outcomes[1]
    assert "another rank refused" in outcomes[0]


def test_a_resume_header_rank_1_cannot_read_is_refused_on_every_rank_and_none_waits(world_run):
    out, _ = world_run
    refused = json.loads((out / "resume-hostile.rank0.json").read_text())
    reasons = json.loads((out / "resume-hostile.rank1.json").read_text())
    assert refused == [1.0] * 6
    assert all(r.startswith("rank 1: ") for r in reasons), reasons
    assert "malformed resume message from rank 0: TypeError" in reasons[0]
    assert "malformed resume message from rank 0: TypeError" in reasons[1]
    assert "malformed resume message from rank 0: ValueError" in reasons[2]
    assert reasons[3].endswith("model.embed_tokens.weight is named twice")
    assert "optimizer.0.step is torch.float32[1, 1," in reasons[4]
    assert reasons[5].endswith("expected rank 0's resume message, got 'update'")


def test_the_compose_checks_patterns_match_each_ranks_real_log_lines(world_run):
    """scripts/compose_check.py --trainer-nodes 2 proves the two-node world from these lines of each rank's log."""
    sys.path.insert(0, str(REPO / "scripts"))
    import compose_check

    out, _ = world_run
    for rank in range(2):
        text = (out / f"rank{rank}.log").read_text()
        (line,) = compose_check.RANK_LINE.findall(text)
        assert line == (str(rank), "2", "cpu", "gloo", socket.gethostname())
        shares = compose_check.SHARE_LINE.findall(text)
        assert shares and all(s[0] == str(rank) and int(s[1]) <= int(s[2]) and int(s[3]) <= int(s[4]) for s in shares)


def test_a_message_survives_the_broadcast(world_run):
    out, _ = world_run
    got = decode_message((out / "wire.msgpack").read_bytes())
    sent = batch("odd", 1)
    assert got.op == "update" and got.args == {"n": 7, "s": "x"} and len(got.seqs) == len(sent) + 1
    for a, b in zip(got.seqs, sent):
        for f in ("token_ids_S", "loss_mask_S", "advantages_S", "sampler_logprobs_S", "teacher_logprobs_S"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f
    empty = got.seqs[-1]
    assert empty.token_ids_S.shape == (0,) and empty.teacher_logprobs_S is None


def test_message_encoding_round_trip_and_refusals():
    seqs = batch("odd", 3)
    seqs[0].teacher_logprobs_S = None
    msg = decode_message(encode_message(Message("update", seqs, {"optimizer": True})))
    assert msg.args == {"optimizer": True} and msg.seqs[0].teacher_logprobs_S is None
    assert all(np.array_equal(a.advantages_S, b.advantages_S) and a.token_ids_S.dtype == np.int32 for a, b in zip(msg.seqs, seqs))
    assert msg.seqs[1].token_ids_S.flags.writeable  # a copy, not a view of the payload
    with pytest.raises(ValueError, match="cannot send"):
        encode_message(Message("update", [Sequence(np.array(["a"], dtype=object), *(np.zeros(1),) * 3)]))
    import msgpack

    bad = msgpack.packb({"op": "update", "args": {}, "seqs": [{f: {"dtype": "<f4", "shape": [3], "data": b"\0" * 8} for f in
                         ("token_ids_S", "loss_mask_S", "advantages_S", "sampler_logprobs_S")}]})
    with pytest.raises(ValueError, match="malformed"):
        decode_message(bad)  # 3 float32 need 12 bytes
    with pytest.raises(ValueError, match="malformed"):
        decode_message(b"\xc1")

    def arr(x):
        x = np.asarray(x)
        return {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.tobytes()}

    good = {f: arr(np.zeros(3, np.float32)) for f in ("token_ids_S", "loss_mask_S", "advantages_S", "sampler_logprobs_S")}
    assert len(decode_message(msgpack.packb({"op": "update", "args": {}, "seqs": [good]})).seqs) == 1
    for broken in (  # the breaker's list: each would crash ppo_update on one rank, or worse
        {"op": "update", "args": {}, "seqs": [{}]},  # every field missing
        {"op": "update", "args": {}, "seqs": [{**good, "advantages_S": arr(np.zeros(4, np.float32))}]},  # lengths differ
        {"op": "update", "args": {}, "seqs": [{**good, "advantages_S": arr(np.zeros((3, 1), np.float32))}]},  # 2-D
        {"op": "update", "args": {}, "seqs": [{**good, "advantages_S": {**good["advantages_S"], "dtype": None}}]},
        {"op": "update", "args": {}, "seqs": [{**good, "advantages_S": {**good["advantages_S"], "shape": [3.0]}}]},
        {"op": "update", "args": {}, "seqs": [{**good, "extra": arr([1])}]},
        {"op": {"x": 1}, "args": {}, "seqs": []},
        {"op": "update", "args": {"a": msgpack.ExtType(1, b"x")}, "seqs": []},
        {"op": "update", "seqs": []},
    ):
        with pytest.raises(ValueError, match="malformed"):
            decode_message(msgpack.packb(broken))


def test_shard_is_a_balanced_deterministic_partition():
    seqs = batch("odd", 1)  # lengths 9, 23, 14, 6, 17
    parts = [shard(seqs, r, 2) for r in range(2)]
    assert [[len(s.token_ids_S) for s in p] for p in parts] == [[9, 23], [14, 6, 17]]  # 32 vs 37 tokens
    assert sorted(id(s) for p in parts for s in p) == sorted(id(s) for s in seqs)
    assert parts == [shard(seqs, r, 2) for r in range(2)]
    assert [len(shard(seqs[:1], r, 3)) for r in range(3)] == [1, 0, 0]  # more ranks than sequences
    with pytest.raises(ValueError):
        shard(seqs, 2, 2)


def test_single_process_world_starts_no_process_group(monkeypatch):
    from services.trainer.distributed import init_from_env, parallelize

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = init_from_env("cpu")
    assert not world.distributed and not torch.distributed.is_initialized()
    model = tiny_model()
    opt = optimizer_of(model)
    par = parallelize(world, model, opt)
    assert par.module is model and par.gather(optimizer=True) == (model, opt)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        init_from_env("cpu")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("usage: python -m tests.test_distributed --worker OUT_DIR (started by the tests)")
    worker(Path(sys.argv[2]))


@pytest.mark.e2e
def test_opsd_run_starts_the_trainer_under_torchrun(tmp_path):
    """`trainer.nproc_per_node: 2`: `opsd run` launches torchrun; rank 0 is the service, rank 1 follows."""
    import yaml

    cfg = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    cfg["run"]["method"] = "grpo"
    cfg["trainer"].update(nproc_per_node=2, threads=1)
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "opsd.cli", "run", str(path), "--output-dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["policy_version"] == 1 and record["loss_tokens"] > 0
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log, log[-3000:]
    assert (run_dir / "checkpoint" / "trainer_state.json").is_file()
