"""A small run directory with real credit dumps, for the `opsd inspect` tests and benchmark.

`write_run(run_dir)` writes `metrics.jsonl`, a word-level `checkpoint/tokenizer.json`
and one dump per registered credit method (`credit/step_NNNNN.json`, step i =
`opsd.credit.registered()[i]`) through the trainer's own dump code
(services/trainer/dump.py) from factory groups (tests/factories.py): the same
bytes `opsd run --dump-credit` writes, without a model.
`served(run_dir)` runs `opsd inspect` on it as a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from opsd.config import RunConfig
from opsd.credit import compute_advantages, registered
from opsd.types import RolloutGroup, ScoredGroup
from services.trainer.batch import build_credit_batch
from services.trainer.dump import write_credit_dump
from tests.factories import VOCAB_SIZE, make_scored_group


def with_alignopsd_fields(sg: ScoredGroup, seed: int = 0, D: int = 8) -> ScoredGroup:
    """`sg` plus the texts, unit embeddings and cross log-probs an AlignOPSD dump needs (the embedder's output)."""
    rng = np.random.default_rng(seed)
    turns = sg.rollout.canonical_turns()
    recs = [sg.rollout.trajectories[i].turns[k] for i, k in turns]
    M = len(turns)
    sg.student_thinking_M = [r.action for r in recs]
    sg.student_action_M = [r.action for r in recs]
    sg.teacher_action_M = ["look" if m % 3 else "" for m in range(M)]
    sg.teacher_response_M = [f"<action>{a}</action>" for a in sg.teacher_action_M]

    # One direction per action text, plus a little noise: turns taking the same action in sibling
    # rollouts are similar, so AlignOPSD's replay selects sources (random vectors would match nothing).
    base = {a: rng.normal(size=D) for a in sorted({r.action for r in recs})}

    def unit(keys: list[str], present: list[str]) -> np.ndarray:
        e = np.stack([base[k] for k in keys]) + rng.normal(scale=0.1, size=(M, D))
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        e[[not x for x in present]] = 0
        return e.astype(np.float32)

    acts = sg.student_action_M
    sg.student_thinking_emb_MD = unit(acts, sg.student_thinking_M)
    sg.teacher_thinking_emb_MD = unit(acts, sg.teacher_thinking_M)
    sg.student_action_emb_MD = unit(acts, acts)
    sg.teacher_action_emb_MD = unit(acts, sg.teacher_action_M)
    sg.cross_logprobs_M = [
        -rng.exponential(1.0, (len(sg.selected_sources_M[m]), r.response_end - r.response_start)).astype(np.float32)
        for m, r in enumerate(recs)
    ]
    return sg


def step_groups(tasks: int = 2, G: int = 3, turns: int = 3, seed: int = 0) -> tuple[list[RolloutGroup], list[ScoredGroup]]:
    """`tasks` factory groups of G trajectories x `turns` turns, scored, with AlignOPSD's fields."""
    scored = []
    for g in range(tasks):
        sg = with_alignopsd_fields(make_scored_group(G=G, turns=turns, seed=seed + g), seed=seed + g)
        # Distinct group ids: the factory's task ids repeat with the seed only.
        task = replace(sg.rollout.task, group_id=f"g{g:02d}-{sg.rollout.task.group_id}",
                       game={**sg.rollout.task.game, "objective": f"Take the coin of game {g}."})
        trajs = [replace(t, rollout_id=f"{task.group_id}-r{i}") for i, t in enumerate(sg.rollout.trajectories)]
        scored.append(replace(sg, rollout=replace(sg.rollout, task=task, trajectories=trajs)))
    return [s.rollout for s in scored], scored


def with_text_tokens(groups: list[RolloutGroup], tokenizer) -> list[RolloutGroup]:
    """`groups` with each response's ids replaced by `tokenizer`'s encoding of the turn's text (cut or padded with
    id 2 to the response's length, so spans, masks and log-probs stay), for readable screenshots."""
    for grp in groups:
        for t in grp.trajectories:
            for turn in t.turns:
                n = turn.response_end - turn.response_start
                ids = (tokenizer.encode(turn.text, add_special_tokens=False).ids + [2] * n)[:n]
                t.token_ids_S[turn.response_start: turn.response_end] = ids
    return groups


def write_step(run_dir: Path, step: int, method: str, groups: list[RolloutGroup], scored: list[ScoredGroup]) -> Path:
    """One step's dump through `write_credit_dump`, advantages from `compute_advantages` (the trainer's calls)."""
    cfg = RunConfig.model_validate({"run": {"method": method, "name": "inspect-test"}})
    batch, _ = build_credit_batch(groups, None if method == "grpo" else scored)
    adv, _ = compute_advantages(method, batch, cfg.credit)
    return write_credit_dump(run_dir / "credit" / f"step_{step:05d}.json", cfg, batch, adv, groups, scored)


def write_tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A word-level tokenizer.json whose token i reads `w<i>` (the factories draw random ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(vocab_size)}
    path.parent.mkdir(parents=True, exist_ok=True)
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(path))
    return path


def write_run(run_dir: Path, tokenizer_json: Path | None = None, G: int = 3, turns: int = 3) -> dict[int, str]:
    """The run directory described in the module docstring; returns {step: method}.

    With `tokenizer_json` (a real tokenizer.json) the responses' ids encode their texts and that tokenizer
    is the run's (scripts/inspect_screenshots.py); else ids are random and decode as `w<id>`.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    groups, scored = step_groups(G=G, turns=turns)
    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        with_text_tokens(groups, Tokenizer.from_file(str(tokenizer_json)))
    methods = dict(enumerate(registered()))
    lines = []
    for step, method in methods.items():
        write_step(run_dir, step, method, groups, scored)
        lines.append(json.dumps({"step": step, "success_rate": 0.25 + 0.05 * step, "reward_mean": 0.1 * step,
                                 "teacher_student_gap": -0.5 + 0.01 * step,
                                 "privileged_signal": None if step == 1 else 0.02 * step, "mean_span_length": 2.0,
                                 "loss": 1.0 / (step + 1), "advantage_abs_mean": 0.1, "corrected_gap": -0.4,
                                 "teacher": ["self:live"]}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if tokenizer_json is None:
        write_tokenizer(run_dir / "checkpoint" / "tokenizer.json")
    else:
        (run_dir / "checkpoint").mkdir(exist_ok=True)
        (run_dir / "checkpoint" / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    return methods


@contextmanager
def served(run_dir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`opsd inspect RUN_DIR --port 0` as a process (os.environ updated by `env`), once it answers HTTP; yields the
    URL it printed (`http://127.0.0.1:PORT/?token=...`). Terminated on exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "opsd.cli", "inspect", str(run_dir), "--port", "0"],
                            cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("opsd inspect: open http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split("open ", 1)[1].strip()
        deadline = time.monotonic() + 30  # the URL is printed once the port is bound, before uvicorn listens
        while True:
            try:
                httpx.get(url.split("/?", 1)[0] + "/api/methods", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "opsd inspect did not answer"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
