"""Scaling: how each role's per-group time grows with group size G and turns K.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scaling.py [--quick] [--json OUT] [--model NAME_OR_DIR]
                                                             [--budget-s 900] [--group-sizes ...] [--turns ...]

For each cell of G in {4, 8, 16} x K in {4, 16, 50} one fresh group goes
through each role's real function, in this process:

- rollout:  services.rollout.episodes.run_group with the transformers backend
  on a synthetic environment registered as an env adapter: it accepts every
  action, never ends early and always answers the same short observation
  (`--obs-tokens` ids; also after an invalid reply), so every episode plays
  exactly K turns of the same size (~14 ids of chat template + the observation
  + at most `--max-new-tokens` sampled ids) after a first prompt of ~86 ids
  (system prompt and a one-shot example, as TextWorld's). Rewards are 0/1
  from a hash of the action, so GRPO has something to normalize.
- teacher:  services.teacher.scoring.score_group on that group, twice:
  "identity" (no embedder: identity views only, one cached pass per
  trajectory) and "aligned" (AlignOPSD: the teacher's own response at every
  turn, correspondences, matched sibling views in pass 2). The aligned run
  reaches the embedder through an in-process client calling the service's own
  `correspond` function (no HTTP); that time is taken out of the teacher's.
- embedder: services.embedder.app.correspond (what POST /correspond runs) on
  the aligned teacher's request: G*K turns, all-MiniLM-L6-v2 on the CPU.
- credit:   opsd.credit.compute_advantages for grpo, agentopsd and alignopsd
  on the group's CreditBatch (services.trainer.batch.build_credit_batch).
- trainer:  services.trainer.update.ppo_update (1 epoch, AdamW, the default
  micro-batch) over the G trajectories with alignopsd's advantages, on its own
  copy of the weights (the rollout keeps the initial policy).

Model roles run once per cell, after one warm-up of every role on a small
group (G 4, K 2); the embedder takes the median of `--repeats` runs, credit
(milliseconds) of ten times as many. Each role's time is taken as wall time
and as this process's CPU time (one torch thread: the CPU time is the work,
the wall time also holds waiting for a shared machine's cores). "model
share" is the part of a role's wall time inside the model: backend.generate /
backend.branch, the sentence encoder's embed. Growth: time ~ G^a at fixed K
and ~ K^b at fixed G (least-squares slope of log CPU time on log G / log K),
and a joint fit over all measured cells.

Budget: with SmolLM2-135M (the default model) on one core the full grid
takes hours, almost all of it the model's forward passes (the rollout
prefills each episode's whole history again at every turn: O(G K^2) ids).
So cells run smallest first (G 4 K 4, G 8 K 4 and G 4 K 16 first, for a fit on
both axes) while they fit in `--budget-s` wall seconds (default 900); a cell
predicted to pass it is skipped, and its time is predicted from the largest
measured cell, each role scaled by its work (`work`). Past the measured turns
such a prediction runs low (attention over longer contexts; the teacher's
decode batches shrink as its prefixes grow): G 4 K 50 took 1.3-1.9x its model
roles' prediction from K 16. `--budget-s 0` runs the whole grid.

`--quick` runs G 4 x K 4, 16 on `tiny-random` (a 2-layer random Llama with
SmolLM2's tokenizer: every code path, little model compute; its replies are
never in format, so AlignOPSD matches nothing) in about half a minute.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import types
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import Row, command_line, machine, write_json  # noqa: E402
from opsd.chat import ChatFormat  # noqa: E402
from opsd.config import RunConfig  # noqa: E402
from opsd.credit import compute_advantages  # noqa: E402
from opsd.embedding_api import CorrespondRequest  # noqa: E402
from opsd.envs import ADAPTERS, ClosingEnv, EnvPrompt, EnvStep, Task  # noqa: E402
from opsd.models import load_backend  # noqa: E402
from opsd.models.packaged import TINY_RANDOM  # noqa: E402
from opsd.types import TaskGroup  # noqa: E402
from opsd.encoder import Encoder  # noqa: E402
from services.embedder.app import correspond  # noqa: E402
from services.rollout.episodes import run_group  # noqa: E402
from services.teacher.scoring import score_group  # noqa: E402
from services.trainer.batch import build_credit_batch, scatter_advantages  # noqa: E402
from services.trainer.update import Sequence, ppo_update  # noqa: E402

GROUP_SIZES = (4, 8, 16)
TURNS = (4, 16, 50)
QUICK_GROUP_SIZES = (4,)
QUICK_TURNS = (4, 16)
CREDIT_METHODS = ("grpo", "agentopsd", "alignopsd")
ROLES = ("rollout", "teacher (identity)", "teacher (aligned)", "embedder",
         *(f"credit {m}" for m in CREDIT_METHODS), "trainer")
MODEL_ROLES = ("rollout", "teacher (identity)", "teacher (aligned)", "trainer")

# -- the synthetic environment ------------------------------------------------

SYNTH_ENV = "scaling_synthetic"
# The system prompt and the one-shot example of TextWorld's adapter, shortened: with them SmolLM2 replied in
# format 91% of the time (8 episodes x 4 turns), without the example 0-16%, which leaves AlignOPSD nothing to match.
_PROMPT = EnvPrompt(
    system={f: ("You are playing a text adventure game. Each turn, choose one command and reply with it inside "
                "<action></action>, for example <action>open box</action>.") for f in ("action", "think")},
    example=("You see a box, a key.", [], {
        "action": "<action>open box</action>",
        "think": "<think>The box may hold something.</think><action>open box</action>",
    }),
)
_WORDS = ("door", "lamp", "key", "box", "table", "chest", "north exit", "south exit")
PRIVILEGED = "Walkthrough: take the key, open the chest, go north."


def observation_text(tokenizer, n_tokens: int) -> str:
    """A fixed observation of about `n_tokens` ids: "You see a door, a lamp, ..."."""
    text = "You see a door."
    for i in range(1, 64):
        longer = "You see " + ", ".join(f"a {_WORDS[j % len(_WORDS)]}" for j in range(i + 1)) + "."
        if len(tokenizer.encode(longer)) > n_tokens:
            break
        text = longer
    return text


class FixedEnv(ClosingEnv):
    """An Env (opsd/envs/base.py) that accepts every action, never ends and always shows `observation`.

    The step reward is 0 or 1 from a hash of the action (rewards are terminal:
    the episode's reward is its last step's), so siblings differ.
    """

    def __init__(self, observation: str):
        self.observation = observation

    def _step(self, reward: float = 0.0) -> EnvStep:
        return EnvStep(observation=self.observation, admissible_commands=[], won=False, lost=False, done=False,
                       score=0.0, reward=reward)

    def reset(self) -> EnvStep:
        return self._step()

    def step(self, action: str) -> EnvStep:
        return self._step(float(zlib.crc32(action.encode()) % 2))

    def close(self) -> None:
        pass


def register_synthetic_env(observation: str) -> None:
    """Register the FixedEnv adapter as env SYNTH_ENV (in this process only): run_group plays it like any env."""
    mod = types.ModuleType(f"opsd_bench_{SYNTH_ENV}")
    mod.NAME = SYNTH_ENV
    mod.ACTION_TAGS = ("action",)
    mod.METRIC = "success"
    mod.PROMPT = _PROMPT
    mod.make_tasks = lambda cfg, ctx, split: [Task("synthetic-0", "synthetic", {})]
    mod.open_env = lambda task, cfg, ctx: FixedEnv(observation)
    sys.modules[mod.__name__] = mod
    ADAPTERS[SYNTH_ENV] = mod.__name__


# -- timing -------------------------------------------------------------------


@dataclass
class Clock:
    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def clock() -> Iterator[Clock]:
    """Wall and process CPU seconds of the block (filled in when it ends)."""
    c = Clock()
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        yield c
    finally:
        c.wall, c.cpu = time.perf_counter() - w0, time.process_time() - c0


class TimedBackend:
    """The backend, with the wall seconds spent inside generate/branch (the model) added up in `model_s`."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.model_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.model_s += time.perf_counter() - t0

    def generate(self, *args, **kwargs):
        return self._timed(self.inner.generate, *args, **kwargs)

    def branch(self, *args, **kwargs):
        return self._timed(self.inner.branch, *args, **kwargs)


class TimedEncoder:
    """The embedder's Encoder, with the wall seconds spent in `embed` (the sentence model) in `model_s`."""

    def __init__(self, inner: Encoder):
        self.inner = inner
        self.dim = inner.dim
        self.model_s = 0.0

    def embed(self, texts: list[str]) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.inner.embed(texts)
        finally:
            self.model_s += time.perf_counter() - t0


class InProcessEmbedder:
    """The teacher's EmbedderClient interface (`correspond(payload) -> dict`), answered by the embedder
    service's own `correspond` function in this process (no HTTP); keeps the request and the time it took."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self.clock = Clock()
        self.request: CorrespondRequest | None = None

    def correspond(self, payload: dict) -> dict:
        with clock() as c:
            self.request = CorrespondRequest.model_validate(payload)
            out = correspond(self.encoder, self.request).model_dump()
        self.clock.wall += c.wall
        self.clock.cpu += c.cpu
        return out


@dataclass
class Cell:
    """One (G, K) cell: wall and CPU seconds and model share per role, plus sizes."""

    G: int
    K: int
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    model_share: dict[str, float] = field(default_factory=dict)
    info: dict[str, float] = field(default_factory=dict)


def median_clock(fn, repeats: int) -> tuple[Clock, float]:
    """Median wall and median CPU seconds of `repeats` calls of fn() (after one untimed call), and the
    wall seconds of all the calls together."""
    clocks = []
    for _ in range(repeats + 1):
        with clock() as c:
            fn()
        clocks.append(c)
    timed = clocks[1:]
    return (Clock(float(np.median([c.wall for c in timed])), float(np.median([c.cpu for c in timed]))),
            sum(c.wall for c in clocks))


# -- one cell -----------------------------------------------------------------


@dataclass
class Bench:
    cfg: RunConfig
    env_cfg: Any  # EnvSection naming SYNTH_ENV
    backend: TimedBackend
    chat: ChatFormat
    encoder: TimedEncoder
    train_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    repeats: int

    def run_cell(self, G: int, K: int, seed: int = 0) -> Cell:
        """Every role once on one fresh group of G siblings x K turns; returns its Cell.

        Raises RuntimeError when an episode played fewer than K turns (the
        turns do not fit max_model_len) or the in-process embedder failed.
        """
        cell = Cell(G, K)
        cfg = self.cfg

        def record(role: str, c: Clock, model_s: float | None) -> None:
            cell.wall[role], cell.cpu[role] = c.wall, c.cpu
            cell.model_share[role] = float("nan") if model_s is None else model_s / c.wall

        task = TaskGroup(group_id=f"g{G}k{K}", task_id="synthetic-0", step=0, policy_version=0, group_size=G,
                         env=SYNTH_ENV, game=Task("synthetic-0", "synthetic", {}).to_dict(),
                         privileged_info=PRIVILEGED, max_turns=K, category="synthetic")
        self.backend.model_s = 0.0
        with clock() as c:
            group, stats = run_group(task, self.backend, self.chat, self.env_cfg, cfg.rollout, cfg.model.max_model_len,
                                     seed=seed)
        record("rollout", c, self.backend.model_s)
        turns = [len(t.turns) for t in group.trajectories]
        if min(turns) != K:
            endings = sorted({t.ending for t in group.trajectories})
            raise RuntimeError(f"G={G} K={K}: episodes played {min(turns)}..{max(turns)} turns, not {K} (endings "
                               f"{endings}): lower --obs-tokens or --max-new-tokens")
        S_traj = float(np.mean([len(t.token_ids_S) for t in group.trajectories]))
        cell.info["first prompt ids"] = float(group.trajectories[0].turns[0].response_start)
        cell.info["ids per turn"] = (S_traj - cell.info["first prompt ids"]) / K
        cell.info["new ids per turn"] = stats.generated_tokens / stats.turns
        cell.info["valid turns %"] = 100.0 * stats.valid_turns / stats.turns

        self.backend.model_s = 0.0
        with clock() as c:
            score_group(group, self.backend, self.chat, cfg, None)
        record("teacher (identity)", c, self.backend.model_s)

        client = InProcessEmbedder(self.encoder.inner)
        self.backend.model_s = 0.0
        with clock() as c:
            scored, tstats = score_group(group, self.backend, self.chat, cfg, client)
        if scored.identity_fallback or client.request is None:
            raise RuntimeError(f"G={G} K={K}: the in-process embedder failed (see the log)")
        record("teacher (aligned)", Clock(c.wall - client.clock.wall, c.cpu - client.clock.cpu), self.backend.model_s)
        cell.info["matched views"] = float(tstats.sources)

        self.encoder.model_s = 0.0
        c, total_s = median_clock(lambda: correspond(self.encoder, client.request), self.repeats)
        record("embedder", c, self.encoder.model_s * c.wall / total_s)

        batch, rows = build_credit_batch([group], [scored])
        for method in CREDIT_METHODS:
            # Milliseconds each: ten times the repeats, or the median is the machine's noise.
            c, _ = median_clock(lambda m=method: compute_advantages(m, batch, cfg.credit), 10 * self.repeats)
            record(f"credit {method}", c, 0.0)

        adv = scatter_advantages([group], rows, compute_advantages("alignopsd", batch, cfg.credit)[0])
        seqs = [Sequence(t.token_ids_S, t.loss_mask_S, adv[(0, i)], t.sampler_logprobs_S, scored.teacher_logprobs_S[i])
                for i, t in enumerate(group.trajectories)]
        with clock() as c:
            ppo_update(self.train_model, self.optimizer, seqs, cfg.trainer, cfg.model.dtype, cfg.rollout.temperature,
                       cfg.credit.sdar)
        record("trainer", c, None)  # forward + backward is the whole update: no split
        return cell


# -- the grid within a time budget -------------------------------------------


def work(role: str, G: int, K: int, prompt_ids: float, ids_per_turn: float) -> float:
    """What `role`'s time is proportional to, for G episodes of K turns whose first prompt holds
    `prompt_ids` and whose every turn adds `ids_per_turn` ids.

    rollout: prompt ids prefilled, summed over turns (each turn prefills the whole history again);
    teacher, trainer: ids of the group's trajectories (one pass each; the teacher's own responses
    and matched views add per-turn work in proportion); embedder, credit: the group's turns.
    """
    if role == "rollout":
        return G * (K * prompt_ids + ids_per_turn * K * (K - 1) / 2)
    if role in MODEL_ROLES:
        return G * (prompt_ids + ids_per_turn * K)
    return float(G * K)


def predict(ref: Cell, G: int, K: int) -> dict[str, Clock]:
    """Predicted seconds per role of cell (G, K): each role's time in the measured cell `ref`, scaled by its `work`."""
    p, u = ref.info["first prompt ids"], ref.info["ids per turn"]
    out = {}
    for role in ROLES:
        f = work(role, G, K, p, u) / work(role, ref.G, ref.K, p, u)
        out[role] = Clock(ref.wall[role] * f, ref.cpu[role] * f)
    return out


def reference(cells: list[Cell]) -> Cell:
    """The measured cell predictions scale from: the most turns, then the largest group."""
    return max(cells, key=lambda c: (c.K, c.G))


Predictions = dict[tuple[int, int], dict[str, Clock]]  # (G, K) -> role -> predicted seconds


def run_grid(bench: Bench, Gs: list[int], Ks: list[int], budget_s: float) -> tuple[list[Cell], Predictions]:
    """Run the cells of Gs x Ks within `budget_s` wall seconds (0: no limit), counted from the warm-up's start.

    Order: the corner cells (smallest G and K, the next G, the next K: enough
    for a first fit on both axes), then the cheapest predicted cell first. A
    cell whose predicted wall time would pass the budget is skipped. Returns
    the measured cells and, per skipped cell, its predicted seconds per role
    (from the final reference cell).
    """
    t0 = time.perf_counter()
    bench.run_cell(Gs[0], min(Ks[0], 2), seed=1)  # warm-up: first calls allocate caches and AdamW's state
    corner = [(Gs[0], Ks[0]), *([(Gs[1], Ks[0])] if len(Gs) > 1 else []), *([(Gs[0], Ks[1])] if len(Ks) > 1 else [])]
    todo = [(G, K) for G in Gs for K in Ks]
    cells: list[Cell] = []
    skipped: list[tuple[int, int]] = []
    while todo:
        preds = {gk: predict(reference(cells), *gk) for gk in todo} if cells else {}
        wall = {gk: sum(c.wall for c in p.values()) for gk, p in preds.items()}
        pick = next((gk for gk in corner if gk in todo), None) or min(todo, key=wall.__getitem__)
        todo.remove(pick)
        need = wall.get(pick, 0.0)
        elapsed = time.perf_counter() - t0
        if budget_s and cells and elapsed + need > budget_s:
            skipped.append(pick)
            print(f"G={pick[0]:>2} K={pick[1]:>2}: skipped, predicted {need:.0f} s wall with "
                  f"{budget_s - elapsed:.0f} s of the budget left", flush=True)
            continue
        cells.append(bench.run_cell(*pick))
        c = cells[-1]
        print(f"G={c.G:>2} K={c.K:>2}: " + ", ".join(f"{r} {c.cpu[r]:.3g}" for r in ROLES)
              + f" CPU s [{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}]", flush=True)
    ref = reference(cells)
    return cells, {gk: predict(ref, *gk) for gk in sorted(skipped)}


# -- fitting and printing -----------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(ys) on log(xs); NaN with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def exponents(cells: list[Cell], role: str) -> dict[str, float]:
    """From CPU seconds: a@K=k, slope of log t on log G at fixed K; b@G=g, on log K at fixed G;
    "a" and "b": the joint fit log t = c + a log G + b log K over all cells (NaN where a grid axis has one value)."""
    Gs = sorted({c.G for c in cells})
    Ks = sorted({c.K for c in cells})
    out: dict[str, float] = {}
    for K in Ks:
        pts = sorted((c.G, c.cpu[role]) for c in cells if c.K == K)
        out[f"a@K={K}"] = slope([p[0] for p in pts], [p[1] for p in pts])
    for G in Gs:
        pts = sorted((c.K, c.cpu[role]) for c in cells if c.G == G)
        out[f"b@G={G}"] = slope([p[0] for p in pts], [p[1] for p in pts])
    cols = [np.ones(len(cells))] + [np.log([getattr(c, ax) for c in cells]) for ax, vals in (("G", Gs), ("K", Ks))
                                    if len(vals) > 1]
    coef = np.linalg.lstsq(np.column_stack(cols), np.log([c.cpu[role] for c in cells]), rcond=None)[0]
    fitted = iter(coef[1:])
    out["a"] = float(next(fitted)) if len(Gs) > 1 else float("nan")
    out["b"] = float(next(fitted)) if len(Ks) > 1 else float("nan")
    return out


def _fmt(x: float) -> str:
    return "n/a" if np.isnan(x) else f"{x:.2f}"


def print_tables(cells: list[Cell], skipped: Predictions) -> dict[str, dict[str, float]]:
    """Print seconds per role and cell, the sizes, the predictions for skipped cells and the fitted exponents;
    returns the exponents."""
    order = sorted(cells, key=lambda c: (c.G, c.K))
    heads = [f"G={c.G} K={c.K}" for c in order]
    print("\nCPU seconds per group [wall seconds] (model share of the wall time)")
    print(f"| role | {' | '.join(heads)} |")
    print(f"|---|{'---:|' * len(order)}")
    for role in ROLES:
        vals = []
        for c in order:
            share = c.model_share[role]
            vals.append(f"{c.cpu[role]:.3g} [{c.wall[role]:.3g}]" + ("" if np.isnan(share) or share == 0
                                                                      else f" ({share:.0%})"))
        print(f"| {role} | {' | '.join(vals)} |")
    for key in order[0].info:
        print(f"| _{key}_ | {' | '.join(f'{c.info[key]:.1f}' for c in order)} |")
    if skipped:
        ref = reference(cells)
        print(f"\nskipped (over --budget-s): predicted CPU seconds, each role's time at G={ref.G} K={ref.K} "
              "scaled by its work (rollout: prefilled ids; teacher, trainer: trajectory ids; others: turns)")
        print(f"| role | {' | '.join(f'G={G} K={K}' for G, K in skipped)} |")
        print(f"|---|{'---:|' * len(skipped)}")
        for role in ROLES:
            print(f"| {role} | {' | '.join(f'{p[role].cpu:.3g}' for p in skipped.values())} |")
    fits = {role: exponents(cells, role) for role in ROLES}
    keys = list(fits[ROLES[0]])
    print("\nfitted growth of CPU time over the measured cells: ~ G^a at fixed K (a@K), ~ K^b at fixed G (b@G); "
          "a, b: joint fit log t = c + a log G + b log K")
    print(f"| role | {' | '.join(keys)} |")
    print(f"|---|{'---:|' * len(keys)}")
    for role in ROLES:
        print(f"| {role} | {' | '.join(_fmt(fits[role][k]) for k in keys)} |")
    return fits


def result_rows(cells: list[Cell], fits: dict[str, dict[str, float]], skipped: Predictions,
                model: str) -> list[Row]:
    """Per role: CPU seconds at the largest measured cell (all cells in the note) and the joint exponents a, b;
    then one row per skipped cell with its predicted wall seconds."""
    big = max(cells, key=lambda c: (c.G * c.K, c.K))
    rows = [Row("cells measured", len(cells), "cells", note=f"{model}; {len(skipped)} more skipped (over --budget-s)")]
    for role in ROLES:
        others = ", ".join(f"G{c.G}K{c.K} {c.cpu[role]:.3g}" for c in sorted(cells, key=lambda c: (c.G, c.K)))
        share = big.model_share[role]
        rows.append(Row(f"{role}: CPU s per group at G={big.G} K={big.K}", big.cpu[role], "s", note=(
            f"wall {big.wall[role]:.3g} s" + ("" if np.isnan(share) else f", model share {share:.0%}")
            + f"; CPU s per cell: {others}")))
        for ax, what in (("a", "G"), ("b", "turns")):
            v = fits[role][ax]
            rows.append(Row(f"{role}: growth exponent in {what} ({ax})", None if np.isnan(v) else v, "", note=(
                "time ~ G^a K^b, least squares on log CPU time over the measured cells" if not np.isnan(v)
                else f"one value of {what} measured")))
    for (G, K), pred in skipped.items():
        rows.append(Row(f"predicted wall s per group at G={G} K={K} (not run)", sum(c.wall for c in pred.values()), "s",
                        note="over --budget-s; " + ", ".join(f"{r} {pred[r].cpu:.3g}" for r in MODEL_ROLES)
                        + " CPU s (scaled from the largest measured cell; low past the measured turns)"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"G {QUICK_GROUP_SIZES} x K {QUICK_TURNS} on {TINY_RANDOM} unless --model is given")
    ap.add_argument("--model", default=None, help="packaged model name, tiny-random, or a local HF directory "
                                                  "(default: the config's, SmolLM2-135M-Instruct)")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=None, help=f">= 1 each; default {GROUP_SIZES}")
    ap.add_argument("--turns", type=int, nargs="+", default=None, help=f">= 1 each; default {TURNS}")
    ap.add_argument("--obs-tokens", type=int, default=8, help="ids of the fixed observation text")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="student and teacher new ids per turn")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of the embedder (median); credit: 10x as many")
    ap.add_argument("--budget-s", type=float, default=900.0,
                    help="wall seconds for the grid, >= 0: a cell predicted to pass it is skipped (0: run every cell)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    args = ap.parse_args()
    if not args.budget_s >= 0:  # also NaN
        ap.error(f"--budget-s must be >= 0 seconds (0: no budget, every cell runs); got {args.budget_s:g}")
    for flag, values in (("--group-sizes", args.group_sizes), ("--turns", args.turns)):
        if values and min(values) < 1:  # a 0 gives empty groups and NaN fits
            ap.error(f"{flag} values must be >= 1; got {' '.join(map(str, values))}")
    Gs = args.group_sizes or (QUICK_GROUP_SIZES if args.quick else GROUP_SIZES)
    Ks = args.turns or (QUICK_TURNS if args.quick else TURNS)
    model = args.model or (TINY_RANDOM if args.quick else None)

    torch.manual_seed(0)
    cfg = RunConfig.model_validate({
        "run": {"method": "alignopsd"},
        "model": {"max_model_len": args.max_model_len, "threads": args.threads, "device": "cpu",
                  **({"name": model} if model else {})},
        "rollout": {"max_new_tokens": args.max_new_tokens, "batch_size": max(Gs)},
        "teacher": {"thinking_max_new_tokens": args.max_new_tokens},
        "embedder": {"device": "cpu"},
    })
    t0 = time.perf_counter()
    inner = load_backend(cfg.model, device="cpu", backend="hf")
    obs = observation_text(inner.tokenizer, args.obs_tokens)
    register_synthetic_env(obs)
    # EnvSection.name accepts only the shipped envs: the synthetic one is set without validation.
    env_cfg = cfg.env.model_copy(update={"name": SYNTH_ENV, "list_admissible": False, "invalid_feedback": obs,
                                         "one_shot": True})
    train_model = copy.deepcopy(inner.model)
    bench = Bench(
        cfg, env_cfg, TimedBackend(inner), ChatFormat.for_env(inner.tokenizer, env_cfg),
        TimedEncoder(Encoder(cfg.embedder.encoder, device="cpu")), train_model,
        torch.optim.AdamW(train_model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay),
        args.repeats,
    )
    print(f"model {cfg.model.name}, {args.threads} torch thread(s), max_model_len {args.max_model_len}; "
          f"observation {len(inner.tokenizer.encode(obs))} ids, <= {args.max_new_tokens} new ids per turn; "
          f"loaded in {time.perf_counter() - t0:.0f} s", flush=True)

    t0 = time.perf_counter()
    cells, skipped = run_grid(bench, sorted(Gs), sorted(Ks), args.budget_s)
    fits = print_tables(cells, skipped)
    print(f"machine: {machine()}; grid took {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, "scaling", command_line(), result_rows(cells, fits, skipped, cfg.model.name))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
