"""Teacher-verifier disagreement vs prompt length: GC-OPD's Figure 1 on this machine (issue 20).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/disagreement.py [--config configs/evidence.yaml]
        [--prompts N] [--teacher self|DIR] [--out DIR] [--json OUT] [--quick]

One fixed set of student responses: the config's student (SmolLM2) plays N eval tasks per length bucket of
the evidence env (`env.evidence.prompt_tokens`), G = rollout.group_size episodes each, at the rollout's
temperature, with the rollout's own episode code (`run_groups`), rewarded by the env's F1 verifier. The
teacher scores every response once (the teacher role's own `score_group`): `--teacher self` is the student's
weights with the required IDs as privileged context (`env.privileged: walkthrough`), `--teacher DIR` a
frozen external teacher (e.g. the learning benchmark's `<out>/teacher`) with the config's privileged mode.
Per group, the three diagnostics of opsd/credit/diagnostics.py (pairwise disagreement, top-1 mismatch, OPD
preference gap; groups with fewer than two distinct rewards excluded, as in the paper); per bucket their
macro mean over groups with a 95% bootstrap interval (groups resampled). Writes DIR/disagreement.json,
DIR/disagreement.png (one panel per diagnostic, one point per bucket with its interval).

`--quick`: the tiny model of tests/tiny_model.py as student and teacher, 2 prompts per bucket of 96 and 192
tokens, G = 4, 8 new tokens: the whole path in well under a minute (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import Row, command_line, machine, write_json  # noqa: E402

LABELS = {"pairwise_disagreement": "pairwise disagreement", "top1_mismatch": "top-1 mismatch",
          "preference_gap": "OPD preference gap (nats/token)"}


def bootstrap(values: list[float], samples: int, rng: np.random.Generator) -> tuple[float | None, float | None]:
    """95% percentile interval of the mean of `values` (groups resampled with replacement); (None, None) when empty."""
    if not values:
        return None, None
    v = np.asarray(values, dtype=np.float64)
    means = v[rng.integers(0, v.size, size=(samples, v.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def group_values(scored) -> dict | None:
    """One group's diagnostics from a ScoredGroup (the trainer's `trajectory_scores`: s_i and the F1 reward R_i of
    each rankable trajectory); None when its rewards do not differ."""
    from opsd.credit.diagnostics import group_diagnostics, trajectory_scores

    rows = trajectory_scores(scored)
    diag = group_diagnostics(np.array([r for r, _, _ in rows]), np.array([s for _, s, _ in rows]))
    return None if diag is None else {"pairwise_disagreement": diag.pairwise_disagreement,
                                      "top1_mismatch": diag.top1_mismatch, "preference_gap": diag.preference_gap}


def plot(result: dict, path: Path) -> None:
    buckets = list(result["buckets"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (name, label) in zip(axes, LABELS.items()):
        xs, ys, err = [], [], []
        for i, b in enumerate(buckets):
            d = result["buckets"][b][name]
            if d["value"] is None:
                continue
            xs.append(i)
            ys.append(d["value"])
            err.append([d["value"] - d["ci95"][0], d["ci95"][1] - d["value"]])
        if xs:
            ax.errorbar(xs, ys, yerr=np.array(err).T, fmt="o-", capsize=4)
        ax.set_xticks(range(len(buckets)), [f"{b}\n({result['buckets'][b]['groups']} groups)" for b in buckets], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "evidence.yaml")
    ap.add_argument("--prompts", type=int, default=16, help="eval tasks per length bucket (default 16)")
    ap.add_argument("--teacher", default="self", help="self (the student with the required IDs) or a model dir")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error(f"--prompts must be >= 1 (got {args.prompts})")
    from opsd.config import read_yaml

    base = read_yaml(args.config)  # as `opsd run` reads it: a repeated key is refused, not dropped

    from opsd.chat import ChatFormat
    from opsd.config import RunConfig
    from opsd.envs import get_adapter, local_context, task_group
    from opsd.models import load_backend
    from services.rollout.episodes import run_groups
    from services.teacher.scoring import score_group

    if args.quick:
        from tests.tiny_model import make_tiny_model_dir

        tiny = make_tiny_model_dir(Path(os.environ.get("TMPDIR", "/tmp")) / "opsd-disagreement-tiny")
        base["model"] = {**base.get("model", {}), "name": str(tiny), "max_model_len": 2048}
        base.setdefault("env", {}).update(max_observation_chars=4000, evidence={"prompt_tokens": [96, 192]})
        base.setdefault("rollout", {}).update(group_size=4, max_new_tokens=8)
        args.prompts = min(args.prompts, 2)
    if args.teacher == "self":
        base.setdefault("env", {})["privileged"] = "walkthrough"  # the required IDs
    else:
        base["teacher"] = {**base.get("teacher", {}), "source": "model", "model": {"name": args.teacher}}
    base.setdefault("run", {})["method"] = "gc_opd"
    cfg = RunConfig.model_validate(base)
    lengths = cfg.env.evidence.prompt_tokens
    # make_tasks deals the eval tasks round-robin over (kind, length) pairs: this many give each bucket N or more.
    cfg.env.eval_pool = args.prompts * len(lengths) * len(cfg.env.evidence.kinds)
    out = args.out or ROOT / "runs" / "disagreement" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    t_all = time.perf_counter()
    ctx = local_context(cfg)
    student = load_backend(cfg.model)
    teacher = student if cfg.teacher.source == "self" else load_backend(cfg.teacher_model)
    chat = ChatFormat.for_env(student.tokenizer, cfg.env, cfg.model)
    tasks = get_adapter("evidence").make_tasks(cfg.env, ctx, "eval")
    per_bucket = {b: [t for t in tasks if t.category == b][: args.prompts] for b in dict.fromkeys(t.category for t in tasks)}
    result: dict = {"command": command_line(), "machine": machine(), "config": base, "teacher": args.teacher,
                    "title": (f"evidence env: {args.prompts} prompts x G={cfg.rollout.group_size} per bucket, "
                              f"teacher {args.teacher}"), "buckets": {}, "seconds": {}}
    rng = np.random.default_rng(0)
    for bucket, chosen in per_bucket.items():
        t0 = time.perf_counter()
        groups = [task_group(cfg, t, group_id=f"d-{t.task_id}", step=0, policy_version=0,
                             group_size=cfg.rollout.group_size) for t in chosen]
        played = run_groups(groups, student, chat, cfg.env, cfg.rollout, cfg.model.max_model_len,
                            [1000 + i for i in range(len(groups))], ctx=ctx)
        values, rewards, truncated = [], [], 0
        for res in played:
            if isinstance(res, Exception):
                raise res
            group, _ = res
            rewards += [t.reward for t in group.trajectories]
            truncated += sum(t.ending == "truncated" for t in group.trajectories)
            scored, _ = score_group(group, teacher, chat, cfg, None)
            v = group_values(scored)
            if v is not None:
                values.append(v)
        row = {"groups": len(values), "prompts": len(chosen), "reward_mean": float(np.mean(rewards)),
               "truncated_episodes": truncated}
        for name in LABELS:
            vals = [v[name] for v in values if not np.isnan(v[name])]
            lo, hi = bootstrap(vals, args.bootstrap, rng)
            row[name] = {"value": float(np.mean(vals)) if vals else None, "ci95": [lo, hi] if vals else None,
                         "groups": len(vals)}
        result["buckets"][bucket] = row
        result["seconds"][bucket] = time.perf_counter() - t0
        print(f"{bucket}: {len(values)}/{len(chosen)} groups with distinct rewards, F1 {row['reward_mean']:.3f}, "
              + ", ".join(f"{n} {row[n]['value']}" for n in LABELS), flush=True)
        (out / "disagreement.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "disagreement.png")
    result["seconds"]["total"] = time.perf_counter() - t_all
    (out / "disagreement.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "disagreement.png")
    print(f"wrote {out / 'disagreement.json'} and {out / 'disagreement.png'} in {result['seconds']['total'] / 60:.1f} min")
    if args.json:
        rows = []
        for bucket, row in result["buckets"].items():
            for name in LABELS:
                d = row[name]
                note = (f"95% CI [{d['ci95'][0]:.3f}, {d['ci95'][1]:.3f}], {d['groups']} groups" if d["value"] is not None
                        else "no group of this bucket had distinct rewards")
                rows.append(Row(f"{bucket}: {LABELS[name]}", d["value"], "nats/token" if name == "preference_gap" else "rate",
                                note=note))
        write_json(args.json, "disagreement", result["command"], rows)


if __name__ == "__main__":
    main()
