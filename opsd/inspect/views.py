"""The pure functions that build what each page shows (opsd/inspect/models.py) from a parsed Step.

Units as in models.py. Errors: InspectError (404 unknown group / trajectory, 422 bad paging or
compare request); `method_extras` reports a failed recomputation instead of raising.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from opsd.inspect.data import InspectError, Step, inside, row_means
from opsd.inspect.models import (
    CompareTrajectory, CompareTurn, CompareView, GroupSummary, GroupView, Source, StepView, Token, TokenTurn,
    TrajectoryTurns, TrajectoryView, TurnView,
)

MAX_PAGE = 500


def _page(offset: int, limit: int) -> tuple[int, int]:
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise InspectError(422, f"offset must be >= 0 and limit in [1, {MAX_PAGE}]")
    return offset, limit


def step_view(s: Step, offset: int = 0, limit: int = 100) -> StepView:
    """The step page: its groups (paginated), each with its rollouts' rewards."""
    offset, limit = _page(offset, limit)
    names = sorted(s.groups)
    adv_rows = (s.adv_ML * s.mask_ML).sum(axis=1)
    n_rows = s.mask_ML.sum(axis=1)
    src = s.case.get("inputs", {}).get("data_source")
    out = []
    for g in names[offset: offset + limit]:
        rows = [m for ms in s.groups[g].values() for m in ms]
        n = float(n_rows[rows].sum())
        first = rows[0]
        ds = src[first] if isinstance(src, list) and len(src) > first else (
            s.case["inputs"]["turns"][first].get("data_source", "") if "turns" in s.case["inputs"] else "")
        out.append(GroupSummary(group=g, data_source=str(ds), rollouts=len(s.groups[g]), turns=len(rows),
                                rewards=[float(s.reward[ms[0]]) for _, ms in sorted(s.groups[g].items())],
                                adv_mean=float(adv_rows[rows].sum() / n) if n else 0.0))
    cfg = s.case.get("config", {}).get("opsd_credit", {})
    return StepView(step=s.step, method=s.method, rows=len(s.task), tokens=s.mask_ML.shape[1],
                    has_teacher=s.teacher_ML is not None, has_display=s.display is not None,
                    config=cfg if isinstance(cfg, dict) else {}, total_groups=len(names), offset=offset, groups=out)


def _group(s: Step, group: str) -> dict[str, list[int]]:
    if group not in s.groups:
        raise InspectError(404, f"step {s.step} has no group {group!r}")
    return s.groups[group]


def method_extras(s: Step) -> dict[str, Any]:
    """Per-row intermediates of the dump's method, recomputed from the dump's inputs and config
    (the functions `opsd credit check` replays through). Keys (each a list over rows, present only
    for the methods that have them): rectified_gap, sources, span, span_start, boundary,
    belief_before, belief_after, residual; "error" (str) when the recomputation failed.
    Cached on the Step."""
    with s.lock:
        if s.extras is None:
            try:
                s.extras = _extras(s)
            except Exception as exc:  # noqa: BLE001 - a dump the replay rejects still shows its own numbers
                s.extras = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        return s.extras


def _extras(s: Step) -> dict[str, Any]:
    from opsd.config import CreditSection

    M = len(s.task)
    out: dict[str, Any] = {}
    if s.corrected_ML is not None:
        out["rectified_gap"] = row_means(s.corrected_ML - s.student_ML, s.mask_ML).tolist()
    if s.method not in ("alignopsd", "agentopsd", "gc_opd"):
        return out
    cfg = CreditSection.model_validate(s.case["config"]["opsd_credit"])
    if s.method == "alignopsd":
        from opsd.credit.reference import run_product_case

        res = run_product_case(s.case["inputs"], cfg)
        out["rectified_gap"] = row_means(np.asarray(res["corrected_token_gap"], np.float32), s.mask_ML).tolist()
        out["sources"] = [[(int(src), float(w)) for src, w in zip(ss, ws)]
                          for ss, ws in zip(res["selected_sources"], res["selected_source_weights"])]
        seg = [int(x) for x in res["segment_index_per_turn"]]
        out["span"] = seg
        starts, kinds = [False] * M, [None] * M
        for ms in (ms for g in s.groups.values() for ms in g.values()):
            for j, m in enumerate(ms):
                starts[m] = j == 0 or seg[m] != seg[ms[j - 1]]
        for b in res.get("boundary_kinds") or []:  # per trajectory: turn positions opening a span, by kind
            task, rollout = b["trajectory"]
            ms = s.groups.get(str(task), {}).get(str(rollout), [])
            for kind in ("semantic", "guided_fallback", "forced_max"):
                for k in b.get(kind) or []:
                    if 0 <= int(k) < len(ms):
                        kinds[ms[int(k)]] = kind
        out["span_start"], out["boundary"] = starts, kinds
    elif s.method == "agentopsd":
        from opsd.credit.agentopsd import agentopsd_advantages
        from opsd.credit.batch import permute_batch
        from opsd.credit.grpo import canonical_permutation
        from opsd.credit.replay import batch_from_inputs

        batch = batch_from_inputs(s.case["inputs"])
        perm = canonical_permutation(batch.task_id, batch.rollout_id, batch.turn_id)
        res = agentopsd_advantages(permute_batch(batch, perm), cfg)
        if res.grids is not None:
            before, after = [None] * M, [None] * M
            for c, m in enumerate(perm):
                t, k = int(res.traj[c]), int(res.pos[c])
                after[m] = float(res.grids["B"][t, k])
                before[m] = float(res.grids["B"][t, k] - res.grids["dB"][t, k])
            out["belief_before"], out["belief_after"] = before, after
    else:
        from opsd.credit.gc_opd import gc_opd_credit
        from opsd.credit.replay import batch_from_inputs

        res = gc_opd_credit(batch_from_inputs(s.case["inputs"]), cfg)
        out["residual"] = [float(res.residual_N[res.response_M[m]]) for m in range(M)]
    return out


def _text(s: Step, m: int, key: str) -> str | None:
    if s.display is None:
        return None
    v = s.display[m].get(key)
    return None if v is None else str(v)


def group_view(s: Step, group: str, offset: int = 0, limit: int = 50) -> GroupView:
    """The group page: the task's objective and opening text (its first rollout's: siblings play the same game),
    then every trajectory, turns [offset, offset + limit) side by side."""
    offset, limit = _page(offset, limit)
    rollouts = _group(s, group)
    start = rollouts[min(rollouts)][0]
    ex = method_extras(s)
    gap = row_means(s.teacher_ML - s.student_ML, s.mask_ML) if s.teacher_ML is not None else None
    adv_sum = (s.adv_ML * s.mask_ML).sum(axis=1)
    adv_mean = row_means(s.adv_ML, s.mask_ML)
    n_tok = s.mask_ML.sum(axis=1)
    get = lambda k, m: ex[k][m] if k in ex else None  # noqa: E731
    trajs = []
    for rollout, ms in sorted(rollouts.items()):
        turns = []
        for m in ms[offset: offset + limit]:
            src = get("sources", m)
            turns.append(TurnView(
                row=m, turn=s.turn[m], observation=_text(s, m, "observation"), thinking=_text(s, m, "thinking"),
                action=_text(s, m, "action"), text=_text(s, m, "text"), valid=bool(s.valid[m]),
                tokens=int(n_tok[m]), adv_mean=float(adv_mean[m]), adv_sum=float(adv_sum[m]),
                gap=None if gap is None else float(gap[m]), rectified_gap=get("rectified_gap", m),
                sources=None if src is None else [Source(rollout=s.rollout[r], turn=s.turn[r], weight=w) for r, w in src],
                span=get("span", m), span_start=get("span_start", m), boundary=get("boundary", m),
                belief_before=get("belief_before", m), belief_after=get("belief_after", m), residual=get("residual", m)))
        trajs.append(TrajectoryTurns(rollout=rollout, reward=float(s.reward[ms[0]]), total_turns=len(ms), turns=turns))
    return GroupView(step=s.step, method=s.method, group=group, objective=_text(s, start, "objective"),
                     opening=_text(s, start, "opening"), offset=offset, extras_error=ex.get("error"), trajectories=trajs)


class Decoder:
    """Token id -> text with the run's tokenizer (`checkpoint/tokenizer.json`, inside the run directory),
    or None when the run has none or it does not load."""

    def __init__(self, run_dir: Path):
        self._tok = None
        try:
            path = inside(run_dir, "checkpoint/tokenizer.json")
            if path.is_file():
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001 - no tokenizer means token ids, never a failed page
            self._tok = None

    @property
    def available(self) -> bool:
        return self._tok is not None

    def __call__(self, token_id: int) -> str:
        if self._tok is None or not 0 <= token_id < self._tok.get_vocab_size(with_added_tokens=True):
            return f"#{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False) or (self._tok.id_to_token(token_id) or f"#{token_id}")


def trajectory_view(s: Step, group: str, rollout: str, decode: Decoder, offset: int = 0, limit: int = 20) -> TrajectoryView:
    """The trajectory page: every response token of turns [offset, offset + limit) with its advantage."""
    offset, limit = _page(offset, limit)
    rollouts = _group(s, group)
    if rollout not in rollouts:
        raise InspectError(404, f"group {group!r} has no trajectory {rollout!r}")
    ms = rollouts[rollout]
    turns = []
    for m in ms[offset: offset + limit]:
        ids = s.display[m].get("token_ids") if s.display is not None else None
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids)):
            ids = None  # unreadable ids: show positions, as for a dump without them
        n = len(ids) if ids is not None else int(np.flatnonzero(s.mask_ML[m]).max(initial=-1) + 1)
        n = min(n, s.mask_ML.shape[1])
        toks = []
        for j in range(n):
            tid = int(ids[j]) if ids is not None else None
            toks.append(Token(id=tid, text=decode(tid) if tid is not None else f"[{j}]", adv=float(s.adv_ML[m, j]),
                              on=bool(s.mask_ML[m, j]), student=float(s.student_ML[m, j]),
                              teacher=None if s.teacher_ML is None else float(s.teacher_ML[m, j])))
        turns.append(TokenTurn(turn=s.turn[m], valid=bool(s.valid[m]), tokens=toks))
    return TrajectoryView(step=s.step, method=s.method, group=group, rollout=rollout, reward=float(s.reward[ms[0]]),
                          decoded=decode.available and s.display is not None, total_turns=len(ms), offset=offset,
                          turns=turns)


def _token_inputs(s: Step) -> dict[str, Any]:
    """An AlignOPSD dump's rows in the row-per-turn schema the other methods replay from."""
    inp = s.case["inputs"]
    return {"uid": s.task, "traj_uid": s.rollout, "turn_step": s.turn,
            "data_source": [str(t.get("data_source", "unknown")) for t in inp["turns"]],
            "episode_rewards": s.reward.tolist(), "is_action_valid": s.valid.tolist(),
            "response_mask": inp["policy_loss_mask"], "student_log_probs": inp["student_log_probs"],
            "teacher_log_probs": inp["diagonal_teacher_log_probs"]}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def replay_advantages(s: Step, method: str, overrides: dict[str, Any]) -> np.ndarray:
    """Advantages [M, L] of the step's inputs with `method` and the dump's credit config updated by
    `overrides` (nested dict, e.g. {"agentopsd": {"gamma": 0.9}}), through `opsd credit check`'s
    replay (`opsd.credit.replay.replay_product`). Cached per (method, overrides) on the Step.
    InspectError 422: unknown method, invalid settings, AlignOPSD asked of a dump without its inputs,
    or the replay rejecting the inputs."""
    from opsd.config import CreditSection
    from opsd.credit import registered
    from opsd.credit.replay import replay_product

    if method not in registered():
        raise InspectError(422, f"unknown method {method!r}; registered: {', '.join(registered())}")
    key = (method, json.dumps(overrides, sort_keys=True))
    with s.lock:
        if key in s.compares:
            return s.compares[key]
    base = s.case.get("config", {}).get("opsd_credit", {})
    try:
        cfg = CreditSection.model_validate(_merge(base if isinstance(base, dict) else {}, overrides))
    except ValidationError as exc:
        raise InspectError(422, f"invalid credit settings: {exc.errors()[0].get('msg')} at "
                                f"{'.'.join(str(p) for p in exc.errors()[0].get('loc', ()))}") from None
    if method == "alignopsd" and s.method != "alignopsd":
        raise InspectError(422, "AlignOPSD replays from embeddings and cross-teacher log-probs that only an "
                                "alignopsd dump holds; compare this step with another method")
    inputs = s.case["inputs"] if (method == "alignopsd") == (s.method == "alignopsd") or "turns" not in s.case["inputs"] \
        else _token_inputs(s)
    case = {"method": method, "config": {"opsd_credit": cfg.model_dump(mode="json")}, "inputs": inputs}
    try:
        with np.errstate(all="ignore"):
            adv = np.asarray(replay_product(case)["expected"]["advantages"], dtype=np.float32)
    except Exception as exc:  # noqa: BLE001 - the replay's refusal is the answer, as in `opsd credit check`
        raise InspectError(422, f"the replay with {method} failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    with s.lock:
        s.compares[key] = adv
        while len(s.compares) > 8:
            s.compares.popitem(last=False)
    return adv


def compare_view(s: Step, group: str, method: str, overrides: dict[str, Any]) -> CompareView:
    """The compare page: per turn of `group`, the dumped and the replayed mean advantage, plus step-wide
    agreement (max |difference| and correlation over the loss tokens)."""
    rollouts = _group(s, group)
    other = replay_advantages(s, method, overrides)
    on = s.mask_ML > 0
    a, b = s.adv_ML[on].astype(np.float64), other[on].astype(np.float64)
    corr = float(np.corrcoef(a, b)[0, 1]) if a.size > 1 and a.std() > 0 and b.std() > 0 else None
    mine, theirs = row_means(s.adv_ML, s.mask_ML), row_means(other, s.mask_ML)
    trajs = [CompareTrajectory(rollout=r, reward=float(s.reward[ms[0]]),
                               turns=[CompareTurn(turn=s.turn[m], dumped=float(mine[m]), replayed=float(theirs[m])) for m in ms])
             for r, ms in sorted(rollouts.items())]
    return CompareView(step=s.step, dumped_method=s.method, method=method, overrides=overrides,
                       max_abs_diff=float(np.abs(a - b).max(initial=0.0)), correlation=corr, group=group,
                       trajectories=trajs)
