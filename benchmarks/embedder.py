"""Embedder: thinking traces/s through POST /embed and groups/s through POST /correspond.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/embedder.py [--quick] [--json OUT]

Starts the real embedder service as `opsd run` does, a subprocess
`python -m services.embedder --config C --run-dir D` with a fresh
OPSD_API_TOKEN and model.threads 1 (all-MiniLM-L6-v2, the packaged encoder,
on the CPU), finds it through the run directory's port file, and talks to it
over HTTP with the bearer token: /embed with an httpx client, /correspond with
the teacher's own `EmbedderClient`.

Texts are ALFWorld-like thinking traces of ~60 words (45-75), built from a
fixed seed out of task, object and place phrases, so students and teachers
write similar but not equal thoughts; actions are ALFWorld commands.
- /embed: `--embed-batch` traces a request (default 400, one G = 8 x 50-turn
  group's thinking) -> traces/s.
- /correspond: one group of G = 8 trajectories x 50 turns (M = 400 turns; each
  turn a student and a teacher trace and action) with the default AlignOPSD
  settings (the alfworld-3b profile: the action filter embeds the actions too,
  1,600 texts a group) -> groups/s; the answer passes the teacher's checks
  (`CorrespondResponse.check`).
Each: one warm-up request, then `--repeats` timed ones (total time / count).
`--quick`: G = 4 x 4 turns, batch 32, 2 repeats.
No targets: the issue asks for the figures.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import REPO, Row, command_line, print_rows, write_json  # noqa: E402
from opsd.config import RunConfig  # noqa: E402
from opsd.embedding_api import CorrespondResponse, EmbedResponse  # noqa: E402
from opsd.service import embedder_url  # noqa: E402
from services.teacher.scoring import EmbedderClient  # noqa: E402

OBJECTS = ("mug", "apple", "knife", "plate", "egg", "potato", "cup", "pan", "lettuce", "book", "pen", "towel")
PLACES = ("countertop 1", "countertop 2", "fridge 1", "cabinet 3", "drawer 2", "sinkbasin 1", "microwave 1",
          "shelf 1", "diningtable 1", "stoveburner 2", "garbagecan 1", "coffeemachine 1")
VERBS = ("clean", "heat", "cool", "put", "find", "examine")
SENTENCES = (
    "My task is to {verb} a {obj} and then put it in the {place2}.",
    "I have not found the {obj} yet, so I should check the {place} next.",
    "The {obj} is usually kept near the {place}, which I have not visited.",
    "I am now at the {place} and I can see a {obj} and a few other things.",
    "Before putting the {obj} away I need to {verb} it at the {place2}.",
    "Going back to the {place} would waste a step because it was empty.",
    "The observation says the {place} is closed, so I should open it first.",
    "Once I hold the {obj} the remaining steps are simple: go to the {place2} and put it there.",
    "I should avoid repeating the last action because nothing changed.",
    "Let me think about where a {obj} could be in a room like this one.",
)
ACTIONS = ("go to {place}", "open {place}", "take {obj} 1 from {place}", "{verb} {obj} 1 with {place2}",
           "put {obj} 1 in/on {place2}", "look", "inventory")


def thinking_trace(rng: np.random.Generator, words: int) -> str:
    """An ALFWorld-like thinking trace of about `words` words (whole sentences, fixed by `rng`)."""
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        tpl = SENTENCES[int(rng.integers(len(SENTENCES)))]
        out.append(tpl.format(obj=OBJECTS[int(rng.integers(len(OBJECTS)))], verb=VERBS[int(rng.integers(len(VERBS)))],
                              place=PLACES[int(rng.integers(len(PLACES)))], place2=PLACES[int(rng.integers(len(PLACES)))]))
    return " ".join(out)


def action_text(rng: np.random.Generator) -> str:
    tpl = ACTIONS[int(rng.integers(len(ACTIONS)))]
    return tpl.format(obj=OBJECTS[int(rng.integers(len(OBJECTS)))], verb=VERBS[int(rng.integers(len(VERBS)))],
                      place=PLACES[int(rng.integers(len(PLACES)))], place2=PLACES[int(rng.integers(len(PLACES)))])


def correspond_payload(G: int, turns: int, seed: int, cfg: RunConfig) -> dict:
    """A /correspond request as the teacher builds it (services/teacher/scoring.py) for G x turns turns."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(G):
        for k in range(turns):
            valid = bool(rng.random() < 0.9)
            rows.append({"rollout_id": f"task-{seed}-r{g}", "turn_id": k, "data_source": "alfworld",
                         "student_text": thinking_trace(rng, int(rng.integers(45, 76))) if valid else "",
                         "teacher_text": thinking_trace(rng, int(rng.integers(45, 76))),
                         "student_valid": valid, "teacher_valid": True,
                         "student_action": action_text(rng) if valid else "", "teacher_action": action_text(rng)})
    return {"task_id": f"task-{seed}", "align": cfg.credit.alignopsd.model_dump(), "turns": rows,
            "return_embeddings": False}


def start_embedder(run_dir: Path, token: str, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m services.embedder` on a config written into `run_dir`; returns (process, base URL).

    Raises RuntimeError with the service's output if it exits or does not answer /health in `timeout_s`.
    """
    cfg = RunConfig.model_validate({"run": {"method": "alignopsd"}, "model": {"threads": 1}})
    cfg.dump(run_dir / "config.yaml")
    env = {**os.environ, "OPSD_API_TOKEN": token, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("OPSD_EMBEDDER_URL", None)
    with open(run_dir / "embedder.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "services.embedder", "--config", str(run_dir / "config.yaml"),
                                 "--run-dir", str(run_dir)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the embedder exited with {proc.returncode}:\n"
                               f"{(run_dir / 'embedder.log').read_text(errors='replace')[-2000:]}")
        url = embedder_url(run_dir)
        if url:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"the embedder did not answer /health within {timeout_s:.0f} s")


def timed(fn, repeats: int) -> float:
    """One untimed warm-up call, then `repeats` calls; returns seconds per call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="G 4 x 4 turns, batch 32, 2 repeats (< 60 s)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark JSON here")
    ap.add_argument("--group-size", type=int, default=None, help="G (default 8; --quick 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per trajectory (default 50; --quick 4)")
    ap.add_argument("--embed-batch", type=int, default=None, help="traces per /embed request (default 400; --quick 32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed requests per endpoint (default 5; --quick 2)")
    args = ap.parse_args()
    G = args.group_size or (4 if args.quick else 8)
    turns = args.turns or (4 if args.quick else 50)
    batch = args.embed_batch or (32 if args.quick else 400)
    repeats = args.repeats or (2 if args.quick else 5)

    rng = np.random.default_rng(0)
    traces = [thinking_trace(rng, int(rng.integers(45, 76))) for _ in range(batch)]
    words = float(np.mean([len(t.split()) for t in traces]))
    cfg = RunConfig.model_validate({"run": {"method": "alignopsd"}})
    payload = correspond_payload(G, turns, seed=1, cfg=cfg)
    M = len(payload["turns"])
    n_texts = 2 * M * (2 if cfg.credit.alignopsd.action_filter_enabled else 1)

    token = secrets.token_urlsafe(32)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="opsd-bench-embedder-") as tmp:
        t0 = time.perf_counter()
        proc, url = start_embedder(Path(tmp), token)
        start_s = time.perf_counter() - t0
        try:
            http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=600)

            def embed() -> EmbedResponse:
                r = http.post(f"{url}/embed", json={"texts": traces})
                r.raise_for_status()
                return EmbedResponse.model_validate(r.json())

            client = EmbedderClient(lambda: url, token, timeout_s=600, deadline_s=600)

            def corr() -> CorrespondResponse:
                return CorrespondResponse.model_validate(client.correspond(payload)).check(M)

            emb = embed()  # self-check before timing: shapes and unit vectors
            vecs = np.asarray(emb.vectors, dtype=np.float32)
            if vecs.shape != (batch, emb.dim) or not np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-3):
                raise RuntimeError(f"/embed answered {vecs.shape} vectors that are not unit length")
            answer = corr()
            embed_s = timed(embed, repeats)
            corr_s = timed(corr, repeats)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    matched = sum(1 for s in answer.selected_sources if s)
    rows.append(Row(f"/embed: thinking traces/s ({batch} a request)", batch / embed_s, "traces/s",
                    note=f"~{words:.0f}-word traces; {1000 * embed_s:.0f} ms a request, mean of {repeats} after a "
                         f"warm-up; dim {emb.dim}; service started in {start_s:.1f} s"))
    rows.append(Row(f"/correspond: groups/s (G={G} x {turns} turns, M={M})", 1 / corr_s, "groups/s",
                    note=f"{corr_s:.2f} s a group ({n_texts} texts embedded: thinking"
                         f"{' and actions, action filter on' if n_texts > 2 * M else ''}); "
                         f"{matched} of {M} turns got a source; teacher's EmbedderClient"))
    rows.append(Row(f"/correspond: turns/s (G={G} x {turns} turns)", M / corr_s, "turns/s"))
    print_rows(rows)
    if args.json:
        write_json(args.json, "embedder", command_line(), rows)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
