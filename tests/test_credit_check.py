"""`opsd credit check`: the replay tool on the handed refvectors, on broken files and on run dumps."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from opsd.cli import app
from opsd.config import RunConfig
from opsd.credit.replay import check_case, check_file
from opsd.types import CreditBatch
from services.trainer.batch import build_credit_batch
from services.trainer.dump import write_credit_dump
from opsd.credit import compute_advantages
from tests.factories import make_scored_group, shared_dir


REFVECTORS = shared_dir() / "refvectors"
runner = CliRunner()


def test_refvector_folder_is_present():
    # The replay tests below must never pass vacuously on a machine without the vectors.
    assert len(list(REFVECTORS.rglob("case_*.json"))) == 20, f"expected the 20 handed vector files under {REFVECTORS}"


def test_cli_replays_every_handed_refvector():
    res = runner.invoke(app, ["credit", "check", str(REFVECTORS)])
    assert res.output.strip().splitlines()[-1] == "20 passed, 0 failed", res.output
    assert res.exit_code == 0
    assert "max|err|" in res.output
    # Files in natural order (case_3 before case_11), counts with their plural.
    shown = [line.split()[1] for line in res.output.splitlines() if "/alignopsd/case_" in line]
    assert [Path(p).stem for p in shown] == ["case_1", "case_3", "case_5", "case_7", "case_9", "case_11"]
    assert " 1 fields" not in res.output


def _load(rel: str) -> dict:
    return json.loads((REFVECTORS / rel).read_text())


def test_a_changed_expected_value_fails_and_names_the_field(tmp_path):
    case = _load("gc_opd/case_1.json")
    case["expected"]["gc_opd_residual"][3] += 1e-3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(case))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_load("gc_opd/case_1.json")))
    res = runner.invoke(app, ["credit", "check", str(tmp_path)])
    assert res.exit_code == 1
    assert "gc_opd_residual[3]" in res.output and res.output.strip().endswith("1 passed, 1 failed")


def test_a_field_the_replay_cannot_compute_is_a_failure():
    case = _load("agentopsd/case_1.json")
    case["expected"]["belief_entropy"] = [0.0]
    r = check_case(case)
    assert not r.ok and [f.detail for f in r.fields if f.name == "belief_entropy"] == ["not computed"]


def test_unknown_method_and_missing_path():
    case = _load("gc_opd/case_3.json")
    case["method"] = "no_such_method"
    r = check_case(case)
    assert not r.ok and "no replay" in r.error
    res = runner.invoke(app, ["credit", "check", "/nonexistent/vectors"])
    assert res.exit_code == 2


def test_a_missing_path_says_in_one_line_where_the_vectors_are(tmp_path):
    """A fresh clone has no ../shared: the error names the path and where the reference vectors come from."""
    res = runner.invoke(app, ["credit", "check", str(tmp_path / "shared" / "refvectors")])
    assert res.exit_code == 2
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: no such file or folder: {tmp_path / 'shared' / 'refvectors'} (")
    assert "refvectors/ in the project's shared folder: ../shared beside the repository, or $OPSD_SHARED" in line
    assert "RUN_DIR/credit/, written by opsd run --dump-credit" in line


def test_what_a_file_says_is_printed_as_one_safe_bounded_line(tmp_path):
    """A file's own texts (method, case, the replay's error, a mismatch's values, its name) reach the terminal
    without control characters (ESC: a cleared screen, a retitled window), without lone surrogates (stdout
    cannot encode them: a traceback instead of the report) and cut to a bounded line."""
    evil = _load("gc_opd/case_1.json")
    evil["method"] = "\x1b[2J\x1b]0;owned\x07" + "m" * 5000
    evil["case"] = "\ud800\n[red]x"
    (tmp_path / "a.json").write_text(json.dumps(evil))
    wrong = _load("gc_opd/case_1.json")
    wrong["expected"]["gc_opd_residual"] = "r" * 100_000  # a string where a list is: the mismatch quotes both
    (tmp_path / "b\x1b[31m.json").write_text(json.dumps(wrong))
    res = runner.invoke(app, ["credit", "check", str(tmp_path)])
    assert res.exit_code == 1 and res.output.strip().endswith("0 passed, 2 failed"), res.output
    assert "\x1b" not in res.output and "\\x1b[2J" in res.output and "\\ud800\\n[red]x" in res.output
    res.output.encode("utf-8")  # strict: no surrogate reached the terminal
    assert max(map(len, res.output.splitlines())) < 1000


def test_expected_error_case_passes_only_when_the_replay_raises(tmp_path):
    case = _load("alignopsd/case_5.json")
    # A turn without policy tokens: the reference raises ValueError (README, AlignOPSD case 8).
    case["inputs"]["policy_loss_mask"][0] = [0.0] * len(case["inputs"]["policy_loss_mask"][0])
    case["expected"] = {"error": "ValueError", "message": "turn without policy tokens"}
    assert check_case(case).ok
    ok_case = _load("alignopsd/case_5.json")
    ok_case["expected"] = {"error": "ValueError", "message": "x"}
    assert not check_case(ok_case).ok


def test_tolerance_is_relative_to_magnitude():
    case = _load("gc_opd_baselines/case_3.json")
    exp = case["expected"]["poweropd_advantages"]
    exp[1][1] += 5e-6  # |expected| < 1: within 1e-5
    assert check_case(copy.deepcopy(case)).ok
    exp[1][1] += 2e-5
    assert not check_case(case).ok


def _dump_for(method: str, tmp_path: Path) -> tuple[Path, CreditBatch, np.ndarray]:
    """A two-group step's dump through the trainer's writer, with the batch and advantages it holds."""
    from dataclasses import replace

    scored = []
    for g in range(2):
        sg = make_scored_group(G=3, turns=3, seed=g)
        rng = np.random.default_rng(g)
        trajs = [replace(t, sampler_entropy_S=np.where(t.loss_mask_S == 1, rng.uniform(0, 2, t.loss_mask_S.shape), 0).astype(np.float32))
                 for t in sg.rollout.trajectories]
        ent = [np.where(t.loss_mask_S == 1, rng.uniform(0, 2, t.loss_mask_S.shape), 0).astype(np.float32) for t in trajs]
        scored.append(replace(sg, rollout=replace(sg.rollout, trajectories=trajs), teacher_entropy_S=ent))
    groups = [s.rollout for s in scored]
    cfg = RunConfig.model_validate({"run": {"method": method}})
    batch, _ = build_credit_batch(groups, None if method == "grpo" else scored)
    adv, _ = compute_advantages(method, batch, cfg.credit)
    return write_credit_dump(tmp_path / f"{method}.json", cfg, batch, adv, groups, scored), batch, adv


def _significant_digits(x: float) -> int:
    mantissa = repr(abs(x)).split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa.rstrip("0")) or 1


@pytest.mark.parametrize("method", ["grpo", "opd", "grpo_opd", "agentopsd", "gc_opd", "uni_opd", "power_opd", "ex_opd", "fire_opd"])
def test_a_run_dump_replays_exactly_and_detects_a_change(method, tmp_path):
    path, batch, adv = _dump_for(method, tmp_path)
    r = check_file(path)
    assert r.ok, (r.error, [(f.name, f.detail) for f in r.fields if not f.ok])
    case = json.loads(path.read_text())
    assert case["method"] == method and case["config"]["opsd_credit"]["grpo_scope"] == "turn"
    # Per-token arrays at float32 precision: the trainer's values bit for bit, in at most 9 significant
    # digits each (float64 text of the same values takes up to 17).
    for name, want in (("student_log_probs", batch.student_logprobs_ML), ("response_mask", batch.loss_mask_ML),
                       ("student_entropys", batch.student_entropy_ML)):
        np.testing.assert_array_equal(np.asarray(case["inputs"][name], np.float32), want)
    np.testing.assert_array_equal(np.asarray(case["expected"]["advantages"], np.float32), adv.astype(np.float32))
    values = [x for a in (case["inputs"]["student_log_probs"], case["expected"]["advantages"]) for row in a for x in row]
    assert max(map(_significant_digits, values)) <= 9 < max(_significant_digits(float(x)) for x in
                                                            np.asarray(values, np.float32).astype(np.float64))
    # Change one trained token's student log-prob: the replayed advantages must move
    # for every method (each reads the student log-prob or, for grpo, the reward).
    if method == "grpo":
        case["inputs"]["episode_rewards"] = [10.0 - r for r in case["inputs"]["episode_rewards"]]
    else:
        row = next(i for i, m in enumerate(case["inputs"]["response_mask"]) if m[0] == 1)
        assert case["inputs"]["student_log_probs"][row][0] < -1e-3
        case["inputs"]["student_log_probs"][row][0] = 0.0  # (PowerOPD is flat below ~ -0.05: use certainty)
    assert not check_case(case).ok


# ------------------------------------------------------------ hostile files (each is one FAIL line; the run goes on)


def _write(tmp_path: Path, name: str, data) -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_hostile_files_fail_one_by_one_and_the_good_one_still_passes(tmp_path):
    good = _load("gc_opd/case_3.json")
    bad_v0 = _load("agentopsd/case_1.json")
    bad_v0["expected"]["v0_per_row"] = 0.5
    bad_variants = _load("agentopsd/case_1.json")
    bad_variants["expected_variants"] = ["x"]
    no_inputs = {k: v for k, v in good.items() if k != "inputs"}
    files = {
        "a_v0.json": bad_v0, "b_variants.json": bad_variants, "c_no_inputs.json": no_inputs,
        "d_deep.json": "[" * 100_000 + "]" * 100_000, "e_list.json": [1, 2], "f_broken.json": "{",
        "z_good.json": good,
    }
    for name, data in files.items():
        _write(tmp_path, name, data)
    os.symlink(tmp_path / "missing.json", tmp_path / "g_dangling.json")
    os.mkfifo(tmp_path / "h_fifo.json")  # reading it would block forever
    res = runner.invoke(app, ["credit", "check", str(tmp_path)])
    assert res.exit_code == 1
    assert res.output.strip().splitlines()[-1] == "1 passed, 8 failed", res.output
    assert "Traceback" not in res.output


def test_nan_never_matches_and_empty_expectations_never_pass():
    case = _load("gc_opd/case_3.json")
    case["config"]["gc_opd_residual_beta"] = 1e308  # replays to NaN advantages
    case["expected"] = {"gc_opd_advantages": [[float("nan")] * len(r) for r in case["inputs"]["response_mask"]]}
    assert not check_case(case).ok
    for expected in ({"metrics": {}}, {"gc_opd_residual": []}):
        case = _load("gc_opd/case_3.json")
        case["expected"] = expected
        assert not check_case(case).ok, expected
    case = _load("agentopsd/case_1.json")
    case["expected_variants"]["made_up_variant"] = {}
    r = check_case(case)
    assert not r.ok and any(f.name == "made_up_variant/" for f in r.fields if not f.ok)


def test_replays_run_the_trainers_input_checks():
    case = _load("gc_opd_baselines/case_3.json")
    case["inputs"]["response_mask"][0][0] = 7.0  # not a 0/1 mask
    r = check_case(case)
    assert not r.ok and "0/1" in r.error
    case = _load("agentopsd/case_1.json")
    case["inputs"]["student_log_probs"].append([-99.0] * 5)  # one row more than the mask
    assert not check_case(case).ok
    case = _load("agentopsd/case_1.json")
    case["config"]["belief_gate"] = "false"  # a string is not a JSON boolean
    assert "boolean" in check_case(case).error
