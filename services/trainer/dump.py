"""A step's credit inputs as a vector file (`opsd run --dump-credit`), replayable with `opsd credit check`.

Top-level fields follow ../shared/refvectors/README.md (method, case,
description, source, reference_function, config, dtype, inputs, expected).
`config.opsd_credit` is the run's whole `credit` section, so a replay runs
exactly the trainer's settings; `expected.advantages` holds the token
advantages the trainer trained on (rows in canonical order).

Inputs:
- `alignopsd`: the AlignOPSD schema of the README (turns, response texts,
  thinking/action embeddings, policy_loss_mask, student_log_probs,
  diagonal_teacher_log_probs, cross_teacher_log_probs [M][M][L] with the
  selected pairs filled), so the replay re-runs selection, rectification and
  allocation. Size grows as M^2 L: a dump is a debugging tool for small steps.
- every other method: one row per turn, `uid`, `traj_uid`, `turn_step`,
  `data_source`, `episode_rewards`, `is_action_valid`, `response_mask`,
  `student_log_probs` and, when the step has them, `teacher_log_probs`,
  `corrected_teacher_log_probs`, `base_log_probs`, `teacher_entropys`,
  `student_entropys` ([B][L], 0 off the mask).

Precision: the per-token arrays ([M][L], [M][M][L]: masks, log-probs, entropies,
advantages) are written as the shortest decimal text that reads back as the
same float32 (what the trainer computed with; every reader converts them to
float32), rewards and embeddings as float64 text. Dumps written before that
hold 17-digit float64 text of the same float32 values and read the same.

`inputs.loss` and `config.opsd_trainer` (when the update's first epoch was recorded; `opsd credit check`
replays the loss from them, `opsd.credit.replay.replay_loss`): one entry per trajectory trained on, each array
holding the values at its loss tokens in order: `advantages`, `old_log_probs` (the trainer's pi_old),
`sampler_log_probs`, `entropy`, `ref_log_probs` (the reference policy's, with trainer.kl_coef > 0) and
`teacher_log_probs` (with the SDAR term); `config.opsd_trainer` is the run's trainer section plus `norm_tokens`
(Dr. GRPO's resolved constant); `expected.loss` is the first epoch's loss, `expected.kl` its KL to the reference
(token-mean of trainer.kl_estimator, nats/token).

`display` (when the step's groups are given; read by `opsd inspect`, ignored by
the replay): one entry per row, in the rows' order, with the turn's
`observation` (the env's reply to it), `thinking`, `action`, decoded `text`,
`format_valid`, `finish_reason` and `token_ids` (the response's ids: column j
of the row's [L] arrays is token_ids[j]); a turn-0 row also has `opening` (the
episode's first user message: the env's opening observation as the student
read it; "" from rollouts before that field) and `objective` (the task's, from
the env; often "" when the opening states it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from opsd.config import RunConfig
from opsd.types import CreditBatch, RolloutGroup, ScoredGroup
from services.trainer.update import FirstEpoch, loss_norm_tokens

_TOKEN_FIELDS = (
    ("teacher_log_probs", "teacher_logprobs_ML"),
    ("corrected_teacher_log_probs", "corrected_logprobs_ML"),
    ("base_log_probs", "base_logprobs_ML"),
    ("teacher_entropys", "teacher_entropy_ML"),
    ("student_entropys", "student_entropy_ML"),
)


def _rows(a: np.ndarray) -> list:
    return np.asarray(a, dtype=np.float64).tolist()


def _tokens(a: np.ndarray) -> np.ndarray:
    # Per-token arrays stay float32 so orjson writes each value as the shortest text that reads back as the
    # same float32: 3/5 of the bytes of float64 text, and every reader converts them to float32 anyway.
    return np.ascontiguousarray(a, dtype=np.float32)


def token_inputs(batch: CreditBatch) -> dict[str, Any]:
    """The row-per-turn inputs of a CreditBatch (see module docstring); inverse of `opsd.credit.replay.batch_from_inputs`."""
    out: dict[str, Any] = {
        "uid": list(batch.task_id),
        "traj_uid": list(batch.rollout_id),
        "turn_step": [int(k) for k in batch.turn_id],
        "data_source": list(batch.data_source),
        "episode_rewards": _rows(batch.episode_reward),
        "is_action_valid": [bool(v) for v in batch.is_action_valid],
        "response_mask": _tokens(batch.loss_mask_ML),
        "student_log_probs": _tokens(batch.student_logprobs_ML),
    }
    for name, attr in _TOKEN_FIELDS:
        arr = getattr(batch, attr)
        if arr is not None:
            out[name] = _tokens(arr)
    return out


def display_rows(batch: CreditBatch, groups: list[RolloutGroup]) -> list[dict[str, Any]]:
    """What a person reads of each row of `batch` (module docstring, `display`); rows as in the batch.

    Raises KeyError when a row's (task, rollout) is not in `groups`.
    """
    trajs = {(grp.group_id, t.rollout_id): (grp, t) for grp in groups for t in grp.trajectories}
    out = []
    for task, rollout, k in zip(batch.task_id, batch.rollout_id, batch.turn_id):
        grp, traj = trajs[(task, rollout)]
        turn = traj.turns[int(k)]
        row = {
            "observation": turn.observation, "thinking": turn.thinking, "action": turn.action, "text": turn.text,
            "format_valid": bool(turn.format_valid), "finish_reason": turn.finish_reason,
            "token_ids": [int(x) for x in traj.token_ids_S[traj.response_slice(int(k))]],
        }
        if int(k) == 0:  # once per episode: what the student read before its first turn
            row["opening"] = traj.opening
            row["objective"] = str(grp.task.game.get("objective") or "")
        out.append(row)
    return out


def _wrap(text: str, tag: str) -> str:
    return f"<{tag}>{text}</{tag}>" if text else ""


def alignopsd_inputs(batch: CreditBatch, groups: list[RolloutGroup], scored: list[ScoredGroup]) -> dict[str, Any]:
    """The AlignOPSD refvector inputs of a step (README "AlignOPSD"), rows = the batch's canonical rows.

    Response texts are rebuilt from the texts the embedder embedded
    (`<think>thinking</think><action>action</action>`), so the README's parsing
    rules give back exactly what the pipeline matched on.
    Raises ValueError when a scored group lacks the embeddings or cross log-probs
    (a teacher that fell back to the identity view).
    """
    M, L = batch.loss_mask_ML.shape
    where = {(t, r, k): m for m, (t, r, k) in enumerate(zip(batch.task_id, batch.rollout_id, batch.turn_id))}
    need = ("student_thinking_emb_MD", "teacher_thinking_emb_MD", "student_action_emb_MD", "teacher_action_emb_MD", "cross_logprobs_M")
    D = None
    for sg in scored:
        missing = [nm for nm in need if getattr(sg, nm, None) is None]
        if missing:
            raise ValueError(f"group {sg.group_id} has no {missing} (identity fallback?): cannot dump AlignOPSD inputs")
        D = sg.student_thinking_emb_MD.shape[1]
    s_text, t_text = [""] * M, [""] * M
    emb = {nm: np.zeros((M, D or 1), dtype=np.float32) for nm in need[:4]}
    cross = np.zeros((M, M, L), dtype=np.float32)
    for grp, sg in zip(groups, scored):
        order = grp.canonical_turns()
        idx = [where[(grp.group_id, grp.trajectories[i].rollout_id, k)] for i, k in order]
        for j, m in enumerate(idx):
            s_text[m] = _wrap(sg.student_thinking_M[j], "think") + _wrap(sg.student_action_M[j], "action")
            t_text[m] = _wrap(sg.teacher_thinking_M[j], "think") + _wrap(sg.teacher_action_M[j], "action")
            for nm in emb:
                emb[nm][m] = getattr(sg, nm)[j]
            for kk, s in enumerate(sg.selected_sources_M[j]):
                lp = sg.cross_logprobs_M[j][kk]
                cross[idx[s], m, : lp.shape[0]] = lp[:L]
    return {
        "turns": [
            {"task_id": t, "rollout_id": r, "turn_id": int(k), "data_source": d, "episode_reward": float(rw), "is_action_valid": bool(v)}
            for t, r, k, d, rw, v in zip(batch.task_id, batch.rollout_id, batch.turn_id, batch.data_source,
                                          batch.episode_reward, batch.is_action_valid)
        ],
        "student_response_text": s_text,
        "teacher_response_text": t_text,
        "student_thinking_embedding": _rows(emb["student_thinking_emb_MD"]),
        "teacher_thinking_embedding": _rows(emb["teacher_thinking_emb_MD"]),
        "student_action_embedding": _rows(emb["student_action_emb_MD"]),
        "teacher_action_embedding": _rows(emb["teacher_action_emb_MD"]),
        "policy_loss_mask": _tokens(batch.loss_mask_ML),
        "student_log_probs": _tokens(batch.student_logprobs_ML),
        "diagonal_teacher_log_probs": _tokens(batch.teacher_logprobs_ML),
        "cross_teacher_log_probs": _tokens(cross),
    }


def loss_inputs(record: FirstEpoch, with_teacher: bool) -> dict[str, Any]:
    """`inputs.loss` (module docstring) of the update's first epoch: float32 arrays at each trajectory's loss tokens."""
    out = []
    for s, old, ent in zip(record.sequences, record.old_logprobs, record.entropy):
        pos = np.flatnonzero(s.loss_mask_S[1:]) + 1  # loss tokens; token 0 is always prompt
        seq = {"advantages": _tokens(s.advantages_S[pos]), "old_log_probs": _tokens(old),
               "sampler_log_probs": _tokens(s.sampler_logprobs_S[pos]), "entropy": _tokens(ent)}
        if s.ref_logprobs_S is not None:
            seq["ref_log_probs"] = _tokens(s.ref_logprobs_S[pos])
        if with_teacher and s.teacher_logprobs_S is not None:
            seq["teacher_log_probs"] = _tokens(s.teacher_logprobs_S[pos])
        out.append(seq)
    return {"sequences": out}


def credit_case(
    cfg: RunConfig, batch: CreditBatch, advantages_ML: np.ndarray,
    groups: list[RolloutGroup] | None = None, scored: list[ScoredGroup] | None = None, case: str = "step",
    record: FirstEpoch | None = None,
) -> dict[str, Any]:
    """The vector-file dict of one step (module docstring). `batch` must be in canonical order; with `record` (the
    update's first epoch) the loss inputs and the expected loss and KL too.

    The per-token arrays are float32 numpy arrays (`write_credit_dump` writes them as nested lists); every
    other value is a JSON type.
    """
    method = cfg.run.method
    if method == "alignopsd":
        if groups is None or scored is None:
            raise ValueError("an alignopsd dump needs the step's groups and scored groups")
        inputs = alignopsd_inputs(batch, groups, scored)
    else:
        inputs = token_inputs(batch)
    out = {
        "method": method,
        "case": case,
        "description": f"credit inputs of one training step of run {cfg.run.name} (opsd run --dump-credit)",
        "source": "opsd run",
        "reference_function": f"opsd.credit.compute_advantages({method!r})",
        "config": {"opsd_credit": cfg.credit.model_dump(mode="json")},
        "dtype": "float32",
        "inputs": inputs,
        "expected": {"advantages": _tokens(advantages_ML)},
    }
    if record is not None:
        out["inputs"]["loss"] = loss_inputs(record, cfg.credit.sdar.coef > 0)
        out["config"]["opsd_trainer"] = cfg.trainer.model_dump(mode="json") | {"norm_tokens": loss_norm_tokens(cfg)}
        out["expected"] |= {"loss": record.loss, "kl": record.kl}
    if groups is not None:
        out["display"] = display_rows(batch, groups)
    return out


def write_credit_dump(
    path: Path, cfg: RunConfig, batch: CreditBatch, advantages_ML: np.ndarray,
    groups: list[RolloutGroup] | None = None, scored: list[ScoredGroup] | None = None, record: FirstEpoch | None = None,
) -> Path:
    """Write `credit_case(...)` as JSON to `path` atomically (tmp file + rename); returns the path.

    orjson writes the float32 arrays at float32 precision (module docstring): a 16 x 8 x 50-turn agentopsd step
    at 256 tokens a turn takes 75 MB instead of 125 MB of float64 text (benchmarks/inspect_page.py).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    data = credit_case(cfg, batch, advantages_ML, groups, scored, case=path.stem, record=record)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY))
    os.replace(tmp, path)
    return path
