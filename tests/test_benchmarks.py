"""Smoke tests of the benchmark suite: each script runs at tiny sizes and writes a valid report;
the driver combines reports into one table. Values are checked for sense, never against timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks import common, run, transport
from opsd import wire
from opsd.redis_server import connect

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str, timeout: int = 600) -> dict:
    """Run benchmarks/<script> with --json `out` as `make bench` does; returns the JSON it wrote."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return common.load_report(out)


def check_report(doc: dict, benchmark: str) -> dict[str, dict]:
    """The report is well formed: rows with finite positive values (or None with a reason), parseable targets,
    ok consistent with value and target. Returns the rows by name."""
    assert doc["benchmark"] == benchmark
    assert "cores" in doc["machine"] and doc["command"].startswith("OMP_NUM_THREADS=1 .venv/bin/python benchmarks/")
    assert doc["rows"]
    for r in doc["rows"]:
        assert set(r) == {"name", "value", "unit", "target", "ok", "note"}
        if r["value"] is None:
            assert r["note"], f"{r['name']}: no value and no reason"
        else:
            assert math.isfinite(r["value"]) and r["value"] > 0, r
        if r["target"] is not None:
            common.parse_target(r["target"])
            if r["value"] is not None:
                assert r["ok"] == common.meets(r["value"], r["target"])
    return {r["name"]: r for r in doc["rows"]}


# ---------------------------------------------------------------- common.py


def test_targets_parse_and_decide_ok():
    assert common.parse_target("< 2 %") == ("<", 2.0, "%")
    assert common.parse_target(">= 2 x") == (">=", 2.0, "x")
    assert common.parse_target("<=1e-3") == ("<=", 1e-3, "")
    assert common.meets(1.99, "< 2") and not common.meets(2.0, "< 2") and common.meets(2.0, ">= 2 x")
    for bad in ("2x or more", "under 2%", "", "< two"):
        with pytest.raises(ValueError):
            common.parse_target(bad)
    assert common.Row("a", 0.5, "%", target="< 2 %").ok is True
    assert common.Row("a", 3.0, "x", target=">= 2 x").ok is True
    assert common.Row("a", 1.0, "x", target=">= 2 x").ok is False
    assert common.Row("a", None, "x", target=">= 2 x").ok is None  # not measured: neither met nor missed
    with pytest.raises(ValueError, match="unit"):
        common.Row("a", 1.0, "ms", target="< 2 s")
    nan = common.Row("a", float("nan"), "s")
    assert nan.value is None and nan.ok is False and "nan" in nan.note  # JSON stays valid, the problem visible


def test_the_driver_combines_two_reports_into_one_table(tmp_path):
    a = common.write_json(tmp_path / "a.json", "transport", "cmd a",
                          [common.Row("msgs", 12.5, "msg/s"), common.Row("share", 0.1, "%", target="< 2 %")])
    common.write_json(tmp_path / "b.json", "credit", "cmd b", [common.Row("grpo: median s", 0.02, "s", target="< 0.1 s")])
    assert json.loads((tmp_path / "a.json").read_text()) == a
    reports = run.load_reports([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "missing.json"])
    cells = common.table_rows(reports)
    assert cells == [["transport", "msgs", "12.5", "msg/s", "", ""],
                     ["transport", "share", "0.1", "%", "< 2 %", "yes"],
                     ["credit", "grpo: median s", "0.02", "s", "< 0.1 s", "yes"],
                     ["missing", cells[3][1], "n/a", "", "", "NO"]]
    assert cells[3][1].startswith("failed: unreadable")
    md = run.summary_markdown(reports, "2 cores (test)", "driver", 60.0)
    assert md.count("| benchmark | measure | value |") == 1  # one table for every benchmark
    assert "| credit | grpo: median s | 0.02 | s | < 0.1 s | yes |" in md and "`cmd a`" in md
    assert run.failures(reports) == [f"missing: {cells[3][1]}"]
    common.print_table(reports)  # rich renders it without error


def test_the_driver_reports_a_missing_script_and_goes_on(tmp_path):
    rep = run.run_script(run.Script("nothing", "benchmarks/does_not_exist.py"), tmp_path, quick=True, timeout_s=None)
    assert rep["rows"][0]["name"] == "failed: benchmarks/does_not_exist.py does not exist"
    assert rep["rows"][0]["value"] is None and rep["rows"][0]["ok"] is False
    names = [s.stem for s in run.SCRIPTS]
    assert names[:7] == ["transport", "overlap", "backends", "embedder", "credit", "scaling", "inflight"]
    assert not next(s for s in run.SCRIPTS if s.stem == "learning").default  # 3 hours: only with --learning


def test_the_driver_selects_by_stem_or_table_name_and_refuses_unknown_names():
    assert [s.stem for s in run.selected(None, learning=False)] == [s.stem for s in run.SCRIPTS if s.default]
    assert [s.stem for s in run.selected(None, learning=True)][-1] == "learning"
    assert [s.stem for s in run.selected(["teacher", "transport"], learning=False)] == ["transport", "backends"]
    assert [s.stem for s in run.selected(["teacher scoring (backends)"], learning=False)] == ["backends"]
    assert [s.stem for s in run.selected(["learning"], learning=False)] == ["learning"]  # naming it implies --learning
    with pytest.raises(ValueError, match="'transprot'.*valid: transport, overlap, backends"):
        run.selected(["transprot"], learning=False)


# ---------------------------------------------------------------- argument errors: exit 2 before any work

# Each case that would start a benchmark if its check were lost also carries a bad argument checked after it
# (or --quick sizes): a regression then fails on the message, it does not start a long run.
BAD_ARGS = [
    ("run.py", ["--only", "transprot"], "--only"),
    ("run.py", ["--only", "transprot", "--timeout-s", "0"], "--timeout-s"),
    ("scaling.py", ["--quick", "--budget-s", "-1", "--turns", "0"], "--budget-s"),
    ("scaling.py", ["--quick", "--group-sizes", "4", "0", "--turns", "0"], "--group-sizes"),
    ("scaling.py", ["--quick", "--turns", "0"], "--turns"),
    ("learning.py", ["--steps", "0", "--config", "missing.yaml"], "--steps"),
    ("learning.py", ["--config", "missing.yaml"], "--config"),
    ("learning.py", ["--teacher-steps", "4", "--config", "missing.yaml"], "--teacher-steps"),
    ("learning.py", ["--teacher", "--methods", "opd", "grpo", "--config", "missing.yaml"], "--methods"),
    ("learning.py", ["--teacher", "--steps", "4", "--teacher-steps", "2", "--config", "missing.yaml"], "--teacher-steps"),
    ("overlap.py", ["--pairs", "0", "--config", "missing.yaml"], "--pairs"),
    ("overlap.py", ["--steps", "0", "--config", "missing.yaml"], "--steps"),
    ("overlap.py", ["--steps", "3", "--config", "missing.yaml"], "--steps"),  # 2 warm-up steps + 2 measured
    ("overlap.py", ["--quick", "--steps", "2", "--config", "missing.yaml"], "--steps"),  # 1 warm-up + 2
    ("transport.py", ["--step-seconds", "-200", "--messages", "0"], "--step-seconds"),
    ("transport.py", ["--step-seconds", "0", "--messages", "0"], "--step-seconds"),
    ("transport.py", ["--quick", "--messages", "0"], "--messages"),
    ("reference_kl.py", ["--quick", "--steps", "-1"], "--steps"),
    ("reference_kl.py", ["--config", "missing.yaml"], "--config"),
]


@pytest.mark.parametrize("script,args,flag", BAD_ARGS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_ARGS])
def test_bad_arguments_exit_2_naming_the_argument(script, args, flag, tmp_path):
    out = ["--out", str(tmp_path / "out")] if script in ("run.py", "learning.py") else []
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, *out], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: {flag}"), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_benchmark_reads_its_config_as_opsd_run_does_a_repeated_key_refused(tmp_path):
    """learning.py and overlap.py rewrite the --config they read: read with yaml.safe_load, a second trainer: block
    replaced the first silently and the rewritten file passed `opsd run`'s repeated-key check."""
    from benchmarks import overlap

    config = tmp_path / "twice.yaml"
    config.write_text((common.REPO / "configs" / "overlap.yaml").read_text() + "trainer:\n  kl_coef: 0.01\n")
    with pytest.raises(yaml.YAMLError, match="the key 'trainer' appears twice"):
        overlap.run_config(config, 0, 3, 1.0, tmp_path)
    assert not list(tmp_path.glob("config-k*.yaml"))
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--config", str(config), "--out", str(tmp_path / "out")],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"learning.py: error: --config {config}: cannot read it as YAML" in proc.stderr
    assert "the key 'trainer' appears twice" in proc.stderr and not (tmp_path / "out").exists()


def test_learning_checks_every_methods_config_before_evaluating(tmp_path):
    from benchmarks import learning
    from opsd.config import RunConfig

    bad = yaml.safe_load((common.REPO / "configs" / "learning.yaml").read_text())
    bad["model"]["name"] = "tiny-random"  # if the check were lost: a small model, not SmolLM2's evaluation
    bad["rollout"]["temperature"] = 0.7  # fine for grpo (the base config's method), not for alignopsd
    RunConfig.model_validate(learning.method_config(bad, "grpo", None))
    with pytest.raises(ValueError, match="temperature"):
        RunConfig.model_validate(learning.method_config(bad, "alignopsd", None))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    proc = subprocess.run([sys.executable, "benchmarks/learning.py", "--config", str(tmp_path / "bad.yaml"),
                           "--methods", "grpo", "alignopsd", "--out", str(tmp_path / "out")], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "alignopsd" in proc.stdout and "rollout temperature" in proc.stdout and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before the untrained evaluation


def test_learning_resume_refuses_another_experiment(tmp_path):
    """--resume continues only the benchmark its --out holds: without one it is a usage error, and a
    learning.json written with another config is refused before anything runs (the methods may change)."""
    def run(*flags):
        return subprocess.run([sys.executable, "benchmarks/learning.py", *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})

    proc = run("--resume", "--out", str(tmp_path / "none"))
    assert proc.returncode == 2 and "--resume needs --out" in proc.stderr
    out = tmp_path / "out"
    out.mkdir()
    (out / "learning.json").write_text(json.dumps({"config": {"run": {"steps": 99}}, "methods": ["grpo"]}))
    proc = run("--resume", "--out", str(out), "--methods", "grpo")
    assert proc.returncode == 1 and "written with another config or teacher steps" in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["learning.json"]  # nothing evaluated, no config.yaml rewritten


def test_disagreement_benchmark_values_and_smoke_run(tmp_path):
    """benchmarks/disagreement.py: a group's values are opsd.credit.diagnostics' on s_i = mean teacher - sampler
    log-prob over the loss tokens; the bootstrap interval brackets the mean; --quick runs the whole path."""
    from benchmarks import disagreement
    from opsd.credit.diagnostics import group_diagnostics
    from tests.factories import make_scored_group

    sg = make_scored_group(G=4, seed=3)
    for t, r in zip(sg.rollout.trajectories, [1.0, 0.0, 0.5, 0.0]):
        t.reward = r
    s = [float((lp[t.loss_mask_S == 1] - t.sampler_logprobs_S[t.loss_mask_S == 1]).mean())
         for t, lp in zip(sg.rollout.trajectories, sg.teacher_logprobs_S)]
    want = group_diagnostics(np.array([1.0, 0.0, 0.5, 0.0]), np.array(s))
    got = disagreement.group_values(sg)
    assert got == {"pairwise_disagreement": want.pairwise_disagreement, "top1_mismatch": want.top1_mismatch,
                   "preference_gap": want.preference_gap}
    for t in sg.rollout.trajectories:
        t.reward = 0.5
    assert disagreement.group_values(sg) is None  # no verifier preference: excluded
    lo, hi = disagreement.bootstrap([0.0, 1.0, 0.5, 0.25], 500, np.random.default_rng(0))
    assert 0.0 <= lo < 0.4375 < hi <= 1.0 and disagreement.bootstrap([], 10, np.random.default_rng(0)) == (None, None)

    proc = subprocess.run([sys.executable, "benchmarks/disagreement.py", "--quick", "--out", str(tmp_path / "d"),
                           "--json", str(tmp_path / "rows.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "d" / "disagreement.json").read_text())
    assert list(data["buckets"]) == ["96", "192"] and all(b["prompts"] == 2 for b in data["buckets"].values())
    assert (tmp_path / "d" / "disagreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 6 and {r["name"].split(":")[0] for r in rows} == {"96", "192"}


def test_the_teacher_experiments_configs(tmp_path):
    """--teacher: grpo trains alone; the others distill from the external teacher, opd/gc_opd with no privileged
    context, alignopsd with the config's; every config validates; steps_to_reach reads the curve."""
    from benchmarks import learning
    from opsd.config import RunConfig

    base = yaml.safe_load((common.REPO / "configs" / "learning-teacher.yaml").read_text())
    configs = {m: RunConfig.model_validate(learning.teacher_config(base, m, 6, tmp_path / "teacher"))
               for m in learning.TEACHER_METHODS}
    assert configs["grpo"].teacher.source == "self" and configs["grpo"].run.steps == 6
    for m in ("opd", "gc_opd", "alignopsd"):
        cfg = configs[m]
        assert cfg.run.method == m and cfg.teacher.source == "model"
        assert cfg.teacher_model.name == str(tmp_path / "teacher") and cfg.teacher_model.threads == cfg.model.threads
        assert cfg.teacher_model.dtype == cfg.model.dtype and cfg.teacher_model.max_model_len == cfg.model.max_model_len
    assert configs["opd"].env.privileged == configs["gc_opd"].env.privileged == "none"
    assert configs["alignopsd"].env.privileged == base["env"]["privileged"] == "remaining"
    assert base["env"].get("privileged") == "remaining"  # the shared config is left as it was
    points = [{"step": 2, "success": 0.3}, {"step": 4, "success": 0.6}, {"step": 6, "success": 0.55}]
    assert learning.steps_to_reach(points, 0.55) == 4 and learning.steps_to_reach(points, 0.7) is None
    assert learning.steps_to_reach(points, 0.3) == 2
    # A graded env's points carry their headline metric (F1) beside success; old points success alone.
    graded = [{"step": 2, "metric": "f1", "value": 0.45, "success": 0.0}, {"step": 4, "success": 0.5}]
    assert learning.steps_to_reach(graded, 0.4) == 2 and learning.steps_to_reach(graded, 0.5) == 4


def test_overlap_removes_its_temp_dir_when_a_run_fails(tmp_path, monkeypatch):
    from benchmarks import overlap

    work = tmp_path / "opsd-overlap-test"

    def failing_run(*args, **kwargs):
        (work / "0-sync" / "runs").mkdir(parents=True)
        raise RuntimeError("sync run failed (exit 1)")

    monkeypatch.setattr(overlap.tempfile, "mkdtemp", lambda prefix: str(work))
    monkeypatch.setattr(overlap, "measure", failing_run)
    monkeypatch.setattr(sys, "argv", ["benchmarks/overlap.py", "--quick"])
    with pytest.raises(RuntimeError, match="sync run failed"):
        overlap.main()
    assert not work.exists()


def test_backends_judges_its_target_only_at_full_size():
    from benchmarks import backends

    rows = [{"backend": "hf", "workload": f"multi-view: {m}", "seconds": s, "tokens": 10, "tokens_per_s": 10 / s,
             "shape": "5 views", "unit": "view tok/s", "max_abs_diff_vs_per_view": 0.0}
            for m, s in (("shared", 1.0), ("per-view", 3.0), ("batched", 2.0))]
    best = {q: backends.table_rows(rows, quick=q)[-1] for q in (False, True)}
    assert best[False].name == best[True].name == "hf: multi-view best of batched/shared vs per-view"
    assert best[False].value == best[True].value == 3.0
    assert (best[False].target, best[False].ok) == (">= 2 x", True)
    assert (best[True].target, best[True].ok) == (None, None) and "--quick" in best[True].note


# ---------------------------------------------------------------- transport


@pytest.mark.redis
def test_transport_messages_are_valid_and_survive_the_queue_path(redis_url):
    shape = transport.Shape("tiny", G=2, turns=3, prompt_ids=20, response_ids=6, obs_ids=5, think=True, env="alfworld")
    msgs = [transport.make_task(shape, 0), transport.make_rollout_group(shape, 0), transport.make_scored_group(shape, 0)]
    msgs[1].validate(transport.VOCAB_SIZE)
    msgs[2].validate(transport.VOCAB_SIZE)
    assert [len(t.turns) for t in msgs[1].trajectories] == [3, 3]
    client = connect(redis_url, block_ms=2000)
    try:
        for msg in msgs:
            hop = transport.run_hop(client, [msg], n=2)
            assert hop.identical and hop.n == 2 and hop.messages_per_s > 0
            assert hop.mean_bytes == len(wire.encode(msg))
    finally:
        client.close()
    # ALFWorld scale is what the issue names: 8 x 50 turns of several thousand ids each.
    alf = transport.make_rollout_group(transport.ALFWORLD, 0)
    assert len(alf.trajectories) == 8 and all(len(t.turns) == 50 for t in alf.trajectories)
    assert all(5000 < len(t.token_ids_S) < 10000 for t in alf.trajectories)


def test_transport_quick_writes_its_rows(tmp_path):
    # A fresh machine has no redis-benchmark: the script must still print and save every row.
    missing = tmp_path / "no-such-dir" / "redis-benchmark"
    out = tmp_path / "t.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/transport.py", "--quick", "--messages", "2",
                           "--redis-benchmark", str(missing), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = check_report(common.load_report(out), "transport")
    assert rows["self-check: every decoded message == the original"]["value"] == 1.0
    rates = [r for n, r in rows.items() if n.endswith("messages/s")]
    assert len(rates) == 5 and all(r["value"] > 0 for r in rates)  # 2 ALFWorld kinds + 3 quickstart kinds
    share = rows["quickstart step: transport share of step time"]
    assert share["target"] == "< 2 %" and share["unit"] == "%"
    step_ms = rows["quickstart step: transport time"]["value"]
    assert share["value"] == pytest.approx(100 * step_ms / 1000 / transport.DEFAULT_STEP_S)
    bench = [r for n, r in rows.items() if "redis-benchmark" in n]
    assert len(bench) == 2
    for r in bench:
        assert r["value"] is None and "redis-benchmark not found" in r["note"]
    printed = [line for line in proc.stdout.splitlines() if "redis-benchmark" in line]
    assert len(printed) == 2 and all(" n/a " in line for line in printed)


def _fake_redis_benchmark(tmp_path: Path, csv: str, code: int = 0) -> Path:
    """An executable that answers --version and prints `csv` as redis-benchmark --csv would."""
    tmp_path.mkdir()
    exe = tmp_path / "redis-benchmark"
    exe.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "redis-benchmark 7.0.fake"; exit 0; fi\n'
                   f"cat <<'EOF'\n{csv}\nEOF\nexit {code}\n")
    exe.chmod(0o755)
    return exe


def test_redis_benchmark_reads_its_csv_and_reports_a_failure(tmp_path):
    from opsd.redis_server import LocalRedis

    good = _fake_redis_benchmark(tmp_path / "good", '"test","rps"\n"SET","1250.00"\n"GET","2500.50"')
    bad = _fake_redis_benchmark(tmp_path / "bad", "ERR auth", code=1)
    with LocalRedis(data_dir=str(tmp_path / "redis"), appendonly=False) as server:
        client = connect(server.url, block_ms=2000)
        try:
            rps, version = transport.redis_benchmark(server, client, 100, 10, str(good))
            assert rps == {"SET": 1250.0, "GET": 2500.5} and version == "redis-benchmark 7.0.fake"
            rps, why = transport.redis_benchmark(server, client, 100, 10, str(bad))
            assert rps is None and "exit 1" in why and "ERR auth" in why
            # The throwaway ACL user is gone either way.
            assert [u for u in client.execute_command("ACL", "USERS") if str(u).startswith("bench-")] == []
        finally:
            client.close()


def test_print_rows_shows_a_missing_value_as_na(capsys):
    common.print_rows([common.Row("measured", 1234.5, "MB/s", target="> 1 MB/s"),
                       common.Row("not measured", None, "x", note="tool missing"),
                       common.Row("overflowed", float("nan"), "s")], width=20)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:4] == ["measured", "1,234", "MB/s", ">"] and lines[0].split()[-1] == "yes"
    assert lines[1].split()[:4] == ["not", "measured", "n/a", "x"] and lines[1].endswith("tool missing")
    assert "n/a" in lines[2] and "value was nan" in lines[2] and " NO " in lines[2]


# ---------------------------------------------------------------- groups in flight


def test_inflight_quick_plays_every_mode_and_reports_the_ratios(tmp_path):
    out = tmp_path / "raw.json"
    rows = check_report(run_benchmark("inflight.py", tmp_path / "i.json", "--quick", "--groups", "2", "--turns", "2",
                                      "--new", "4", "--threads", "1", "--out", str(out)), "in flight (hf)")
    raw = json.loads(out.read_text())
    modes = [r["mode"] for r in raw["rollout"]]
    assert modes == ["(a) lockstep", "(b) 1 in flight", "(b) 2 in flight", "(c) engine alone, batch 2",
                     "(c) engine alone, batch 4", "(c) engine alone, turn-ordered replay"]
    a, b1, b2, c2, c4, replay = raw["rollout"]
    assert a["episodes"] == b1["episodes"] == b2["episodes"] == 4  # 2 groups x 2 episodes, each way
    best = max((b1, b2), key=lambda r: r["tokens_per_s"])
    ratio = rows[f"hf rollout (b)/(a) at the best K ({best['k']}): episodes/s"]
    assert ratio["value"] == pytest.approx(best["episodes_per_s"] / a["episodes_per_s"], rel=1e-6)
    assert ratio["target"] is None  # --quick, and transformers: reported without a target
    # (b)/(c) against the fastest (c) mode, which the row names; the replay has its own row.
    fastest = min((c2, c4, replay), key=lambda r: r["seconds"])
    vs_engine = rows[f"hf rollout (b)/(c) at the best K ({best['k']}), (c) the fastest: tokens/s"]
    assert vs_engine["value"] == pytest.approx(best["tokens_per_s"] / fastest["tokens_per_s"], rel=1e-6)
    assert f"fastest (c): {fastest['mode']} (" in vs_engine["note"]
    vs_replay = rows[f"hf rollout (b)/(c) at the best K ({best['k']}), (c) the turn-ordered replay: tokens/s"]
    assert vs_replay["value"] == pytest.approx(best["tokens_per_s"] / replay["tokens_per_s"], rel=1e-6)
    # Every engine-alone pass generated exactly the response lengths (b) recorded: EOS ignored.
    assert c4["tokens"] == c2["tokens"] == replay["tokens"] == best["tokens"] and c4["requests"] >= 4
    # The replay played (b)'s requests turn by turn on one engine, its later turns resuming earlier turns' KV.
    assert replay["requests"] == c4["requests"] and replay["waves"] >= 1
    if replay["waves"] > 1:
        assert replay["prefix_hit_rate"] > 0
    assert rows["hf engine alone: batch 4 / batch 2 tokens/s"]["value"] == pytest.approx(
        c4["tokens_per_s"] / c2["tokens_per_s"], rel=1e-6)
    assert [r["mode"] for r in raw["teacher"]] == ["(a) one group at a time", "(b) 2 in flight", "(c) one score call"]
    assert len({r["tokens"] for r in raw["teacher"]}) == 1 and raw["teacher"][0]["tokens"] > 0


def test_inflight_recording_numbers_each_episodes_turns_and_the_replay_plays_them_wave_by_wave():
    from concurrent.futures import Future
    from types import SimpleNamespace

    from benchmarks import inflight
    from opsd.models.engine import SampleRequest

    class Engine:  # answers every request at once with 3 ids
        policy_version = 0

        def submit(self, request):
            f = Future()
            f.set_result(SimpleNamespace(token_ids=[1, 2, 3]))
            return f

    rec = inflight.Recording(Engine())
    for turn in range(2):
        for ep in ("g/0", "g/1"):
            rec.submit(SampleRequest([5, turn, len(ep)], 4, 1.0, seed=turn, cache_key=ep)).result()
    assert [(r["key"], r["turn"], r["n"], r["seed"]) for r in rec.records] == [
        ("g/0", 0, 3, 0), ("g/1", 0, 3, 0), ("g/0", 1, 3, 1), ("g/1", 1, 3, 1)]
    assert rec.requests == [(r["prompt_ids"], r["n"]) for r in rec.records]
    waves = inflight.turn_waves(list(reversed(rec.records)))
    assert [[(r["key"], r["turn"]) for r in w] for w in waves] == [[("g/1", 0), ("g/0", 0)], [("g/1", 1), ("g/0", 1)]]

    class LLM:  # vLLM's offline LLM, as the replay calls it
        def __init__(self):
            self.calls, self.resets = [], 0

        def generate(self, prompts, params, use_tqdm):
            self.calls.append([(p["prompt_token_ids"], sp["max_tokens"], sp["ignore_eos"], sp["seed"])
                               for p, sp in zip(prompts, params)])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * sp["max_tokens"])]) for sp in params]

        def reset_prefix_cache(self):
            self.resets += 1

    llm = LLM()
    seconds, tokens = inflight.replay_waves_vllm(llm, rec.records, sampling_params=dict,
                                                 tokens_prompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids})
    assert tokens == 12 and seconds >= 0 and llm.resets == 1
    warm, first, second = llm.calls  # a warm-up, then one call per turn: every first turn, then every second
    assert len(warm) == 2 and [c[0][1] for c in first] == [0, 0] and [c[0][1] for c in second] == [1, 1]
    assert all(n == 3 and ignore and seed == prompt[1] for prompt, n, ignore, seed in first + second)


# ---------------------------------------------------------------- embedder and credit


def test_embedder_quick_serves_embed_and_correspond(tmp_path):
    doc = run_benchmark("embedder.py", tmp_path / "e.json", "--quick", "--repeats", "1", "--embed-batch", "8",
                        "--group-size", "2", "--turns", "3")
    rows = check_report(doc, "embedder")
    assert rows["/embed: thinking traces/s (8 a request)"]["value"] > 0
    assert rows["/correspond: groups/s (G=2 x 3 turns, M=6)"]["value"] > 0
    assert rows["/correspond: turns/s (G=2 x 3 turns)"]["value"] == pytest.approx(
        6 * rows["/correspond: groups/s (G=2 x 3 turns, M=6)"]["value"])


def test_embedder_payload_is_what_the_teacher_sends():
    from opsd.config import RunConfig
    from opsd.embedding_api import CorrespondRequest

    from benchmarks import embedder

    payload = embedder.correspond_payload(8, 50, seed=1, cfg=RunConfig())
    req = CorrespondRequest.model_validate(payload)
    assert len(req.turns) == 400
    words = [len(t.teacher_text.split()) for t in req.turns]
    assert 45 <= min(words) and np.mean(words) < 90  # ~60-word thinking traces


def test_credit_tiny_writes_its_rows(tmp_path):
    doc = run_benchmark("credit.py", tmp_path / "c.json", "--tasks", "1", "--rollouts", "4", "--turns", "4",
                        "--tokens", "16", "--repeats", "1", "--methods", "grpo", "alignopsd")
    rows = check_report(doc, "credit")
    assert list(rows) == ["grpo (1x4x4x16): median s", "grpo (1x4x4x16): peak MiB",
                          "alignopsd (1x4x4x16): median s", "alignopsd (1x4x4x16): peak MiB"]
    assert all(r["target"] is None for r in rows.values())  # targets are for the size only
    # Peak memory is what the call allocates: more than its [M, L] advantages (16 x 16 float32), far less than
    # a dense [M, M] per step would be at a real size.
    assert 16 * 16 * 4 / 2**20 < rows["alignopsd (1x4x4x16): peak MiB"]["value"] < 5


def test_inspect_quick_writes_its_rows(tmp_path):
    doc = run_benchmark("inspect_page.py", tmp_path / "i.json", "--quick")
    rows = check_report(doc, "inspect")
    assert list(rows) == [f"{name} 2x4x10x16" for name in ("open step (cold)", "group page (warm)", "trajectory page (warm)",
                                                            "compare (cold)", "dump size", "open peak RSS / dump size",
                                                            "held RSS / dump size", "parses of 8 parallel opens")]
    parses = rows.pop("parses of 8 parallel opens 2x4x10x16")
    assert parses["value"] == 1 and parses["ok"]  # 8 requests at once for the uncached step: one parse
    assert all(r["target"] is None for r in rows.values())  # the 2 s target is for 16x8x50 only
    assert 0.01 < rows["dump size 2x4x10x16"]["value"] < 5


def test_learning_configs_differ_only_in_the_method_and_the_plot_is_written(tmp_path):
    from benchmarks import learning
    from opsd.config import RunConfig

    base = yaml_config = yaml.safe_load((common.REPO / "configs" / "learning.yaml").read_text())
    cfgs = {m: learning.method_config(base, m, steps=3) for m in learning.METHODS}
    for m, cfg in cfgs.items():
        RunConfig.model_validate(cfg)  # each is a valid run config
        assert cfg["run"]["method"] == m and cfg["run"]["steps"] == 3
        rest = {k: v for k, v in cfg.items() if k != "run"}
        assert rest == {k: v for k, v in yaml_config.items() if k != "run"}  # same env, seeds, budget
    assert base["run"]["method"] == "grpo" and base["trainer"]["snapshot_every"] >= 1
    assert base["env"]["privileged"] == "remaining"
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "success_rate": 0.5}\n{"step": 0, "success_rate": 0.25, '
                                            '"privileged_signal": null}\nnot json\n')
    assert [r["success_rate"] for r in learning.training_records(tmp_path)] == [0.25]  # a redone step: its last
    result = {"untrained": {"success": 0.1, "lo": 0.05, "hi": 0.2},
              "curves": {"grpo": [{"step": 4, "success": 0.3, "lo": 0.2, "hi": 0.4}], "alignopsd": []}}
    out = learning.plot(result, tmp_path / "learning.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
