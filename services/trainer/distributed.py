"""Data-parallel trainer across torchrun ranks: process group, model wrapping, batch sharding, rank 0's messages.

Launch, one node: `torchrun --nproc-per-node N -m services.trainer --config C --run-dir D` (`opsd run`
does it, `--standalone`, when trainer.nproc_per_node N > 1). Several nodes: the same on each node with
`--nnodes M --node-rank R --master-addr A --master-port P` (static rendezvous: node rank 0, on host A,
holds the run directory), or through `python -m services.trainer.torchrun` (same arguments; a rank's
FATAL_EXIT becomes the node's exit code). N = trainer.nproc_per_node ranks per node, one per GPU
(cuda:LOCAL_RANK); WORLD_SIZE = M * N.
Rank 0 is the trainer service (Redis, credit assignment, checkpoints,
publishing, /metrics). Ranks > 0 run `follow` (services/trainer/update.py): they receive each step's
sequences from rank 0, run their share of the PPO update (`ppo_update` with
a `World`), and take part in gathering the full weights when rank 0 saves or
publishes. They never read or write the run directory: on a resume rank 0 sends them its checkpoint's
weights and optimizer state over the process group (`share_resume`), so a node without the run volume
(ReadWriteOnce on a cluster) trains as well. They need the model (its files or HF cache) and the same
config. Without torchrun (WORLD_SIZE unset or 1) no process group starts:
the trainer is the plain single process it always was.

Wrapping (`wrap_model`): FSDP2 (`fully_shard`, parameters sharded across
ranks) on CUDA, DDP (parameters replicated) on CPU; `trainer.data_parallel`
forces either. Gradients are SUMMED across ranks, never averaged: every
rank's loss is already divided by the loss tokens of the whole step (all
ranks), so the sum is the single-process gradient.

Wire: rank 0's messages are msgpack (never pickle) in a uint8 tensor,
broadcast over a gloo group (`World.control`) as length, then payload.
Arrays travel as raw bytes + dtype + shape; a resume's tensors follow their message as broadcasts of the
default group (nccl on GPUs, gloo on CPUs). Across nodes gloo and nccl pick the interface whose address
the host name resolves to: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name it where that is the wrong one.
Run for real here: two CPU containers with gloo over a compose network (`make compose-check`,
docker-compose.multinode.yml); nccl across real nodes has not run.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("trainer")
Strategy = Literal["auto", "fsdp2", "ddp"]
# Ranks > 0 wait on rank 0's next message while it waits for a step's groups (up to run.step_timeout_s and
# beyond, for Redis): no deadline there. torchrun ends them when rank 0 dies.
CONTROL_TIMEOUT = timedelta(days=7)


@dataclass
class Sequence:
    """One trajectory as the update sees it (all arrays [S]); what rank 0 sends the other ranks."""

    token_ids_S: np.ndarray
    loss_mask_S: np.ndarray
    advantages_S: np.ndarray
    sampler_logprobs_S: np.ndarray
    teacher_logprobs_S: np.ndarray | None = None  # identity privileged view; needed by the SDAR term
    ref_logprobs_S: np.ndarray | None = None  # the reference policy's (services/trainer/reference.py); the KL term


SEQUENCE_FIELDS = ("token_ids_S", "loss_mask_S", "advantages_S", "sampler_logprobs_S", "teacher_logprobs_S", "ref_logprobs_S")
_WIRE_KINDS = "biuf"  # bool, signed/unsigned int, float: the only array kinds a message may carry


@dataclass
class World:
    """This process's place among the trainer's ranks; the default `World()` is a single process.

    device: where the model trains (cuda:LOCAL_RANK on GPUs). control: the
    gloo group carrying rank 0's messages (None in a single process).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control: Any = None

    @property
    def distributed(self) -> bool:
        return self.size > 1


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """The trainer's device for model.device `setting` ("auto" | "cpu" | "cuda") on local rank `local_rank`.

    "auto" is cuda when torch sees a GPU, else cpu; cuda means cuda:`local_rank`.
    Raises RuntimeError for "cuda" without a usable GPU or a local rank beyond the GPUs.
    """
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if setting not in ("auto", "cuda"):
        raise ValueError(f"unknown model.device {setting!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("model.device is cuda but torch sees no GPU")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", local_rank)


def init_from_env(device: str = "auto") -> World:
    """The `World` torchrun describes in RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.

    WORLD_SIZE unset or 1: no process group (a single process). Otherwise the
    default process group starts (nccl on CUDA, gloo on CPU; env:// rendezvous),
    the CUDA device is set to cuda:LOCAL_RANK (so "cuda" means this rank's GPU),
    and a gloo group is made for rank 0's messages. `device` is model.device.
    Raises ValueError for non-integer or inconsistent variables; the process
    group's own errors (RuntimeError, DistNetworkError) for a failed rendezvous.
    """
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise ValueError(f"torchrun variables must be integers: {e}") from e
    if size < 1 or not 0 <= rank < size or local_rank < 0:
        raise ValueError(f"bad torchrun variables: RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local_rank}")
    dev = resolve_device(device, local_rank)
    if size == 1:
        return World(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    log.info("rank %d of %d on %s (%s), host %s, local rank %d of %s", rank, size, dev, dist.get_backend(),
             socket.gethostname(), local_rank, os.environ.get("LOCAL_WORLD_SIZE", "?"))
    return World(rank=rank, size=size, local_rank=local_rank, device=dev, control=control)


# ---------------------------------------------------------------------------
# Collectives the update uses


def all_reduce(values: list[float], op: Literal["sum", "max"], world: World | None) -> list[float]:
    """`values` summed (or maxed) element-wise over all ranks, in float64; unchanged in a single process.

    A collective: every rank must call it with as many values, in the same order.
    """
    if world is None or not world.distributed:
        return [float(v) for v in values]
    dev = world.device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def shard(seqs: list[Sequence], rank: int, world_size: int) -> list[Sequence]:
    """Rank `rank`'s share of `seqs`: a deterministic split balanced by sequence length (tokens).

    Longest first, each sequence goes to the rank with the fewest tokens so far
    (ties: the lower rank); a rank keeps its sequences in their original order.
    Every sequence lands on exactly one rank; a rank may get none (fewer
    sequences than ranks). Raises ValueError for a rank outside [0, world_size).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    loads = [0] * world_size
    owner = [0] * len(seqs)
    for i in sorted(range(len(seqs)), key=lambda i: (-len(seqs[i].token_ids_S), i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += len(seqs[i].token_ids_S)
    return [s for s, r in zip(seqs, owner) if r == rank]


# ---------------------------------------------------------------------------
# Rank 0's messages: msgpack bytes in a uint8 tensor


@dataclass
class Message:
    """What rank 0 tells the other ranks: op "update" (run ppo_update on `seqs`), "gather"
    (collect the full weights, and the optimizer state when args["optimizer"]), "resume"
    (`share_resume`: the step, config hash and tensor list of rank 0's resume point) or "stop"."""

    op: str
    seqs: list[Sequence] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)


def _encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    if a.dtype.kind not in _WIRE_KINDS:
        raise ValueError(f"cannot send a {a.dtype} array")
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _decode_array(d: dict) -> np.ndarray:
    if not isinstance(d.get("dtype"), str) or not isinstance(d.get("shape"), list) or not isinstance(d.get("data"), bytes):
        raise ValueError("malformed array: needs dtype (str), shape (list) and data (bytes)")
    dtype = np.dtype(d["dtype"])
    if len(d["shape"]) != 1 or not all(type(n) is int for n in d["shape"]):  # every field is one value per token
        raise ValueError(f"malformed array: shape {d['shape']!r} is not one integer length")
    shape = (d["shape"][0],)
    if dtype.kind not in _WIRE_KINDS or shape[0] < 0 or len(d["data"]) != shape[0] * dtype.itemsize:
        raise ValueError(f"malformed array: {dtype} {shape} in {len(d['data'])} bytes")
    return np.frombuffer(d["data"], dtype=dtype).reshape(shape).copy()  # copy: writable, owns its memory


REQUIRED_FIELDS = SEQUENCE_FIELDS[:4]  # teacher_logprobs_S, ref_logprobs_S may be absent (no SDAR, no KL term)


def _decode_sequence(s: dict):
    """One `Sequence` of a message; ValueError unless the required fields are there with one length."""
    if not isinstance(s, dict) or set(s) - set(SEQUENCE_FIELDS):
        raise ValueError(f"malformed sequence: fields {sorted(s) if isinstance(s, dict) else type(s).__name__}")
    arrays = {f: None if s.get(f) is None else _decode_array(s[f]) for f in SEQUENCE_FIELDS}
    missing = [f for f in REQUIRED_FIELDS if arrays[f] is None]
    lengths = {len(a) for a in arrays.values() if a is not None}
    if missing or len(lengths) > 1:
        raise ValueError(f"malformed sequence: missing {missing}, lengths {sorted(lengths)}")
    return Sequence(**arrays)


def encode_message(msg: Message) -> bytes:
    """`msg` as msgpack bytes: arrays as {dtype, shape, data}; `args` values must be msgpack types.

    Raises ValueError for an array of another kind than bool/int/float.
    """
    seqs = [{f: None if getattr(s, f) is None else _encode_array(getattr(s, f)) for f in SEQUENCE_FIELDS} for s in msg.seqs]
    return msgpack.packb({"op": msg.op, "seqs": seqs, "args": msg.args}, use_bin_type=True)


def decode_message(payload: bytes) -> Message:
    """The `Message` of `encode_message` bytes (arrays are fresh copies). Raises ValueError for malformed bytes."""
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        if not isinstance(d, dict) or set(d) != {"op", "seqs", "args"} or not isinstance(d["op"], str) \
                or not isinstance(d["seqs"], list) or not isinstance(d["args"], dict):
            raise ValueError("needs op (str), seqs (list) and args (map)")
        if any(isinstance(v, msgpack.ExtType) for v in d["args"].values()):
            raise ValueError("args hold an extension type")
        return Message(op=d["op"], seqs=[_decode_sequence(s) for s in d["seqs"]], args=d["args"])
    except (msgpack.UnpackException, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed trainer message: {e}") from e


def broadcast_bytes(payload: bytes | None, world: World) -> bytes:
    """Rank 0's `payload` on every rank (the others pass None): its length, then the bytes, over world.control.

    A collective: every rank must call it.
    """
    n = torch.tensor([len(payload) if world.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=world.control)
    if int(n) == 0:
        return b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if world.rank == 0 else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=world.control)
    return payload if world.rank == 0 else buf.numpy().tobytes()


def send(world: World, msg: Message) -> None:
    """Rank 0: broadcast `msg` to the other ranks (each must be in `receive`). Nothing in a single process."""
    if world.distributed:
        broadcast_bytes(encode_message(msg), world)


def receive(world: World) -> Message:
    """Ranks > 0: the next message of rank 0 (blocks until it comes)."""
    return decode_message(broadcast_bytes(None, world))


# Tensor dtypes a resume message may name (torch's names): what model weights and optimizer states hold.
_RESUME_DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")}


def _resume_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What a resume moves, in one order on every rank: "model.<name>" (state_dict) and "optimizer.<index>.<name>"
    (the tensors of optimizer.state_dict()["state"], the checkpoint's keys). References, no copies."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for idx, entry in optimizer.state_dict()["state"].items():
        out.update({f"optimizer.{idx}.{k}": v for k, v in entry.items() if torch.is_tensor(v)})
    return out


def _resume_problem(args: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config_hash: str) -> str | None:
    """Why rank 0's "resume" header (`share_resume`) does not fit this rank's model and optimizer, or None.

    May raise TypeError/ValueError/KeyError/AttributeError on a header of the wrong types (`share_resume` refuses it)."""
    if args.get("config_hash") != config_hash:
        return (f"rank 0 trains config {str(args.get('config_hash'))[:12]}, this rank's config is {config_hash[:12]}: "
                "every node must run the same config file")
    if args.get("step") is None:
        return None
    own = model.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = args.get("param_groups")
    live = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live) or any(
            not isinstance(g, dict) or set(g) != set(ref) or g["params"] != ref["params"] for g, ref in zip(groups, live)):
        return "its optimizer param groups are not this rank's"
    names = set()
    for item in args.get("tensors") or []:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and item[1] in _RESUME_DTYPES
                and isinstance(item[2], list) and all(type(n) is int and n >= 0 for n in item[2])):
            return f"malformed tensor entry {item!r}"
        name, dtype, shape = item[0], _RESUME_DTYPES[item[1]], tuple(item[2])
        if name in names:  # each name is one broadcast: a repeat would leave this rank waiting on one rank 0 never sends
            return f"{name} is named twice"
        names.add(name)
        if name.startswith("model."):
            ref = own.get(name.removeprefix("model."))
            if ref is None or ref.shape != shape or ref.dtype != dtype:
                return f"{name} is {dtype}{list(shape)}, this rank's model has {'none' if ref is None else f'{ref.dtype}{list(ref.shape)}'}"
            continue
        idx, _, field_name = name.removeprefix("optimizer.").partition(".")
        if not name.startswith("optimizer.") or not idx.isdigit() or int(idx) >= len(params) or not field_name:
            return f"{name} names no parameter of this rank's optimizer ({len(params)} parameters)"
        p = params[int(idx)]
        if (shape, dtype) != (tuple(p.shape), p.dtype) and shape != ():  # moments, or a 0-d scalar (AdamW's `step`)
            return f"{name} is {dtype}{list(shape)}, parameter {idx} is {p.dtype}{list(p.shape)}"
    scalars = args.get("scalars")
    if not isinstance(scalars, dict) or any(
            not (isinstance(v, (int, float)) and math.isfinite(v)) or not k.partition(".")[0].isdigit()
            or int(k.partition(".")[0]) >= len(params) or not k.partition(".")[2] for k, v in scalars.items()):
        return f"malformed non-tensor optimizer state {scalars!r}"
    missing = {f"model.{k}" for k in own} - names
    return f"rank 0 sends no {sorted(missing)[:3]}" if missing else None


def share_resume(world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None,
                 config_hash: str) -> int | None:
    """Rank 0's resume point on every rank, sent as tensors over the process group: ranks > 0 need no run dir.

    Rank 0 has loaded its checkpoint into `model` and `optimizer` and passes its `step` (None: a fresh run,
    nothing to share but the config check); ranks > 0 pass None and get rank 0's step back. Every rank passes
    its own `config_hash` (opsd.config.config_hash): nodes read their own config files, and one that differs
    is refused. Wire: one "resume" message (msgpack over `world.control`: the step, the config hash, the
    optimizer's param_groups and non-tensor state, then each tensor's name, dtype and shape, never pickle);
    every rank checks it against its own model and optimizer (names, shapes, dtypes) and all ranks agree
    (an all-reduce) before any tensor moves; then each tensor is broadcast from rank 0 over the default group
    (nccl: on world.device; gloo: on the CPU), flat, one at a time (peak extra memory: the largest tensor),
    and copied in place into the model; the optimizer state goes through `optimizer.load_state_dict`.
    Call it before `parallelize` (the model still whole on every rank: DDP and FSDP2 alike).
    A collective. Raises RuntimeError on every rank when a rank refuses the header or cannot read it (its log names why).
    """
    if not world.distributed:
        return step
    if world.rank == 0:
        args: dict[str, Any] = {"step": step, "config_hash": config_hash}
        tensors = _resume_tensors(model, optimizer) if step is not None else {}
        if step is not None:
            sd = optimizer.state_dict()
            args["param_groups"] = sd["param_groups"]
            args["scalars"] = {f"{i}.{k}": v for i, e in sd["state"].items() for k, v in e.items() if not torch.is_tensor(v)}
            args["tensors"] = [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()]
        send(world, Message("resume", args=args))
        problem = None
    else:
        try:  # a header this rank cannot read is refused like one that does not fit: rank 0 must not wait on it
            msg = receive(world)
            args = msg.args
            problem = (_resume_problem(args, model, optimizer, config_hash) if msg.op == "resume"
                       else f"expected rank 0's resume message, got {msg.op!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            problem = f"malformed resume message from rank 0: {type(e).__name__}: {e}"
    if all_reduce([1.0 if problem else 0.0], "max", world)[0] > 0:  # every rank raises, none waits in a broadcast
        raise RuntimeError(f"rank {world.rank}: " + (problem or "another rank refused rank 0's resume point (see its log)"))
    if args["step"] is None:
        return None
    dev = world.device if dist.get_backend() == "nccl" else torch.device("cpu")
    if world.rank == 0:
        for t in tensors.values():
            dist.broadcast(t.detach().reshape(-1).to(dev).contiguous(), src=0)
        return step
    own = model.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, dtype, shape in args["tensors"]:
        buf = torch.empty(math.prod(shape), dtype=_RESUME_DTYPES[dtype], device=dev)
        dist.broadcast(buf, src=0)
        if name.startswith("model."):
            with torch.no_grad():
                own[name.removeprefix("model.")].copy_(buf.view(shape))
        else:
            idx, _, field_name = name.removeprefix("optimizer.").partition(".")
            state.setdefault(int(idx), {})[field_name] = buf.view(shape).to(params[int(idx)].device if shape else "cpu")
    for key, value in args["scalars"].items():
        idx, _, field_name = key.partition(".")
        state.setdefault(int(idx), {})[field_name] = value
    live = optimizer.state_dict()["param_groups"]
    groups = [{k: tuple(v) if isinstance(ref[k], tuple) else v for k, v in g.items()} for g, ref in zip(args["param_groups"], live)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return args["step"]


# ---------------------------------------------------------------------------
# Wrapping the model


def _sum_hook(_state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook (bucket: dist.GradBucket): all-reduce SUM (DDP's default divides by the world size)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def pick_strategy(world: World, strategy: Strategy = "auto") -> Literal["fsdp2", "ddp"]:
    """"auto": FSDP2 on CUDA when torch has `fully_shard`, else DDP; "fsdp2"/"ddp" as asked."""
    if strategy != "auto":
        return strategy
    import torch.distributed.fsdp as fsdp

    return "fsdp2" if world.device.type == "cuda" and hasattr(fsdp, "fully_shard") else "ddp"  # fully_shard: torch >= 2.6


def wrap_model(model: torch.nn.Module, world: World, strategy: Literal["fsdp2", "ddp"], dtype: str = "float32") -> torch.nn.Module:
    """`model` moved to world.device and wrapped for data parallelism, gradients summed over ranks.

    "ddp": a DistributedDataParallel around `model` (same parameters, replicated;
    broadcast from rank 0 at construction). "fsdp2": `fully_shard` on every
    block named in the model's `_no_split_modules` (transformers' decoder layers)
    and on the root, IN PLACE: `model`'s parameters become DTensor shards, so an
    optimizer built on the old ones must be re-pointed (`parallelize` does it).
    dtype (model.dtype) "bfloat16" under FSDP2: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the
    fp32 shards stay the master weights the optimizer steps while forward and backward run on bf16 copies
    (DDP keeps fp32 parameters: bf16 comes from `opsd.models.hf.autocast`, as in one process).
    A collective: every rank must call it.
    """
    model.to(world.device)
    if strategy == "ddp":
        ddp = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None, forward_sync_buffers=False)
        ddp.register_comm_hook(None, _sum_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" \
        else MixedPrecisionPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for sub in list(model.modules())[1:]:
        if type(sub).__name__ in blocks:
            fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # sum, not mean (module docstring)
            sub.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def _cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` on the CPU, built tensor by tensor (never a second full copy on the GPU); ties kept."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        c = t.detach().to("cpu", copy=True)
        memo[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
    return copy.deepcopy(model, memo).eval()


class FullOptimizerState:
    """Rank 0's gathered optimizer state in torch.optim's index-keyed form; `state_dict()` is all it offers
    (what services.trainer.checkpoint.save_checkpoint reads)."""

    def __init__(self, fqn_state: dict):
        flat = [fqn for g in fqn_state["param_groups"] for fqn in g["params"]]
        index = {fqn: i for i, fqn in enumerate(flat)}
        self._sd = {
            "state": {index[fqn]: st for fqn, st in fqn_state["state"].items()},
            "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in fqn_state["param_groups"]],
        }

    def state_dict(self) -> dict:
        return self._sd


class Parallel:
    """The model and optimizer of one rank, wrapped for data parallelism (see `parallelize`).

    module: what `ppo_update` runs (DDP wrapper, FSDP2 module, or the plain model
    in a single process). mirror: rank 0 under FSDP2, a CPU copy of the full
    weights that `gather` refreshes (publishing and checkpoints write it).
    """

    def __init__(self, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str | None):
        self.world, self.plain, self.optimizer, self.strategy = world, model, optimizer, strategy
        self.module: torch.nn.Module = model
        self.mirror: torch.nn.Module | None = None

    def gather(self, optimizer: bool = False) -> tuple[torch.nn.Module | None, Any]:
        """Rank 0: (a module holding the full current weights, the full optimizer state or None).

        Single process and DDP: the model and optimizer themselves (replicated,
        nothing to gather). FSDP2: tells the other ranks to join (`follow`), then
        all-gathers the weights into `mirror` (and the optimizer state, as a
        `FullOptimizerState`, when `optimizer`). Ranks > 0 get (None, None).
        """
        if self.strategy != "fsdp2":
            return self.plain, self.optimizer
        if self.world.rank == 0:
            send(self.world, Message("gather", args={"optimizer": optimizer}))
        return self._collect(optimizer)

    def _collect(self, optimizer: bool) -> tuple[torch.nn.Module | None, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors on rank 0's CPU only
        weights = get_model_state_dict(self.module, options=opts)
        opt_state = get_optimizer_state_dict(self.module, self.optimizer, options=opts) if optimizer else None
        if self.world.rank != 0:
            return None, None
        self.mirror.load_state_dict(weights)
        return self.mirror, FullOptimizerState(opt_state) if optimizer else None

    def stop(self) -> None:
        """Rank 0: let the other ranks' `follow` return."""
        if self.world.rank == 0:
            send(self.world, Message("stop"))


def parallelize(world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy = "auto",
                dtype: str = "float32") -> Parallel:
    """Wrap `model` (weights and `optimizer` state already loaded, e.g. from a checkpoint) for `world`.

    Single process: nothing changes. DDP: `model` moves to world.device (with
    the optimizer's state) and gets a DDP wrapper. FSDP2: rank 0 first keeps a
    CPU copy (`Parallel.mirror`, one more copy of the weights in host memory),
    then `model` is sharded in place and `optimizer` re-pointed at the shards,
    its state (if any) sharded the same way; dtype (model.dtype) picks FSDP2's mixed precision (`wrap_model`).
    A collective.
    """
    if not world.distributed:
        return Parallel(world, model, optimizer, None)
    kind = pick_strategy(world, strategy)
    par = Parallel(world, model, optimizer, kind)
    model.to(world.device)
    _move_optimizer_state(optimizer)
    if kind == "ddp":
        par.module = wrap_model(model, world, kind)
        return par
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if world.rank == 0:
        par.mirror = _cpu_copy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    state = {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state}
    par.module = wrap_model(model, world, kind, dtype)
    shards = dict(model.named_parameters())
    for g, group_fqns in zip(optimizer.param_groups, fqns):
        g["params"] = [shards[n] for n in group_fqns]
    optimizer.state.clear()
    if state:
        full = {"state": state, "param_groups": [{**g, "params": f} for g, f in zip(optimizer.param_groups, fqns)]}
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
    return par


def _move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put the optimizer's per-parameter tensors on their parameter's device (after `model.to(device)`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.device != p.device:  # AdamW's scalar step stays on the CPU
                    optimizer.state[p][k] = v.to(p.device)


# ---------------------------------------------------------------------------
# Ranks > 0
