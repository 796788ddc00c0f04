"""The run directory's record: metrics.jsonl (one line a step) and a PNG of the curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PLOTTED = (
    ("reward_mean", "mean episode reward"),
    ("success_rate", "success rate"),
    ("teacher_student_gap", "teacher - student log-prob (nats/token)"),
    ("mean_span_length", "mean span length (turns)"),
)


def append_metrics(run_dir: Path, record: dict) -> None:
    """Append one step's record to metrics.jsonl (non-finite values written as null, never NaN)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(clean) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(run_dir: Path) -> Path:
    """Write <run_dir>/metrics.png: reward, success, teacher-student gap and span length per step."""
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes.flat, PLOTTED):
        ys = [r.get(key) for r in rows]
        pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"opsd run: {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(run_dir) / "metrics.png"
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out
