"""`opsd inspect`: the API returns the dump's own numbers for every registered method, needs the token,
serves nothing outside RUN_DIR and answers bad input with a 4xx, never a 500."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from opsd.credit import compute_advantages, registered
from opsd.credit.replay import batch_from_inputs
from opsd.config import CreditSection
from opsd.inspect.app import COOKIE, create_app
from tests.inspect_run import served, write_run

TOKEN = "t" * 12 + "-inspect-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="session")
def run_dir(inspect_run_dir) -> Path:
    return inspect_run_dir  # tests/conftest.py: shared with the browser tests, written once


@pytest.fixture(scope="session")
def client(run_dir) -> TestClient:
    # raise_server_exceptions=False: a server error must show up as a 500 status, which the tests refuse.
    return TestClient(create_app(run_dir, TOKEN), raise_server_exceptions=False)


def dump(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "credit" / f"step_{step:05d}.json").read_text())


def rows_of(case: dict) -> tuple[list[str], list[str], list[float]]:
    inp = case["inputs"]
    if "turns" in inp:
        return [t["task_id"] for t in inp["turns"]], [t["rollout_id"] for t in inp["turns"]], [t["episode_reward"] for t in inp["turns"]]
    return inp["uid"], inp["traj_uid"], inp["episode_rewards"]


@pytest.mark.parametrize("step,method", list(enumerate(registered())))
def test_every_method_shows_the_dumps_numbers(client, run_dir, step, method):
    case = dump(run_dir, step)
    assert case["method"] == method
    tasks, rollouts, rewards = rows_of(case)
    adv = np.asarray(case["expected"]["advantages"])
    inp = case["inputs"]
    mask = np.asarray(inp.get("response_mask") or inp.get("policy_loss_mask"))
    student = np.asarray(inp["student_log_probs"])
    teacher = inp.get("teacher_log_probs") or inp.get("diagonal_teacher_log_probs")

    s = client.get("/api/step", params={"step": step}, headers=AUTH)
    assert s.status_code == 200, s.text
    s = s.json()
    assert s["method"] == method and s["rows"] == len(tasks) and s["has_display"]
    assert [g["group"] for g in s["groups"]] == sorted(set(tasks))
    for g in s["groups"]:
        want = [rewards[rollouts.index(r)] for r in sorted({r for t, r in zip(tasks, rollouts) if t == g["group"]})]
        assert g["rewards"] == pytest.approx(want)

    group = s["groups"][0]["group"]
    gv = client.get("/api/group", params={"step": step, "group": group}, headers=AUTH).json()
    assert gv["extras_error"] is None
    (start,) = [m for m in range(len(tasks)) if (tasks[m], rollouts[m]) == (group, gv["trajectories"][0]["rollout"])
                and "opening" in case["display"][m]]  # the first rollout's turn 0
    assert gv["opening"] == case["display"][start]["opening"] and "Kitchen" in gv["opening"]
    assert gv["objective"] == case["display"][start]["objective"] == f"Take the coin of game {int(group[1:3])}."  # g00-...
    for traj in gv["trajectories"]:
        for t in traj["turns"]:
            m = t["row"]
            assert (tasks[m], rollouts[m]) == (group, traj["rollout"])
            on = mask[m] > 0
            assert t["tokens"] == int(on.sum())
            assert t["adv_sum"] == pytest.approx(float(adv[m][on].sum()), rel=1e-5, abs=1e-5)
            assert t["action"] == case["display"][m]["action"] and t["observation"] == case["display"][m]["observation"]
            if teacher is None:
                assert t["gap"] is None
            else:
                assert t["gap"] == pytest.approx(float((np.asarray(teacher[m]) - student[m])[on].mean()), rel=1e-5, abs=1e-6)
            if method == "alignopsd":
                assert t["sources"] is not None and t["span"] is not None and t["rectified_gap"] is not None
            if method == "agentopsd":
                assert 0 < t["belief_after"] < 1 and 0 < t["belief_before"] < 1
            if method == "gc_opd":
                assert t["residual"] is not None

    rollout = gv["trajectories"][0]["rollout"]
    tv = client.get("/api/trajectory", params={"step": step, "group": group, "rollout": rollout}, headers=AUTH).json()
    assert tv["decoded"]
    rows = [m for m in range(len(tasks)) if (tasks[m], rollouts[m]) == (group, rollout)]
    for m, turn in zip(rows, tv["turns"]):
        ids = case["display"][m]["token_ids"]
        assert [k["id"] for k in turn["tokens"]] == ids
        assert [k["text"] for k in turn["tokens"]] == [f"w{i}" for i in ids]  # the run's tokenizer decoded them
        assert [k["adv"] for k in turn["tokens"]] == pytest.approx(adv[m][: len(ids)].tolist(), rel=1e-6, abs=1e-7)
        assert [k["on"] for k in turn["tokens"]] == [bool(x) for x in mask[m][: len(ids)]]


def test_run_page_lists_steps_and_metrics(client, run_dir):
    r = client.get("/api/run", headers=AUTH).json()
    assert [s["step"] for s in r["steps"]] == list(range(len(registered())))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert r["metrics"]["loss"] == [[float(x["step"]), x["loss"]] for x in lines]
    assert len(r["metrics"]["privileged_signal"]) == len(lines) - 1  # the null is left out
    assert "teacher" not in r["metrics"]  # not a number


def test_the_run_page_plots_first_metrics_the_trainer_writes():
    """app.js's PREFERRED (plotted first on the run page) names metrics.jsonl keys the trainer writes: the keys
    of its own metrics.png panels (services/trainer/report.py PLOTTED)."""
    import re

    from services.trainer.report import PLOTTED

    app_js = (Path(__file__).resolve().parent.parent / "opsd/inspect/static/app.js").read_text()
    preferred = json.loads(re.search(r"^const PREFERRED = (\[.*?\]);", app_js, flags=re.M).group(1))
    written = {key for keys, *_ in PLOTTED for key in keys}
    assert preferred and set(preferred) <= written, set(preferred) - written
    assert {"teacher_student_gap", "mean_span_length"} <= set(preferred)


def test_compare_runs_the_credit_check_replay(client, run_dir):
    step = registered().index("grpo_opd")
    case = dump(run_dir, step)
    group = sorted(set(case["inputs"]["uid"]))[0]
    same = client.get("/api/compare", params={"step": step, "group": group, "method": "grpo_opd"}, headers=AUTH).json()
    assert same["max_abs_diff"] < 1e-5  # the replay of its own dump: what `opsd credit check` passes
    over = {"opd_coef": 0.5}
    other = client.get("/api/compare", params={"step": step, "group": group, "method": "agentopsd",
                                               "overrides": json.dumps(over)}, headers=AUTH)
    assert other.status_code == 200, other.text
    other = other.json()
    cfg = CreditSection.model_validate({**case["config"]["opsd_credit"], **over})
    want, _ = compute_advantages("agentopsd", batch_from_inputs(case["inputs"]), cfg)
    mask = np.asarray(case["inputs"]["response_mask"])
    for traj in other["trajectories"]:
        for t, m in zip(traj["turns"], [m for m, (u, r) in enumerate(zip(case["inputs"]["uid"], case["inputs"]["traj_uid"]))
                                        if (u, r) == (group, traj["rollout"])]):
            on = mask[m] > 0
            assert t["replayed"] == pytest.approx(float(want[m][on].mean()), rel=1e-5, abs=1e-6)
            assert t["dumped"] == pytest.approx(float(np.asarray(case["expected"]["advantages"][m])[on].mean()), rel=1e-5, abs=1e-6)
    # An AlignOPSD dump compares with a token method (its rows converted), not the other way round.
    a = registered().index("alignopsd")
    ga = dump(run_dir, a)["inputs"]["turns"][0]["task_id"]
    assert client.get("/api/compare", params={"step": a, "group": ga, "method": "opd"}, headers=AUTH).status_code == 200
    r = client.get("/api/compare", params={"step": step, "group": group, "method": "alignopsd"}, headers=AUTH)
    assert r.status_code == 422 and "alignopsd dump" in r.json()["detail"]


# ------------------------------------------------------------------------------------------ auth


def test_token_required_and_moved_to_a_cookie(run_dir):
    c = TestClient(create_app(run_dir, TOKEN), raise_server_exceptions=False)
    assert c.get("/api/run").status_code == 401
    assert c.get("/").status_code == 401 and "token" in c.get("/").text
    assert c.get("/static/app.js").status_code == 401
    assert c.get("/api/run", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code == 401
    assert c.get("/api/run", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert c.get("/?token=wrong").status_code == 401
    assert c.get(f"/?token={TOKEN}&token={TOKEN}").status_code == 401
    r = c.get(f"/?token={TOKEN}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert "httponly" in r.headers["set-cookie"].lower() and "samesite=strict" in r.headers["set-cookie"].lower()
    assert c.cookies.get(COOKIE) == TOKEN
    assert c.get("/api/run").status_code == 200 and c.get("/").status_code == 200
    assert c.get("/static/app.js").status_code == 200
    c.cookies.set(COOKIE, "wrong")
    assert c.get("/api/run").status_code == 401


def test_the_token_redirect_never_leaves_the_server(run_dir):
    """After a right ?token=, the redirect is a path on this server: a path starting with // (or /\\, or
    %2F%2F once decoded) must not become a scheme-relative Location, which a browser reads as another host."""
    c = TestClient(create_app(run_dir, TOKEN), raise_server_exceptions=False)
    for path, expected in [("//evil.example/x", "/evil.example/x"), ("/%2F%2Fevil.example/x", "/evil.example/x"),
                           ("/\\evil.example", "/evil.example"), ("/%5C%5Cevil.example", "/evil.example"),
                           ("/%5C/evil.example", "/evil.example"), ("/api/run", "/api/run")]:
        r = c.get(f"http://testserver{path}?token={TOKEN}&step=3", follow_redirects=False)
        assert r.status_code == 303, (path, r.status_code)
        assert r.headers["location"] == f"{expected}?step=3", (path, r.headers["location"])


def test_the_api_refuses_requests_other_pages_make(run_dir):
    """Cookies are not isolated by port: a page on another 127.0.0.1 port gets the inspect cookie sent with its
    requests here (same-site). /api/ answers only the page's own fetches (Sec-Fetch-Site same-origin), typed
    URLs (none) and non-browser clients (no header), and an Origin only when it is this server's."""
    c = TestClient(create_app(run_dir, TOKEN), raise_server_exceptions=False)
    ok = [{}, {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {"Origin": "http://testserver"}]
    refused = [{"Sec-Fetch-Site": "same-site"}, {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "bogus"},
               {"Origin": "http://127.0.0.1:8888"}, {"Origin": "null"},
               {"Sec-Fetch-Site": "same-site", "Origin": "http://testserver"}]
    for extra in ok:
        assert c.get("/api/run", headers={**AUTH, **extra}).status_code == 200, extra
    for extra in refused:
        for path in ("/api/run", "/api/compare?step=0&group=g&method=opd"):
            r = c.get(path, headers={**AUTH, **extra})
            assert r.status_code == 403 and "refused" in r.json()["detail"], (path, extra, r.status_code)
    # The page itself (no run data) still opens from a link on another local page.
    assert c.get("/", headers={**AUTH, "Sec-Fetch-Site": "same-site"}).status_code == 200


# ------------------------------------------------------------------------------ nothing outside RUN_DIR


def test_nothing_outside_the_run_dir_is_served(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    secret = tmp_path / "secret.json"
    shutil.copy(run / "credit" / "step_00000.json", secret)  # a valid dump, so only the path check can refuse it
    (run / "credit" / "step_00099.json").symlink_to(secret)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "outside-metrics.jsonl")
    (tmp_path / "outside-metrics.jsonl").write_text('{"step": 0, "leaked": 1}\n')
    c = TestClient(create_app(run, TOKEN), raise_server_exceptions=False)
    for path in ("/static/../../../../etc/passwd", "/static/..%2f..%2f..%2fetc%2fpasswd", "/static/%2e%2e/%2e%2e/etc/passwd",
                 "/static/%2e%2e%2fdata.py", "//etc/passwd", "/static//etc/passwd", "/static/index.html",
                 "/api/step?step=../../etc/passwd", "/api/step?step=%2e%2e", "/api/step?step=/etc/passwd",
                 "/api/step?step=-1", "/api/step?step=99", "/api/step?step=1e3"):
        r = c.get(path, headers=AUTH)
        assert 400 <= r.status_code < 500, (path, r.status_code)
        assert "root:" not in r.text and "inputs" not in r.text
    assert c.get("/api/step?step=99", headers=AUTH).status_code in (403, 404)
    run_info = c.get("/api/run", headers=AUTH).json()
    assert 99 not in [s["step"] for s in run_info["steps"]] and "leaked" not in run_info["metrics"]
    # A credit/ folder that is itself a link out of the run: no step is read through it.
    shutil.rmtree(run / "credit")
    (run / "credit").symlink_to(secret.parent)
    shutil.copy(secret, tmp_path / "step_00000.json")
    assert c.get("/api/step?step=0", headers=AUTH).status_code == 403
    assert c.get("/api/run", headers=AUTH).json()["steps"] == []


def test_a_symlink_loop_in_the_run_dir_is_a_404_never_a_500(tmp_path):
    """A dump, metrics.jsonl or credit/ that links to itself (Python 3.11's resolve() raises RuntimeError on it):
    the step is a 404 naming the loop, the run page lists the other steps, and a run dir whose metrics.jsonl loops
    still answers."""
    run = tmp_path / "run"
    write_run(run)
    (run / "credit" / "step_00090.json").symlink_to(run / "credit" / "step_00090.json")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(run / "metrics.jsonl")
    c = TestClient(create_app(run, TOKEN), raise_server_exceptions=False)
    r = c.get("/api/step", params={"step": 90}, headers=AUTH)
    assert r.status_code == 404 and "symlink loop" in r.json()["detail"], (r.status_code, r.text[:200])
    info = c.get("/api/run", headers=AUTH)
    assert info.status_code == 200, info.text[:200]
    assert [s["step"] for s in info.json()["steps"]] == list(range(len(registered()))) and info.json()["metrics"] == {}
    shutil.rmtree(run / "credit")
    (run / "credit").symlink_to(run / "credit")
    assert c.get("/api/run", headers=AUTH).json()["steps"] == []
    assert c.get("/api/step", params={"step": 0}, headers=AUTH).status_code == 404


# ------------------------------------------------------------------------------------------ bad input


def test_bad_dumps_and_requests_get_a_clear_4xx(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    credit = run / "credit"
    good = json.loads((credit / "step_00006.json").read_text())
    text = (credit / "step_00006.json").read_text()
    bad = {
        50: text[: len(text) // 2],  # a run still writing (or a torn copy)
        51: "",
        52: "[1, 2]",
        53: json.dumps({k: v for k, v in good.items() if k != "expected"}),
        54: json.dumps({**good, "inputs": {k: v for k, v in good["inputs"].items() if k != "uid"}}),
        55: json.dumps({**good, "expected": {"advantages": good["expected"]["advantages"][:-1]}}),
        56: json.dumps({**good, "inputs": {**good["inputs"], "student_log_probs": "oops"}}),
        57: text.replace(str(good["inputs"]["student_log_probs"][0][0]), "NaN", 1),
        58: json.dumps({**good, "inputs": {**good["inputs"], "uid": []}}),
        59: json.dumps({**good, "inputs": {**good["inputs"], "turn_step": [{"a": 1}] * len(good["inputs"]["uid"])}}),
        60: "[" * 100_000,
    }
    for step, body in bad.items():
        (credit / f"step_{step:05d}.json").write_text(body)
    (credit / "step_00061.json").mkdir()
    (credit / "step_00062.json.tmp").write_text("{")
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n[1]\n{\"step\": 99, \"loss\": 0.")  # garbage lines and a half-written last line
    c = TestClient(create_app(run, TOKEN), raise_server_exceptions=False)
    for step in bad:
        r = c.get("/api/step", params={"step": step}, headers=AUTH)
        assert r.status_code == 422, (step, r.status_code, r.text)
        assert r.json()["detail"]
    assert "not complete JSON" in c.get("/api/step", params={"step": 50}, headers=AUTH).json()["detail"]
    assert c.get("/api/step", params={"step": 61}, headers=AUTH).status_code == 404
    assert c.get("/api/step", params={"step": 62}, headers=AUTH).status_code == 404
    assert "no credit dump" in c.get("/api/step", params={"step": 1234}, headers=AUTH).json()["detail"]
    run_info = c.get("/api/run", headers=AUTH).json()
    assert run_info["bad_metric_lines"] == 2 and max(p[0] for p in run_info["metrics"]["loss"]) < 99
    g = good["inputs"]["uid"][0]
    for path, params in [
        ("/api/group", {"step": 6, "group": "no-such-group"}),
        ("/api/trajectory", {"step": 6, "group": g, "rollout": "nope"}),
        ("/api/group", {"step": 6, "group": g, "offset": -1}),
        ("/api/group", {"step": 6, "group": g, "limit": 0}),
        ("/api/step", {"step": 6, "limit": 10**9}),
        ("/api/group", {"step": 6}),
        ("/api/compare", {"step": 6, "group": g, "method": "nope"}),
        ("/api/compare", {"step": 6, "group": g, "method": "opd", "overrides": "{not json"}),
        ("/api/compare", {"step": 6, "group": g, "method": "opd", "overrides": "[1]"}),
        ("/api/compare", {"step": 6, "group": g, "method": "opd", "overrides": '{"opd_coef": "lots"}'}),
        ("/api/compare", {"step": 6, "group": g, "method": "opd", "overrides": '{"no_such_key": 1}'}),
        ("/api/compare", {"step": 6, "group": g, "method": "opd", "overrides": "[" * 10_000}),
    ]:
        r = c.get(path, params=params, headers=AUTH)
        assert 400 <= r.status_code < 500 and r.json()["detail"], (path, params, r.status_code, r.text)
    assert c.get("/api/nothing", headers=AUTH).status_code == 404
    # Hostile texts and ids: shown as text / positions, never a 500.
    odd = json.loads(text)
    odd["display"][0]["token_ids"] = ["x", 10**30]
    odd["display"][1]["token_ids"] = [10**12, -5]
    odd["display"][2]["observation"] = {"not": "text"}
    (credit / "step_00071.json").write_text(json.dumps(odd))
    r0 = odd["inputs"]["traj_uid"][0]
    for path, params in [("/api/group", {"step": 71, "group": g}), ("/api/trajectory", {"step": 71, "group": g, "rollout": r0})]:
        r = c.get(path, params=params, headers=AUTH)
        assert r.status_code == 200, (path, r.text)
    # NaN is not JSON (orjson refuses it); the standard library's json reads it, and parse_step refuses it.
    from opsd.inspect.data import InspectError, parse_step

    nan = json.loads(text)
    nan["inputs"]["episode_rewards"][0] = float("nan")
    (credit / "step_00072.json").write_text(json.dumps(nan))
    assert c.get("/api/step", params={"step": 72}, headers=AUTH).status_code == 422
    with pytest.raises(InspectError, match="NaN") as err:
        parse_step(nan, 72)
    assert err.value.status == 422
    # A dump from before the display section: no texts, positions instead of token ids, still every number.
    old = {k: v for k, v in good.items() if k != "display"}
    (credit / "step_00070.json").write_text(json.dumps(old))
    gv = c.get("/api/group", params={"step": 70, "group": g}, headers=AUTH).json()
    assert gv["trajectories"][0]["turns"][0]["action"] is None and gv["opening"] is None and gv["objective"] is None
    tv = c.get("/api/trajectory", params={"step": 70, "group": g, "rollout": gv["trajectories"][0]["rollout"]}, headers=AUTH).json()
    assert not tv["decoded"] and tv["turns"][0]["tokens"][0]["text"] == "[0]" and tv["turns"][0]["tokens"][0]["id"] is None


def test_a_config_nested_too_deep_to_write_is_a_422_on_every_page(run_dir, tmp_path):
    """A dump whose credit config nests 500 levels (JSON reads it; pydantic will not write it back): the step
    page answers a 422 naming it, and no other page answers a 500."""
    run = tmp_path / "run"
    (run / "credit").mkdir(parents=True)
    case = dump(run_dir, 6)
    deep: dict = {}
    node = deep
    for _ in range(500):
        node["a"] = {}
        node = node["a"]
    case["config"]["opsd_credit"]["deep"] = deep
    (run / "credit" / "step_00000.json").write_text(json.dumps(case))
    c = TestClient(create_app(run, TOKEN), raise_server_exceptions=False)
    g, r0 = case["inputs"]["uid"][0], case["inputs"]["traj_uid"][0]
    r = c.get("/api/step", params={"step": 0}, headers=AUTH)
    assert r.status_code == 422 and "cannot be written as JSON" in r.json()["detail"], (r.status_code, r.text[:300])
    for path, params in [("/api/group", {"step": 0, "group": g}), ("/api/trajectory", {"step": 0, "group": g, "rollout": r0}),
                         ("/api/compare", {"step": 0, "group": g, "method": "opd"}), ("/api/run", {})]:
        r = c.get(path, params=params, headers=AUTH)
        assert r.status_code < 500 and r.json(), (path, r.status_code)


def test_parallel_requests_for_an_uncached_step_parse_it_once(run_dir, tmp_path, monkeypatch):
    """8 requests at once for a step not yet cached: one parse, and all 8 get that same parsed step."""
    from opsd.inspect import data

    (tmp_path / "run" / "credit").mkdir(parents=True)
    shutil.copy(run_dir / "credit" / "step_00000.json", tmp_path / "run" / "credit" / "step_00000.json")
    parses: list[int] = []
    others = threading.Event()
    real = data._loads

    def counting(raw: bytes):
        parses.append(1)
        if len(parses) == 1:
            others.wait(timeout=1.0)  # room for the other requests to start a parse of their own (none should)
        else:
            others.set()
        return real(raw)

    monkeypatch.setattr(data, "_loads", counting)
    start = threading.Barrier(8)
    got: list = []

    def request() -> None:
        start.wait()
        got.append(data.load_step(tmp_path / "run", 0))

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(parses) == 1, f"{len(parses)} parses of one step"
    assert len(got) == 8 and all(s is got[0] for s in got)


def test_a_dump_over_256_mib_is_refused_unread(tmp_path):
    """Parsing a dump takes ~9x its size in memory (BENCHMARKS.md section 8): one over 256 MiB (~2.3 GiB to parse;
    the cap was 1 GiB, ~9 GiB) is a 413 before it is read."""
    (tmp_path / "run" / "credit").mkdir(parents=True)
    with open(tmp_path / "run" / "credit" / "step_00000.json", "wb") as f:
        f.truncate((256 << 20) + 1)  # sparse: no disk used
    r = TestClient(create_app(tmp_path / "run", TOKEN), raise_server_exceptions=False).get("/api/step?step=0", headers=AUTH)
    assert r.status_code == 413 and "memory" in r.json()["detail"], (r.status_code, r.text[:200])
    assert "--max-dump-mib 257 " in r.json()["detail"]  # the size that would open it
    # Raised where the memory allows (opsd inspect --max-dump-mib): read, and refused only as not JSON.
    r = TestClient(create_app(tmp_path / "run", TOKEN, max_dump_bytes=257 << 20),
                   raise_server_exceptions=False).get("/api/step?step=0", headers=AUTH)
    assert r.status_code == 422 and "not complete JSON" in r.json()["detail"], (r.status_code, r.text[:200])


def test_metrics_lines_json_reads_but_a_response_cannot_hold_are_left_out(tmp_path):
    """metrics.jsonl lines that parse into what JSON cannot send back (an int past float range, a lone surrogate
    in a key, nesting past the parser's depth) and a run folder whose name is not UTF-8: the run page still
    answers 200 with the readable records, never a 500."""
    write_run(tmp_path / "run")
    run = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff"))
    (tmp_path / "run").rename(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 1' + "0" * 400 + ', "loss": 1.0}\n')  # a step past float range
        f.write('{"step": 7, "loss": 1' + "0" * 400 + ', "reward_mean": 0.5}\n')  # a value past it
        f.write('{"step": NaN, "loss": 2.0}\n')
        f.write('{"step": 8, "\\ud800odd": 1.0}\n')  # a lone surrogate in a key
        f.write('{"step": 9, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    r = TestClient(create_app(run, TOKEN), raise_server_exceptions=False).get("/api/run", headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"].startswith("run-\ufffd") and body["bad_metric_lines"] == 1
    assert [7.0, 0.5] in body["metrics"]["reward_mean"] and [7.0, 1e400] not in body["metrics"]["loss"]
    assert all(p[0] < 1e300 and p[1] != 2.0 for p in body["metrics"]["loss"])
    assert [v for k, v in body["metrics"].items() if k.endswith("\ufffdodd")] == [[[8.0, 1.0]]]


def test_pagination(client, run_dir):
    s = client.get("/api/step", params={"step": 0, "offset": 1, "limit": 1}, headers=AUTH).json()
    assert s["total_groups"] == 2 and [g["group"] for g in s["groups"]] == [sorted(set(dump(run_dir, 0)["inputs"]["uid"]))[1]]
    g = s["groups"][0]["group"]
    gv = client.get("/api/group", params={"step": 0, "group": g, "offset": 1, "limit": 1}, headers=AUTH).json()
    assert all(len(t["turns"]) == 1 and t["turns"][0]["turn"] == 1 and t["total_turns"] == 3 for t in gv["trajectories"])
    tv = client.get("/api/trajectory", params={"step": 0, "group": g, "rollout": gv["trajectories"][0]["rollout"],
                                               "offset": 2, "limit": 5}, headers=AUTH).json()
    assert [t["turn"] for t in tv["turns"]] == [2]


# ------------------------------------------------------------------------------------------ the command


def test_each_server_has_a_token_and_cookie_of_its_own_never_the_runs_api_token(run_dir):
    """`opsd inspect` twice with OPSD_API_TOKEN set: each prints a fresh token of its own (the API token opens
    nothing); one cookie jar (a browser's: cookies are shared by every port of 127.0.0.1) logs into both and
    keeps both sessions; a page on another port is refused."""
    with served(run_dir, {"OPSD_API_TOKEN": TOKEN}) as url_a, served(run_dir, {"OPSD_API_TOKEN": TOKEN}) as url_b:
        base_a, token_a = url_a.split("/?token=")
        base_b, token_b = url_b.split("/?token=")
        assert base_a.startswith("http://127.0.0.1:") and base_a != base_b
        assert TOKEN not in (token_a, token_b) and token_a != token_b and len(token_a) >= 32
        with httpx.Client(timeout=10, follow_redirects=True) as browser:
            assert browser.get(f"{base_a}/api/run").status_code == 401
            set_cookies = []
            for url, base in ((url_a, base_a), (url_b, base_b)):
                r = browser.get(url)
                assert r.status_code == 200 and str(r.url) == f"{base}/", r.url
                set_cookies.append(r.history[0].headers["set-cookie"].lower())
            assert browser.get(f"{base_a}/api/run").status_code == 200  # the second login kept the first
            assert browser.get(f"{base_b}/api/run").json()["steps"]
            for base, set_cookie in zip((base_a, base_b), set_cookies):
                assert set_cookie.startswith(f"opsd_inspect_{base.rsplit(':', 1)[1]}=")
                assert all(a in set_cookie for a in ("httponly", "samesite=strict", "path=/"))
            assert len(browser.cookies.jar) == 2  # both sent to both ports (as a browser does): the names keep them apart
            # A page on B's port fetching from A: the browser sends A's cookie along, and marks the request.
            for mark in ({"Sec-Fetch-Site": "same-site"}, {"Origin": base_b}):
                assert browser.get(f"{base_a}/api/compare", params={"step": 0, "group": "g", "method": "opd"},
                                   headers=mark).status_code == 403
        port_a = base_a.rsplit(":", 1)[1]
        for headers in ({"Cookie": f"opsd_inspect_{port_a}={TOKEN}"}, {"Cookie": f"{COOKIE}={TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}"}):
            assert httpx.get(f"{base_a}/api/run", headers=headers, timeout=10).status_code == 401, headers
        assert httpx.get(f"{base_a}/api/run", headers={"Authorization": f"Bearer {token_a}"}, timeout=10).status_code == 200
