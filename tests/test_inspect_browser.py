"""`opsd inspect` in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright's Python package):
each page of a dumped run shows the dump's numbers; run -> step -> group -> trajectory -> compare by clicks.

Two runs: one written by the pipeline itself (`quickstart_run_dir`: `opsd run` of the quickstart config on
the tiny model, tests/conftest.py), and one dump per credit method written from factory groups by the
trainer's dump code (`inspect_run_dir`), for each method's intermediates and the error pages.
Without chromium (OPSD_CHROMIUM: another path) or playwright the tests skip, and fail under
OPSD_REQUIRE_BROWSER=1 (.ci/run sets it).
One Chromium for the module, closed at its end; screenshots land in the test's tmp_path.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from opsd.config import CreditSection
from opsd.credit import compute_advantages, registered
from opsd.credit.replay import batch_from_inputs, check_file
from tests.inspect_run import served

CHROMIUM = os.environ.get("OPSD_CHROMIUM", "/usr/bin/chromium")  # Debian's package; another build by path


def _missing(reason: str) -> None:
    if os.environ.get("OPSD_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (OPSD_REQUIRE_BROWSER=1: install chromium with apt and playwright with pip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def run_dir(inspect_run_dir) -> Path:
    return inspect_run_dir  # tests/conftest.py: shared with tests/test_inspect.py, written once


@pytest.fixture(scope="module")
def url(run_dir):
    with served(run_dir) as u:
        yield u


@pytest.fixture(scope="module")
def real_url(browser, quickstart_run_dir):  # browser first: without one the test skips before the run
    with served(quickstart_run_dir) as u:
        yield u


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
        _missing(f"no {CHROMIUM}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@contextmanager
def opened(browser, url: str):
    """A fresh browser context on `url`'s run page; on a normal exit, no JavaScript error on any page."""
    # bypass_csp: Playwright evaluates its wait predicates as strings, which the page's CSP (no eval) refuses.
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    try:
        pg = ctx.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(url)  # ?token= -> cookie -> /
        ready(pg)
        yield pg
    finally:
        ctx.close()
    assert errors == [], errors


@pytest.fixture
def page(browser, url):
    with opened(browser, url) as pg:
        yield pg


@pytest.fixture
def real_page(browser, real_url):
    with opened(browser, real_url) as pg:
        yield pg


def ready(pg) -> None:
    """Wait until the page has drawn the route in its address (app.js sets body[data-ready] last)."""
    pg.wait_for_function("'ready' in document.body.dataset && document.body.dataset.ready === location.hash", timeout=20_000)


def click(pg, selector: str) -> None:
    pg.click(selector)
    ready(pg)


def dump(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "credit" / f"step_{step:05d}.json").read_text())


def rows_by_traj(case: dict) -> tuple[dict[tuple[str, str], list[int]], list[float]]:
    inp = case["inputs"]
    if "turns" in inp:
        keys = [(t["task_id"], t["rollout_id"]) for t in inp["turns"]]
        rewards = [t["episode_reward"] for t in inp["turns"]]
    else:
        keys, rewards = list(zip(inp["uid"], inp["traj_uid"])), inp["episode_rewards"]
    out: dict[tuple[str, str], list[int]] = {}
    for m, k in enumerate(keys):
        out.setdefault(tuple(k), []).append(m)
    return out, rewards


def mean_adv(case: dict, m: int, adv=None) -> float:
    inp = case["inputs"]
    mask = np.asarray((inp.get("response_mask") or inp.get("policy_loss_mask"))[m]) > 0
    a = np.asarray(case["expected"]["advantages"][m] if adv is None else adv[m])
    return float(a[mask].mean()) if mask.any() else 0.0


def token_batch(case: dict):
    """An AlignOPSD dump's rows as the row-per-turn batch a token method replays."""
    inp = case["inputs"]
    return batch_from_inputs({"uid": [t["task_id"] for t in inp["turns"]], "traj_uid": [t["rollout_id"] for t in inp["turns"]],
                              "turn_step": [t["turn_id"] for t in inp["turns"]], "episode_rewards": [t["episode_reward"] for t in inp["turns"]],
                              "is_action_valid": [t["is_action_valid"] for t in inp["turns"]], "response_mask": inp["policy_loss_mask"],
                              "student_log_probs": inp["student_log_probs"], "teacher_log_probs": inp["diagonal_teacher_log_probs"]})


def check_step_page(page, case: dict, trajs: dict, rewards: list[float]) -> list[str]:
    """The step page lists every group of the dump with its rollouts' rewards; returns the group ids, sorted."""
    assert case["method"] in page.locator("h1").inner_text()
    groups = sorted({k[0] for k in trajs})
    assert page.locator("#groups tr[data-group]").count() == len(groups)
    for g in groups:
        want = " ".join(f"{rewards[trajs[k][0]]:.2f}" for k in sorted(k for k in trajs if k[0] == g))
        assert page.locator(f"#groups tr[data-group='{g}'] td.rewards").inner_text() == want
    return groups


def token_arrays(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mask, student and teacher log-probs [M, L] as the page's server reads them (float32)."""
    inp = case["inputs"]
    mask, student = inp.get("response_mask") or inp["policy_loss_mask"], inp["student_log_probs"]
    return tuple(np.asarray(a, np.float32) for a in (mask, student, inp.get("teacher_log_probs") or inp["diagonal_teacher_log_probs"]))


def check_group_page(page, case: dict, trajs: dict, mine: list[tuple[str, str]]) -> None:
    """The group page: the opening text of its first rollout, then each turn's action, observation, mean advantage
    and teacher - student gap."""
    mask, student, teacher = token_arrays(case)
    start = case["display"][trajs[mine[0]][0]]
    assert page.locator("#opening pre").text_content() == start["opening"] != ""
    assert page.locator(".traj").count() == len(mine)
    for g, r in mine:
        col = page.locator(f".traj[data-rollout='{r}']")
        for m in trajs[(g, r)]:
            card = col.locator(f".turn[data-row='{m}']")
            assert card.locator(".adv").inner_text().startswith(f"{mean_adv(case, m):.4f} mean")
            on = mask[m] > 0
            assert card.locator(".gap").inner_text() == f"{float((teacher[m] - student[m])[on].mean()):.4f}"
            assert case["display"][m]["action"] in card.inner_text()
            if case["display"][m]["observation"]:
                assert card.locator(".obs").text_content() == case["display"][m]["observation"]
            if case["method"] == "alignopsd":
                assert card.locator(".sources").count() == 1 and card.locator(".rgap").count() == 1


def check_tokens(page, case: dict, m: int, texts: list[str]) -> None:
    """The trajectory page's first turn (row m): one token per id, with these texts, the dump's advantages and,
    on hover, its student log-probs."""
    _, student, _ = token_arrays(case)
    toks = page.locator(".tokens[data-turn='0'] .tok")
    ids = case["display"][m]["token_ids"]
    assert toks.count() == len(ids) == len(texts) > 0
    assert [toks.nth(j).text_content() for j in range(len(ids))] == texts
    advs = [float(toks.nth(j).get_attribute("data-adv")) for j in range(len(ids))]
    assert advs == pytest.approx(case["expected"]["advantages"][m][: len(ids)], rel=1e-6, abs=1e-7)
    titles = [toks.nth(j).get_attribute("title").split("\n") for j in range(len(ids))]
    assert [t[0] for t in titles] == [f"advantage {toks.nth(j).get_attribute('data-adv')}" for j in range(len(ids))]
    assert [t[1] for t in titles] == [f"student log-prob {float(x):.4f}" for x in student[m][: len(ids)]]


def check_compare(page, case: dict, trajs: dict, mine: list[tuple[str, str]], method: str, overrides: dict) -> np.ndarray:
    """From the group page: the compare page with `method` and `overrides` shows, per turn, the dumped mean advantage
    and the one `compute_advantages` gives for the dump's rows; returns those replayed advantages [M, L]."""
    click(page, "#compare-link")
    page.wait_for_selector("#compare-summary")
    page.select_option("#method", method)
    page.fill("#overrides", json.dumps(overrides))
    click(page, "#compare-form button")
    page.wait_for_selector("#compare-summary")
    assert f"{case['method']} (as trained) vs {method}" in page.locator("#compare-summary").inner_text()
    cfg = CreditSection.model_validate({**case["config"]["opsd_credit"], **overrides})
    other, _ = compute_advantages(method, token_batch(case), cfg)
    for g, r in mine:
        for j, m in enumerate(trajs[(g, r)]):
            row = page.locator(f"#compare-result .traj[data-rollout='{r}'] tr[data-turn='{j}']")
            assert row.locator("td.dumped").inner_text().split()[0] == f"{mean_adv(case, m):.4f}"
            assert row.locator("td.replayed").inner_text().split()[0] == f"{mean_adv(case, m, other):.4f}"
    return other


@pytest.mark.e2e
def test_a_real_runs_pages_show_its_dump(real_page, quickstart_run_dir, tmp_path):
    """The run the pipeline wrote (tests/conftest.py quickstart_run_dir): its AlignOPSD dump replays with
    `opsd credit check`'s code, and run -> step -> group -> trajectory -> compare show that dump's values.
    The tiny random model wins nothing, so every reward and AlignOPSD advantage is 0: the non-zero values
    checked are the run's loss, the gaps, the log-probs and the grpo_opd replay."""
    from tokenizers import Tokenizer

    page, run_dir = real_page, quickstart_run_dir
    path = run_dir / "credit" / "step_00000.json"
    result = check_file(path)
    assert result.ok, (result.error, [(f.name, f.detail) for f in result.fields if not f.ok])
    case = dump(run_dir, 0)
    assert case["method"] == "alignopsd"
    trajs, rewards = rows_by_traj(case)

    (metrics,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert page.locator("#steps a").count() == 1
    title = page.locator("svg[data-metric='loss'] circle title").text_content()
    assert title.startswith("step 0: ") and float(title.split(": ")[1]) == metrics["loss"]
    # One step: the x axis starts at step 0 and a flat rate's y axis never goes below 0.
    y1, y0, x0, _ = page.locator("svg[data-metric='success_rate'] text").all_text_contents()
    assert x0 == "step 0" and float(y0) == min(0.0, metrics["success_rate"]) and float(y1) > float(y0), (y1, y0, x0)
    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

    click(page, "#steps a[href='#/step/0']")
    groups = check_step_page(page, case, trajs, rewards)
    click(page, f"#groups tr[data-group='{groups[0]}'] a")
    mine = sorted(k for k in trajs if k[0] == groups[0])
    check_group_page(page, case, trajs, mine)
    page.screenshot(path=str(tmp_path / "group.png"), full_page=True)

    g, r = mine[0]
    click(page, f".traj[data-rollout='{r}'] h2 a")
    tok = Tokenizer.from_file(str(run_dir / "checkpoint" / "tokenizer.json"))
    m = trajs[(g, r)][0]
    check_tokens(page, case, m, [tok.decode([i], skip_special_tokens=False) or tok.id_to_token(i)
                                 for i in case["display"][m]["token_ids"]])
    page.go_back()
    ready(page)
    other = check_compare(page, case, trajs, mine, "grpo_opd", {"opd_coef": 0.5})
    assert np.abs(other).max() > 1e-4
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)


def test_click_through_run_step_group_trajectory_compare(page, run_dir, tmp_path):
    step = registered().index("alignopsd")
    case = dump(run_dir, step)
    trajs, rewards = rows_by_traj(case)

    # Run page: a plot per metric, a link per dumped step.
    assert page.locator("svg[data-metric='loss']").count() == 1
    assert page.locator("svg[data-metric='loss'] circle").count() == len(registered())
    assert page.locator("#steps a").count() == len(registered())
    # The trainer's headline metrics first (app.js PREFERRED), then the others by name.
    shown = [m.get_attribute("data-metric") for m in page.locator("#plots svg[data-metric]").all()]
    assert shown == ["success_rate", "reward_mean", "teacher_student_gap", "privileged_signal", "mean_span_length",
                     "loss", "advantage_abs_mean", "corrected_gap"], shown
    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

    click(page, f"#steps a[href='#/step/{step}']")
    groups = check_step_page(page, case, trajs, rewards)
    page.screenshot(path=str(tmp_path / "step.png"), full_page=True)

    click(page, f"#groups tr[data-group='{groups[0]}'] a")
    mine = sorted(k for k in trajs if k[0] == groups[0])
    check_group_page(page, case, trajs, mine)
    # The factory opening does not state the objective: the page shows it too.
    assert page.locator("#objective").inner_text() == f"objective {case['display'][trajs[mine[0]][0]]['objective']}"
    page.screenshot(path=str(tmp_path / "group.png"), full_page=True)

    g, r = mine[0]
    click(page, f".traj[data-rollout='{r}'] h2 a")
    m = trajs[(g, r)][0]
    check_tokens(page, case, m, [f"w{i}" for i in case["display"][m]["token_ids"]])
    page.screenshot(path=str(tmp_path / "trajectory.png"), full_page=True)

    page.go_back()
    ready(page)
    check_compare(page, case, trajs, mine, "grpo_opd", {"opd_coef": 0.5})
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
    assert all((tmp_path / f"{n}.png").stat().st_size > 5_000 for n in ("run", "step", "group", "trajectory", "compare"))


@pytest.mark.parametrize("method,selector", [("agentopsd", ".belief"), ("gc_opd", ".residual"), ("grpo", ".adv")])
def test_each_methods_intermediates_are_drawn(page, run_dir, method, selector):
    step = registered().index(method)
    group = sorted(set(dump(run_dir, step)["inputs"]["uid"]))[0]
    page.evaluate(f"location.hash = '#/step/{step}/group/{group}'")
    ready(page)
    assert page.locator(f".turn {selector}").count() == page.locator(".turn").count() > 0
    if method == "grpo":
        assert page.locator(".turn .gap").count() == 0  # no teacher, no gap


def test_errors_are_pages_not_crashes(page, browser, url):
    page.evaluate("location.hash = '#/step/999'")
    ready(page)
    assert "404" in page.locator("#error").inner_text() and "no credit dump" in page.locator("#error").inner_text()
    page.evaluate("location.hash = '#/step/0/group/nope'")
    ready(page)
    assert "no group" in page.locator("#error").inner_text()
    ctx = browser.new_context()
    try:
        anon = ctx.new_page()
        resp = anon.goto(url.split("?")[0])
        assert resp.status == 401 and "token" in anon.content()
    finally:
        ctx.close()


def test_a_page_on_another_local_port_cannot_use_the_inspect_cookie(page, url, run_dir, tmp_path):
    """Cookies are shared by every port of 127.0.0.1: with the inspect page logged in, a page served from another
    local port that fetches the API (no-cors: a blind request, e.g. a compare that makes the server replay a step)
    gets the cookie sent along (same-site, so SameSite=Strict does not stop it). The API refuses it; the inspect
    page itself still works. (An <img> of the API is sent the same way; Chromium's ORB hides its status.)"""
    base = url.split("/?", 1)[0]
    compare = f"{base}/api/compare?step=0&group={dump(run_dir, 0)['inputs']['uid'][0]}&method=opd"
    (tmp_path / "other.html").write_text(
        f'<!doctype html><script>fetch("{compare}", {{mode: "no-cors", credentials: "include"}})</script>')
    other = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with page.expect_response(compare) as fetched:
            page.goto(f"http://127.0.0.1:{other.server_port}/other.html")
        # Chromium sends the cookie and `Sec-Fetch-Site: same-site` with it (a recording server on the two ports
        # saw both; Playwright's copy of the headers leaves them out): 200 before the check, 401 without the cookie.
        assert fetched.value.status == 403
    finally:
        other.shutdown()
        other.server_close()
    page.goto(f"{base}/#/")  # the page's own fetches (same-origin) still pass
    ready(page)
    assert page.locator("#steps a").count() == len(registered())
