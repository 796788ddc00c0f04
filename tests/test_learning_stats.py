"""benchmarks/stats.py and the learning benchmark's results files, report and table (issue 41), on values
worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import learning, stats

ROOT = Path(__file__).resolve().parents[1]


def rows(games: dict[str, list[int]]) -> list[dict]:
    """Episode rows of {task_id: [won, won, ...]} (reward = won)."""
    return [{"task_id": g, "category": "coin", "episode": i, "reward": float(w), "won": bool(w), "turns": 2}
            for g, ws in games.items() for i, w in enumerate(ws)]


def test_percentile_bootstrap_is_reproducible_and_brackets_the_mean():
    assert stats.percentile_interval([0.0, 1.0, 2.0, 3.0, 4.0], 0.5) == (1.0, 3.0)
    with pytest.raises(ValueError):
        stats.percentile_interval([])
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # mean 0.625
    lo, hi = stats.bootstrap_mean(values, samples=2000, seed=3)
    assert 0.0 <= lo < 0.625 < hi <= 1.0
    assert stats.bootstrap_mean(values, samples=2000, seed=3) == (lo, hi)  # same seed, same bounds
    assert stats.bootstrap_mean([0.5, 0.5, 0.5]) == (0.5, 0.5)  # no spread: a point
    with pytest.raises(ValueError):
        stats.bootstrap_mean([])


def test_seed_summary_mean_and_spread():
    s = stats.seed_summary({0: 0.25, 1: 0.5, 2: 0.75})
    assert s == {"seeds": 3, "mean": 0.5, "min": 0.25, "max": 0.75, "std": pytest.approx(0.25)}
    assert stats.seed_summary({7: 0.4}) == {"seeds": 1, "mean": 0.4, "min": 0.4, "max": 0.4, "std": None}
    with pytest.raises(ValueError):
        stats.seed_summary({})


def test_game_values_average_a_games_episodes_first():
    assert stats.game_values(rows({"a": [1, 1, 0, 0], "b": [1]})) == {"a": 0.5, "b": 1.0}
    graded = [{"task_id": "a", "reward": 0.4, "won": False}, {"task_id": "a", "reward": 0.8, "won": True}]
    assert stats.game_values(graded, "f1") == {"a": pytest.approx(0.6)} and stats.game_values(graded) == {"a": 0.5}


def test_identical_methods_differ_by_zero():
    runs = {0: rows({"a": [1, 0], "b": [0, 0], "c": [1, 1]}), 1: rows({"a": [0, 0], "b": [1, 0], "c": [1, 1]})}
    p = stats.paired_comparison(runs, runs, samples=500)
    assert (p["diff"], p["lo"], p["hi"]) == (0.0, 0.0, 0.0) and (p["seeds"], p["games"], p["pairs"]) == (2, 3, 6)


def test_a_method_winning_every_game_grpo_loses_differs_by_one():
    method = {s: rows({g: [1, 1] for g in "abcd"}) for s in (0, 1, 2)}
    grpo = {s: rows({g: [0, 0] for g in "abcd"}) for s in (0, 1, 2)}
    p = stats.paired_comparison(method, grpo, samples=500)
    assert (p["diff"], p["lo"], p["hi"]) == (1.0, 1.0, 1.0) and p["per_seed"] == {0: 1.0, 1: 1.0, 2: 1.0}
    assert stats.paired_comparison(grpo, method, samples=500)["diff"] == -1.0


def test_paired_comparison_by_hand():
    # seed 0: a 1 - 0 = +1, b 0.5 - 1 = -0.5 -> +0.25; seed 1: a 1 - 1 = 0, b 1 - 0 = +1 -> +0.5; mean +0.375.
    method = {0: rows({"a": [1, 1], "b": [1, 0]}), 1: rows({"a": [1], "b": [1]})}
    grpo = {0: rows({"a": [0, 0], "b": [1, 1]}), 1: rows({"a": [1], "b": [0]}), 2: rows({"a": [1]})}
    assert stats.paired_differences(method, grpo) == {0: {"a": 1.0, "b": -0.5}, 1: {"a": 0.0, "b": 1.0}}
    p = stats.paired_comparison(method, grpo, samples=4000, seed=1)
    assert p["diff"] == 0.375 and p["per_seed"] == {0: 0.25, 1: 0.5} and (p["seeds"], p["games"], p["pairs"]) == (2, 2, 4)
    assert -0.5 <= p["lo"] < 0.375 < p["hi"] <= 1.0  # within the smallest and largest difference
    assert stats.paired_comparison(method, grpo, samples=4000, seed=1) == p  # deterministic under the seed
    # One two-way resample by hand: seeds drawn, then one set of games used for every drawn seed.
    D = stats.difference_matrix(stats.paired_differences(method, grpo))
    assert D.tolist() == [[1.0, -0.5], [0.0, 1.0]]
    rng = stats.np.random.default_rng(5)
    seeds, games = rng.integers(0, 2, 2), rng.integers(0, 2, 2)
    want = stats.np.mean([D[i, games].mean() for i in seeds])
    assert stats.crossed_mean(D, stats.np.random.default_rng(5)) == want
    # Games or seeds only one side has are left out; nothing in common: None.
    assert stats.paired_differences({0: rows({"a": [1], "z": [1]})}, {0: rows({"a": [0]})}) == {0: {"a": 1.0}}
    assert stats.paired_comparison({3: rows({"a": [1]})}, {0: rows({"a": [1]})}) is None


def test_games_are_shared_by_the_seeds_not_nested_in_them():
    """Every seed plays the same held-out games, so the bootstrap draws one set of games for all drawn seeds: three
    identical seeds hold no more information than one, and their interval is as wide as one seed's (drawing games
    anew within each seed would narrow it by about sqrt(3)). A game a seed lacks is left out of that seed's mean."""
    games = {f"g{j}": [int(j % 3 == 0)] for j in range(32)}  # the method wins a third of the games GRPO loses
    grpo = {f"g{j}": [0] for j in range(32)}
    one = stats.paired_comparison({0: rows(games)}, {0: rows(grpo)}, samples=4000)
    three = stats.paired_comparison({s: rows(games) for s in range(3)}, {s: rows(grpo) for s in range(3)}, samples=4000)
    assert one["diff"] == three["diff"] == pytest.approx(11 / 32)
    width1, width3 = one["hi"] - one["lo"], three["hi"] - three["lo"]
    assert abs(width3 - width1) < 0.1 * width1 and width3 > 0.2
    gap = stats.paired_comparison({0: rows(games), 1: rows({"g0": [1]})}, {0: rows(grpo), 1: rows(grpo)}, samples=500)
    assert gap["per_seed"] == {0: pytest.approx(11 / 32), 1: 1.0} and gap["pairs"] == 33 and gap["games"] == 32


def test_training_compute_counts_episodes_and_forward_tokens():
    records = [{"step": 0, "policy_version": 1, "episodes": 16, "generated_tokens": 100, "sequence_tokens": 1000,
                "teacher_forward_tokens": 4000},
               {"step": 1, "policy_version": 2, "episodes": 16, "generated_tokens": 50, "sequence_tokens": 500,
                "teacher_forward_tokens": 3000},
               {"step": 2, "episodes": 16, "generated_tokens": 10, "sequence_tokens": 100}]  # no teacher, no version
    c = stats.training_compute(records, ppo_epochs=2, upto=2)
    # forward-token equivalents: rollout 1500 + teacher 7000 + 3 x trainer (1500 x 2 epochs).
    assert c == {"steps": 2, "episodes": 32, "generated_tokens": 150, "rollout_tokens": 1500, "teacher_tokens": 7000,
                 "trainer_tokens": 3000, "forward_tokens": 1500 + 7000 + 9000}
    everything = stats.training_compute(records, ppo_epochs=1)
    assert everything["steps"] == 3 and everything["teacher_tokens"] == 7000 and everything["trainer_tokens"] == 1600
    assert stats.add_compute(c, c)["episodes"] == 64


def test_episode_rows_keep_every_episode_and_failed_tasks():
    report = {"tasks": [
        {"task_id": "g1", "category": "coin", "error": None, "episodes": [
            {"rollout_id": "x", "reward": 1.0, "won": True, "ending": "won", "turns": 3, "valid_turns": 3},
            {"rollout_id": "y", "reward": 0.0, "won": False, "ending": "max_turns", "turns": 6, "valid_turns": 5}]},
        {"task_id": "g2", "category": "coin", "error": "RuntimeError: boom", "episodes": []}]}
    got, errors = learning.episode_rows(report)
    assert got == [{"task_id": "g1", "category": "coin", "episode": 0, "reward": 1.0, "won": True, "turns": 3},
                   {"task_id": "g1", "category": "coin", "episode": 1, "reward": 0.0, "won": False, "turns": 6}]
    assert errors == [{"task_id": "g2", "error": "RuntimeError: boom"}]


def record(header: dict, method: str, seed: int, wins: dict[int, dict[str, list[int]]], teacher: int | None = None) -> dict:
    """A complete results record with evaluations {step: {game: [won, ...]}} and one training record a step."""
    rec = learning.new_record(header, method, seed)
    for step, games in wins.items():
        eps = rows(games)
        value = sum(e["won"] for e in eps) / len(eps)
        rec["steps"][str(step)] = {"value": value, "lo": 0.0, "hi": 1.0, "n": len(eps), "episodes": eps, "errors": []}
    last = max(wins)
    rec["training"] = [{"step": k, "policy_version": k + 1, "episodes": 16, "generated_tokens": 100,
                        "sequence_tokens": 100, "teacher_forward_tokens": 0 if method == "grpo" else 400}
                       for k in range(last)]
    if teacher is not None:
        rec["teacher"] = {"method": "grpo", "seed": seed, "step": teacher}
    rec.update(metric="success", complete=True)
    return rec


def test_results_files_report_and_table(tmp_path):
    """A two-seed teacher experiment written as results files: aggregate's summaries, paired and compute-matched
    comparisons and compute are what the records say; --table prints them from the folder alone."""
    header = {"config": {"run": {"steps": 2}}, "run_steps": 2, "teacher_steps": 4, "compute_matched": True, "ppo_epochs": 1}
    lose, win = {"a": [0], "b": [0]}, {"a": [1], "b": [1]}
    recs = [record(header, "grpo", s, {2: lose, 4: {"a": [1], "b": [0]}, 6: {"a": [1], "b": [s]}}) for s in (0, 1)]
    recs += [record(header, "opd", s, {2: win}, teacher=4) for s in (0, 1)]
    untrained = learning.new_record(header, "untrained", None)
    untrained.update(steps={"0": {"value": 0.5, "lo": 0.0, "hi": 1.0, "n": 2, "episodes": rows({"a": [1], "b": [0]}),
                                  "errors": []}}, metric="success", complete=True)
    results = tmp_path / "results"
    for rec in [untrained, *recs]:
        path = learning.write_results(results, rec)
        assert path.stat().st_size < 200_000
    assert sorted(p.name for p in results.iterdir()) == ["grpo-seed0.json", "grpo-seed1.json", "opd-seed0.json",
                                                         "opd-seed1.json", "untrained.json"]
    agg = learning.aggregate(learning.read_results(results))
    assert agg["seeds"] == [0, 1] and agg["games"] == 2 and agg["untrained"]["value"] == 0.5
    assert list(agg["methods"]) == ["grpo", "opd"] and list(agg["methods"]["grpo"]) == [2, 4, 6]
    assert agg["methods"]["grpo"][6]["summary"] == {"seeds": 2, "mean": 0.75, "min": 0.5, "max": 1.0,
                                                    "std": pytest.approx(0.3535534)}
    opd = agg["methods"]["opd"][2]
    assert (opd["paired"]["diff"], opd["paired"]["lo"], opd["paired"]["hi"]) == (1.0, 1.0, 1.0)
    # Against GRPO at 4 + 2 = 6: seed 0 +0.5 (b), seed 1 0 -> +0.25.
    assert agg["compute_matched_paired"]["opd"]["diff"] == 0.25
    # Compute: opd's 2 steps, plus its teacher's 4 GRPO steps; GRPO at 6 counts its own 6 steps.
    assert opd["compute"]["own"]["episodes"] == 32 and opd["compute"]["own"]["forward_tokens"] == 2 * (100 + 400 + 3 * 100)
    assert opd["compute"]["with_teacher"]["episodes"] == 32 + 64
    assert agg["methods"]["grpo"][6]["compute"]["own"]["episodes"] == 96
    table = learning.markdown_tables(agg)
    assert "| opd | 2 | 2 | 1.000 [1.000, 1.000] | 0.000 | +1.000 [+1.000, +1.000] (2x2) | 32 |" in table
    assert "| grpo (teacher) | 4 |" in table and "| grpo (compute-matched) | 6 |" in table
    assert "compute-matched: paired vs GRPO step 6 |" in table and "| +0.250 [" in table.split("| opd | 2 |")[1]
    assert all(line.count("|") == 11 for line in table.splitlines() if line.startswith("|"))  # 10 columns each
    assert agg["runs"] == 4 and "for 4 (method, seed) runs" in table  # wall time from the records' seconds
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--table", "--results", str(results)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout == table + "\n" + learning.training_table(recs + [untrained]), proc.stderr[-2000:]
    # --methods and --seeds choose the rows (the step-0 record always shown); a seed or method not there is refused.
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--table", "--results", str(results), "--methods",
                           "grpo", "--seeds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "| grpo | 2 | 1 | 0.000 (95% CI" in proc.stdout and "| opd |" not in proc.stdout
    # With --teacher, --table trains nothing: --methods need not start with grpo (its rows are shown anyway).
    proc_t = subprocess.run([sys.executable, "benchmarks/learning.py", "--teacher", "--table", "--results", str(results),
                             "--methods", "opd", "--seeds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc_t.returncode == 0 and "| grpo | 2 | 1 |" in proc_t.stdout and "| opd | 2 | 1 |" in proc_t.stdout, proc_t.stderr
    assert "| untrained | 0 |" in proc.stdout and "over training seeds [1]" in proc.stdout, proc.stdout[:3000]
    with pytest.raises(SystemExit, match="--table --seeds: 7 not in .* \\(it holds 0 1\\)"):
        learning.table_records(recs + [untrained], results, None, [0, 7])
    picked = learning.table_records(recs + [untrained], results, ["opd"], [0])  # GRPO stays: the baseline, the teacher
    assert sorted((r["method"], r["seed"]) for r in picked) == [("grpo", 0), ("opd", 0), ("untrained", None)]
    with pytest.raises(SystemExit, match="--table: no opd file of seeds 0 in"):
        learning.table_records([r for r in recs if (r["method"], r["seed"]) != ("opd", 0)] + [untrained], results, ["opd"], [0])
    with pytest.raises(SystemExit, match="no step-0 record"):
        learning.table_records(recs, results, None, None)
    curves = learning.curves(agg)  # learning.png: up to run.steps, mean and min-max over seeds
    assert [p["step"] for p in curves["grpo"]] == [2] and curves["opd"][0] == {
        "step": 2, "metric": "success", "value": 1.0, "lo": 1.0, "hi": 1.0, "seeds": 2}
    json.dumps(agg)  # learning.json holds it
    other = learning.new_record({**header, "run_steps": 3}, "opd", 5)
    learning.write_results(results, {**other, "steps": {}})
    with pytest.raises(SystemExit, match="mix experiments"):
        learning.aggregate(learning.read_results(results))


def test_results_are_never_overwritten_without_resume_nor_mixed(tmp_path):
    """A results file of a (method, seed) about to run is refused without --resume, and under --resume when it
    was written by another experiment: before any model is loaded or anything written to --out."""
    results = tmp_path / "r"
    other = {"config": {}, "run_steps": 1, "teacher_steps": None, "compute_matched": False, "ppo_epochs": 1}
    learning.write_results(results, learning.new_record(other, "grpo", 0))  # valid, of another experiment

    def run(*flags):
        return subprocess.run([sys.executable, "benchmarks/learning.py", "--quick", "--seeds", "0", "--results",
                               str(results), "--out", str(tmp_path / "out"), *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})

    proc = run()
    assert proc.returncode == 1 and "grpo-seed0.json exists: --resume continues" in proc.stderr, proc.stderr[-2000:]
    proc = run("--resume")
    assert proc.returncode == 1 and "was written with another config" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--seeds", "1", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--seeds: each seed once" in proc.stderr
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--compute-matched"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--compute-matched needs --teacher" in proc.stderr


def test_seeded_configs_differ_only_in_run_seed_and_name(tmp_path):
    """--seeds: each (method, seed) trains with run.seed = S; eval games and eval.seed are the config's for all.
    --teacher --compute-matched: GRPO trains teacher_steps + run.steps and is evaluated at both."""
    import argparse

    import yaml

    from opsd.config import RunConfig

    base = yaml.safe_load((ROOT / "configs" / "learning-teacher.yaml").read_text())
    args = argparse.Namespace(methods=list(learning.TEACHER_METHODS), seeds=[0, 3], teacher=True, compute_matched=True,
                              out=tmp_path, results=tmp_path / "r", keep_snapshots=False, resume=False,
                              drop_checkpoints=True, init=None)
    run_cfg = RunConfig.model_validate(base)
    plan = learning.Plan(args, base, run_cfg, 6, 12)
    g0, g3, opd3 = plan.config_of("grpo", 0), plan.config_of("grpo", 3), plan.config_of("opd", 3)
    assert g0["run"]["seed"] == 0 and g3["run"]["seed"] == 3 and g3["run"]["steps"] == 18 and opd3["run"]["steps"] == 6
    assert g3["run"]["name"] == "learning-grpo-seed3" and g3["eval"] == g0["eval"] == base["eval"]
    assert {k: v for k, v in g3.items() if k != "run"} == {k: v for k, v in g0.items() if k != "run"}
    assert opd3["teacher"]["model"]["name"] == str(tmp_path / "teacher-seed3")
    assert plan.wanted("grpo") == {3, 6, 12, 18} and plan.wanted("opd") == {3, 6}
    for cfg in (g3, opd3):
        RunConfig.model_validate(cfg)
    assert learning.experiment_name(Path("configs/learning-teacher.yaml"), True, False) == "learning-teacher"
    assert learning.experiment_name(Path("configs/learning.yaml"), True, True) == "learning-teacher-quick"


def fake_model(path: Path, value: float) -> Path:
    """An HF-shaped directory (config.json and one safetensors file holding `value`): what --init reads."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    save_file({"w": torch.full((4,), value)}, str(path / "model.safetensors"))
    return path


def test_init_start_is_identified_by_its_weights_not_its_path(tmp_path):
    """--init: every method starts from one checkpoint; its results are keyed by the sha256 of its weights, so a
    copy elsewhere continues the same experiment and other weights do not; the step-0 record is "start"."""
    import argparse

    import yaml

    from opsd.config import RunConfig

    a, b, c = fake_model(tmp_path / "a", 1.0), fake_model(tmp_path / "elsewhere" / "a", 1.0), fake_model(tmp_path / "c", 2.0)
    assert learning.weights_sha256(a) == learning.weights_sha256(b) != learning.weights_sha256(c)
    with pytest.raises(SystemExit, match="no \\*.safetensors"):
        learning.weights_sha256(tmp_path)
    base = yaml.safe_load((ROOT / "configs" / "learning-mid.yaml").read_text())
    run_cfg = RunConfig.model_validate(base)

    def plan(init):
        args = argparse.Namespace(methods=["grpo", "alignopsd"], seeds=[0], teacher=False, compute_matched=False,
                                  out=tmp_path, results=tmp_path / "r", keep_snapshots=False, resume=False,
                                  drop_checkpoints=False, init=init)
        cfg = json.loads(json.dumps(base))
        if init is not None:
            cfg["model"]["name"] = str(init.resolve())  # as base_config sets it for the runs
        return learning.Plan(args, cfg, run_cfg, 4, None)

    pa, pb, pc, none = plan(a), plan(b), plan(c), plan(None)
    assert pa.config_of("alignopsd", 0)["model"]["name"] == str(a.resolve())  # the runs load the start
    assert pa.header["config"]["model"]["name"].startswith("--init sha256:") and str(tmp_path) not in json.dumps(pa.header)
    h = learning.config_hash
    assert h(pa.header) == h(pb.header) != h(pc.header) and h(pa.header) != h(none.header)
    assert "init" not in none.header and none.start == "untrained"  # experiments without --init keep their hashes
    assert pa.start == "start" and learning.results_path(tmp_path, pa.start, None).name == "start.json"
    header = {**pa.header, "run_steps": 4}
    start = learning.new_record(header, "start", None)
    start.update(steps={"0": {"value": 0.5, "lo": 0.0, "hi": 1.0, "n": 2, "episodes": rows({"x": [1], "y": [0]}),
                              "errors": []}}, metric="success", complete=True)
    results = tmp_path / "results"
    grpo, align = record(header, "grpo", 0, {4: {"x": [1], "y": [1]}}), record(header, "alignopsd", 0, {4: {"x": [1], "y": [0]}})
    for k, t in enumerate(align["training"]):  # steps 0-3: success, mixed groups and AlignOPSD's turn weights
        t.update({"success_rate": k / 4, "mixed_groups": k % 3, "alignopsd/turn_weight_min": 1 - k / 10,
                  "alignopsd/turn_weight_max": 1 + k / 10})
    del align["training"][2]["alignopsd/turn_weight_min"]  # a step without the metric shows "-", not a made-up value
    for rec in (start, grpo, align):
        learning.write_results(results, rec)
    train = learning.training_table(learning.read_results(results))
    assert "| alignopsd | 1 | 0.00 0.25 0.50 0.75 | 0 1 2 0 | turn weights 1.00-1.00 0.90-1.10 - 0.70-1.30 |" in train
    assert "| grpo | 1 | - - - - | - - - - |  |" in train and "each step 2 groups" in train
    agg = learning.aggregate(learning.read_results(results))
    assert agg["untrained"]["value"] == 0.5 and agg["init"]["sha256"] == learning.weights_sha256(a)
    table = learning.markdown_tables(agg)
    assert f"| start (--init sha256 {agg['init']['sha256'][:12]}) | 0 | | 0.500" in table
    assert "| alignopsd | 4 | 1 | 0.500 (95% CI [0.000, 1.000]) |  | -0.500 [" in table and "its own training is not counted" in table
    # Against the start (x won, y lost): GRPO won both (+0.5), AlignOPSD the same games (0).
    assert ("Against the start (step 0's one evaluation as every seed's base), paired per (seed, game), at step 4: "
            "grpo +0.500 [+0.000, +1.000] (1x2); alignopsd +0.000 [+0.000, +0.000] (1x2).") in table

    def cli(*flags):
        return subprocess.run([sys.executable, "benchmarks/learning.py", *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})

    proc = cli("--init", str(a), "--teacher")
    assert proc.returncode == 2 and "--init with --teacher" in proc.stderr
    proc = cli("--init", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "not an HF model directory" in proc.stderr and not (tmp_path / "out").exists()
    # The final policy is evaluated on its snapshot: run.steps must be a multiple of trainer.snapshot_every (4).
    proc = cli("--init", str(a), "--config", "configs/learning-mid.yaml", "--steps", "6", "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and "run.steps (6) must be a multiple of trainer.snapshot_every (4)" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_benchmark_in_progress_and_failed_evaluations_still_make_a_table(tmp_path):
    """--table on a folder being written: a student without its final point yet, a seed evaluated at one step only,
    a student whose teacher record is missing, an evaluation whose tasks all failed: each row says what it has."""
    header = {"config": {"env": {"num_games": 2}}, "run_steps": 2, "teacher_steps": 4, "compute_matched": True, "ppo_epochs": 1}
    g0 = record(header, "grpo", 0, {2: {"a": [0], "b": [0]}, 4: {"a": [1], "b": [1]}, 6: {"a": [1], "b": [1]}})
    g1 = record(header, "grpo", 1, {2: {"a": [1], "b": [0]}})  # stopped after its step-2 point
    g1["training"] = g1["training"][:1]
    opd0 = record(header, "opd", 0, {2: {"a": [1], "b": [1]}}, teacher=4)
    opd3 = record(header, "opd", 3, {2: {"a": [1], "b": [0]}}, teacher=4)  # no GRPO seed 3 record
    failed = record(header, "alignopsd", 0, {2: {"a": [1]}}, teacher=4)
    failed["steps"]["2"] = {"value": None, "lo": None, "hi": None, "n": 0, "episodes": [], "errors": [{"task_id": "a", "error": "E"}, {"task_id": "b", "error": "E"}]}
    started = {**learning.new_record(header, "gc_opd", 0), "teacher": {"method": "grpo", "seed": 0, "step": 4}}
    a0, a1 = (record(header, "agentopsd", s, {2: {"a": [1], "b": [s]}}, teacher=4) for s in (0, 1))
    a1["steps"]["2"] = {**failed["steps"]["2"]}  # seed 1's evaluation failed: seed 0's point, with seed 0's interval
    a0["steps"]["2"].update(lo=0.25, hi=0.75)
    recs = [g0, g1, opd0, opd3, failed, started, a0, a1, learning.new_record(header, "untrained", None)]
    agg = learning.aggregate(recs)
    # GRPO at step 2: seeds 0 (16 episodes) and 1 (16); at step 6 only seed 0, with its 6 steps' compute.
    assert agg["methods"]["grpo"][2]["summary"]["seeds"] == 2 and agg["methods"]["grpo"][6]["compute"]["own"]["episodes"] == 96
    assert agg["methods"]["opd"][2]["compute"]["with_teacher"] is None  # seed 3's teacher record is missing
    assert "alignopsd" not in agg["methods"] or 2 not in agg["methods"]["alignopsd"]  # no episodes: no point
    assert set(agg["compute_matched_paired"]) == {"opd", "agentopsd"}
    table = learning.markdown_tables(agg)
    assert "its teacher's GRPO record is missing" in table and "nan" not in table
    assert agg["methods"]["agentopsd"][2]["ci95"] == {0: [0.25, 0.75]} and "| agentopsd | 2 | 1 | 0.500 (95% CI [0.250, 0.750])" in table
    assert ("Not complete yet (stopped or still running; their rows hold the steps evaluated so far): gc_opd seed 0, "
            "untrained (step 0).") in table
    assert learning.training_table([learning.new_record(header, "untrained", None)]) == ""
    assert learning._num(None) == "n/a"


def test_a_lost_run_is_not_mixed_with_its_successor(tmp_path):
    """--resume of an incomplete (method, seed) whose run directory is gone: its evaluations are dropped (a new
    run starts from step 0); a lost GRPO teacher whose student has started refuses, naming the student's file."""
    import argparse

    args = argparse.Namespace(methods=["grpo", "opd"], seeds=[0], teacher=True, compute_matched=False, out=tmp_path,
                              results=tmp_path / "r", keep_snapshots=False, resume=True, drop_checkpoints=False, init=None)
    run_cfg = argparse.Namespace(trainer=argparse.Namespace(ppo_epochs=1))
    plan = learning.Plan(args, {"env": {}}, run_cfg, 2, 4)
    header = plan.header
    rec = {**record(header, "opd", 0, {2: {"a": [1]}}, teacher=4), "complete": False, "run": "learning-opd-seed0-1"}
    (learning.run_root(tmp_path, "opd", 0) / "learning-opd-seed0-1").mkdir(parents=True)
    learning.forget_lost_run(plan, rec)
    assert rec["steps"]  # its run is there: kept
    rec["run"] = "learning-opd-seed0-0"
    learning.forget_lost_run(plan, rec)
    assert rec["steps"] == {} and rec["training"] == [] and rec["run"] is None
    grpo = {**record(header, "grpo", 0, {2: {"a": [0]}, 4: {"a": [1]}}), "complete": False, "run": "gone"}
    plan.records[("opd", 0)] = record(header, "opd", 0, {2: {"a": [1]}}, teacher=4)
    plan.teacher_dir(0).mkdir()
    with pytest.raises(SystemExit, match="opd-seed0.json"):
        learning.forget_lost_run(plan, grpo)
    del plan.records[("opd", 0)]
    learning.forget_lost_run(plan, grpo)
    assert grpo["steps"] == {} and not plan.teacher_dir(0).exists()  # the lost run's teacher goes with it


def test_damaged_results_files_are_refused_by_name_and_field(tmp_path):
    """A hand edit or a partial copy stops --table naming the file and the field, never a silently wrong table:
    a NaN or string `won`, a reward outside [0, 1], a negative seed, a file whose name is not its (method, seed),
    a header edited after the run (its hash), two step-0 records, an episode listed twice, a training record lost,
    a student's teacher of another seed, a game renamed in one file (every evaluation plays the same games), an n
    or a success value its episodes contradict, a complete record without its final evaluation (unless listed in
    missing_steps), a failed task without its game, a training record's non-number or a policy version not its
    step + 1, an interval that misses its value, an evaluated step not the experiment's, a student without its
    teacher or a teacher trained short of the student's step, two metrics in one folder, a FIFO, a nesting too
    deep to parse. Dot-files (a write in progress) are skipped."""
    header = {"config": {}, "run_steps": 2, "teacher_steps": None, "compute_matched": False, "ppo_epochs": 1}
    good = record(header, "grpo", 0, {2: {"a": [1], "b": [0]}})

    def refused(name: str, rec: dict, *more: tuple[str, dict]) -> str:
        folder = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for n, r in ((name, rec), *more):
            (folder / n).write_text(json.dumps(r))
        with pytest.raises(SystemExit) as e:
            learning.read_results(folder)
        return str(e.value)

    def edited(path: tuple, value) -> dict:
        rec = json.loads(json.dumps(good))
        node = rec
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return rec

    msg = refused("grpo-seed0.json", edited(("steps", "2", "episodes", 0, "won"), "false"))
    assert "grpo-seed0.json: not a valid learning results file: steps.2.episodes.0.won" in msg
    bad_reward = json.loads(json.dumps(good).replace('"reward": 1.0', '"reward": NaN'))
    assert "steps.2.episodes.0.reward" in refused("grpo-seed0.json", bad_reward)
    assert "steps.2.episodes.1.reward" in refused("grpo-seed0.json", edited(("steps", "2", "episodes", 1, "reward"), 1e308))
    assert "seed" in refused("grpo-seed0.json", edited(("seed",), -1))
    assert "holds method 'grpo' seed 0, whose file is grpo-seed0.json" in refused("grpo-seed1.json", good)
    assert "not the hash of its header" in refused("grpo-seed0.json", edited(("run_steps",), 3))
    start = learning.new_record(header, "untrained", None)
    assert "two step-0 records" in refused("untrained.json", start, ("start.json", {**start, "method": "start"}))
    assert "not a learning results file" in refused("grpo-seed0.json", good, ("opd-seed0.json", "[1, 2"))
    twice = edited(("steps", "2", "episodes"), good["steps"]["2"]["episodes"] + [good["steps"]["2"]["episodes"][1]])
    assert "steps.2: an episode listed twice" in refused("grpo-seed0.json", twice)
    lost = edited(("training",), good["training"][1:])
    assert "training: steps [1] are not 0, 1, 2" in refused("grpo-seed0.json", lost)
    student = record({**header, "teacher_steps": 4}, "opd", 0, {2: {"a": [1], "b": [1]}}, teacher=4)
    assert "teacher is GRPO seed 1 step 4" in refused("opd-seed0.json", {**student, "teacher": {**student["teacher"], "seed": 1}})
    renamed = record(header, "grpo", 1, {2: {"a": [1], "c": [0]}})
    msg = refused("grpo-seed0.json", good, ("grpo-seed1.json", renamed))
    assert "grpo-seed1.json: steps.2: its held-out games differ from" in msg and "b, c" in msg
    assert "steps.2: n is 3, but 2 episodes are listed" in refused("grpo-seed0.json", edited(("steps", "2", "n"), 3))
    msg = refused("grpo-seed0.json", edited(("steps", "2", "value"), 1.0))
    assert "steps.2: value is 1.0, but the episodes listed give 0.5" in msg
    msg = refused("grpo-seed0.json", edited(("steps",), {}))
    assert "grpo-seed0.json: complete, but step 2 is neither evaluated (steps) nor listed in missing_steps" in msg
    assert "complete, but step 0 is" in refused("untrained.json", {**start, "complete": True})
    assert "missing_steps.0" in refused("grpo-seed0.json", {**edited(("steps",), {}), "missing_steps": ["2"]})
    assert "steps.2.errors.0.task_id" in refused("grpo-seed0.json", edited(("steps", "2", "errors"), [{"task_id": ["a"], "error": "E"}]))
    assert "training.0.policy_version" in refused("grpo-seed0.json", edited(("training", 0, "policy_version"), "abc"))
    assert "policy versions [1, 99] are not step + 1" in refused("grpo-seed0.json", edited(("training", 1, "policy_version"), 99))
    msg = refused("grpo-seed0.json", edited(("training", 0, "alignopsd/turn_weight_min"), "low"))
    assert "training.0: Value error, alignopsd/turn_weight_min is 'low': a finite number or null expected" in msg
    assert "training.1: Value error, loss is inf" in refused("grpo-seed0.json", json.loads(
        json.dumps(edited(("training", 1, "loss"), 1.0)).replace('"loss": 1.0', '"loss": Infinity')))
    msg = refused("grpo-seed0.json", edited(("training",), good["training"][:1]))
    assert "step 2 evaluated, but 1 training records" in msg
    unevaluated = {**edited(("training",), good["training"][:1]), "steps": {}, "missing_steps": [2]}
    assert "complete, but 1 training records for 2 steps" in refused("grpo-seed0.json", unevaluated)
    assert "both given, or neither" in refused("grpo-seed0.json", edited(("steps", "2", "lo"), None))
    graded = {**edited(("steps", "2", "episodes", 0, "reward"), 0.5), "metric": "f1"}  # F1's value: the mean reward
    assert "steps.2: value is 0.5, but the episodes listed give 0.25" in refused("grpo-seed0.json", graded)
    assert "metric: Input should be" in refused("grpo-seed0.json", {**good, "metric": "bogus"})
    assert "run_steps: Input should be less than or equal to 1000000" in refused("grpo-seed0.json", edited(("run_steps",), 10**12))
    assert "seed: Input should be less than 4294967296" in refused("grpo-seed0.json", edited(("seed",), 2**70))
    assert "missing_steps [2]: each once, not evaluated" in refused("grpo-seed0.json", {**good, "missing_steps": [2]})
    cm = record({**header, "compute_matched": True}, "grpo", 0, {2: {"a": [1], "b": [0]}})
    assert "compute_matched without teacher_steps" in refused("grpo-seed0.json", cm)
    floaty = record({**header, "config": {"trainer": {"snapshot_every": 4.0}}}, "grpo", 0, {2: {"a": [1], "b": [0]}})
    assert "config.trainer.snapshot_every is 4.0: an integer >= 0 expected" in refused("grpo-seed0.json", floaty)
    once = {**header, "config": {"eval": {"episodes_per_task": 1}}}
    extra = record(once, "grpo", 0, {2: {"a": [1, 1], "b": [0]}})
    assert "steps.2: game a has not episodes 0..0 (config.eval.episodes_per_task 1)" in refused("grpo-seed0.json", extra)
    assert "does not hold the value 0.5" in refused("grpo-seed0.json", edited(("steps", "2", "lo"), 0.9))
    assert "evaluations without a metric" in refused("grpo-seed0.json", {k: v for k, v in good.items() if k != "metric"})
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "grpo-seed0.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(SystemExit, match="not a learning results file \\(RecursionError"):
        learning.read_results(deep)
    assert "init: Input should be a valid dictionary" in refused("grpo-seed0.json", edited(("init",), "abc"))
    assert "config.env: Input should be a valid dictionary" in refused("grpo-seed0.json", edited(("config",), {"env": ["twx"]}))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "grpo-seed0.json")
    with pytest.raises(SystemExit, match="not a regular file"):
        learning.read_results(fifo)
    teacher_header = {**header, "teacher_steps": 4}
    student = record(teacher_header, "opd", 0, {2: {"a": [1], "b": [1]}}, teacher=4)
    assert "no teacher: a opd student" in refused("opd-seed0.json", {**student, "teacher": None})
    assert "no teacher" in refused("opd-seed0.json", {**student, "teacher": None, "training": [], "complete": False})
    grpo_t = record(teacher_header, "grpo", 0, {2: {"a": [1], "b": [0]}, 4: {"a": [1], "b": [1]}})
    assert "has a teacher, but grpo is the teacher" in refused("grpo-seed0.json", {**grpo_t, "teacher": student["teacher"]})
    short = {**grpo_t, "training": grpo_t["training"][:3], "steps": {"2": grpo_t["steps"]["2"]}, "complete": False}
    msg = refused("opd-seed0.json", student, ("grpo-seed0.json", short))
    assert "opd-seed0.json: its teacher is GRPO seed 0 at step 4, but grpo-seed0.json holds 3 training records" in msg
    assert "measure different metrics" in refused("grpo-seed0.json", good, ("grpo-seed1.json", {
        **record(header, "grpo", 1, {2: {"a": [1], "b": [0]}}), "metric": "f1"}))
    snap = record({**header, "config": {"trainer": {"snapshot_every": 2}}, "run_steps": 4}, "grpo", 0,
                  {2: {"a": [1], "b": [0]}, 3: {"a": [1], "b": [0]}, 4: {"a": [1], "b": [0]}})
    assert "steps: 3 evaluated, not one of the experiment's policy versions" in refused("grpo-seed0.json", snap)
    folder = tmp_path / "ok"
    learning.write_results(folder, {**edited(("steps",), {}), "missing_steps": [2]})  # a snapshot never written: said so
    assert learning.read_results(folder)[0]["missing_steps"] == [2]
    learning.write_results(folder, good)
    (folder / ".grpo-seed1.json.tmp.json").write_text("{")  # an interrupted write: skipped
    assert learning.read_results(folder) == [good]
