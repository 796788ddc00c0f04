"""`opsd inspect` in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright's Python package):
each page of a dumped run shows the dump's numbers; run -> step -> group -> trajectory -> compare by clicks.

Without chromium (OPSD_CHROMIUM: another path) or playwright the tests skip, and fail under
OPSD_REQUIRE_BROWSER=1 (.ci/run sets it).
One Chromium for the module, closed at its end; screenshots land in the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opsd.config import CreditSection
from opsd.credit import compute_advantages, registered
from opsd.credit.replay import batch_from_inputs

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("OPSD_CHROMIUM", "/usr/bin/chromium")  # Debian's package; another build by path
TOKEN = "browser-test-token-0123456789"


def _missing(reason: str) -> None:
    if os.environ.get("OPSD_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (OPSD_REQUIRE_BROWSER=1: install chromium with apt and playwright with pip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def run_dir(inspect_run_dir) -> Path:
    return inspect_run_dir  # tests/conftest.py: shared with tests/test_inspect.py, written once


@pytest.fixture(scope="module")
def url(run_dir):
    """`opsd inspect RUN_DIR --port 0` as a process; yields the URL it printed (token included)."""
    env = {**os.environ, "OPSD_API_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "opsd.cli", "inspect", str(run_dir), "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("opsd inspect: open http://127.0.0.1:"), line + proc.stderr.read()
        yield line.split("open ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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


@pytest.fixture
def page(browser, url):
    # bypass_csp: Playwright evaluates its wait predicates as strings, which the page's CSP (no eval) refuses.
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(url)  # ?token= -> cookie -> /
    ready(pg)
    yield pg
    ctx.close()
    assert errors == [], errors  # no JavaScript error on any page


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


def test_click_through_run_step_group_trajectory_compare(page, run_dir, tmp_path):
    step = registered().index("alignopsd")
    case = dump(run_dir, step)
    trajs, rewards = rows_by_traj(case)

    # Run page: a plot per metric, a link per dumped step.
    assert page.locator("svg[data-metric='loss']").count() == 1
    assert page.locator("svg[data-metric='loss'] circle").count() == len(registered())
    assert page.locator("#steps a").count() == len(registered())
    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

    click(page, f"#steps a[href='#/step/{step}']")
    assert "alignopsd" in page.locator("h1").inner_text()
    groups = sorted({k[0] for k in trajs})
    assert page.locator("#groups tr[data-group]").count() == len(groups)
    first = page.locator(f"#groups tr[data-group='{groups[0]}']")
    want = " ".join(f"{rewards[trajs[k][0]]:.2f}" for k in sorted(k for k in trajs if k[0] == groups[0]))
    assert first.locator("td.rewards").inner_text() == want
    page.screenshot(path=str(tmp_path / "step.png"), full_page=True)

    click(page, f"#groups tr[data-group='{groups[0]}'] a")
    cols = page.locator("#trajectories .traj")
    mine = sorted(k for k in trajs if k[0] == groups[0])
    assert cols.count() == len(mine)
    for g, r in mine:
        col = page.locator(f".traj[data-rollout='{r}']")
        for m in trajs[(g, r)]:
            card = col.locator(f".turn[data-row='{m}']")
            assert card.locator(".adv").inner_text().startswith(f"{mean_adv(case, m):.4f} mean")
            assert case["display"][m]["action"] in card.inner_text()
            assert card.locator(".sources").count() == 1 and card.locator(".rgap").count() == 1
    page.screenshot(path=str(tmp_path / "group.png"), full_page=True)

    g, r = mine[0]
    click(page, f".traj[data-rollout='{r}'] h2 a")
    toks = page.locator(".tokens[data-turn='0'] .tok")
    m = trajs[(g, r)][0]
    ids = case["display"][m]["token_ids"]
    assert toks.count() == len(ids)
    assert [toks.nth(j).inner_text() for j in range(len(ids))] == [f"w{i}" for i in ids]
    advs = [float(toks.nth(j).get_attribute("data-adv")) for j in range(len(ids))]
    assert advs == pytest.approx(case["expected"]["advantages"][m][: len(ids)], rel=1e-6, abs=1e-7)
    assert toks.nth(0).get_attribute("title").startswith("advantage ")  # the value on hover
    page.screenshot(path=str(tmp_path / "trajectory.png"), full_page=True)

    page.go_back()
    ready(page)
    click(page, "#compare-link")
    page.wait_for_selector("#compare-summary")
    page.select_option("#method", "grpo_opd")
    page.fill("#overrides", json.dumps({"opd_coef": 0.5}))
    click(page, "#compare-form button")
    page.wait_for_selector("#compare-summary")
    assert "alignopsd (as trained) vs grpo_opd" in page.locator("#compare-summary").inner_text()
    inp = case["inputs"]
    batch = batch_from_inputs({"uid": [t["task_id"] for t in inp["turns"]], "traj_uid": [t["rollout_id"] for t in inp["turns"]],
                               "turn_step": [t["turn_id"] for t in inp["turns"]], "episode_rewards": [t["episode_reward"] for t in inp["turns"]],
                               "is_action_valid": [t["is_action_valid"] for t in inp["turns"]], "response_mask": inp["policy_loss_mask"],
                               "student_log_probs": inp["student_log_probs"], "teacher_log_probs": inp["diagonal_teacher_log_probs"]})
    cfg = CreditSection.model_validate({**case["config"]["opsd_credit"], "opd_coef": 0.5})
    other, _ = compute_advantages("grpo_opd", batch, cfg)
    for k, (g, r) in enumerate(mine):
        for j, m in enumerate(trajs[(g, r)]):
            row = page.locator(f"#compare-result .traj[data-rollout='{r}'] tr[data-turn='{j}']")
            assert row.locator("td.dumped").inner_text().split()[0] == f"{mean_adv(case, m):.4f}"
            assert row.locator("td.replayed").inner_text().split()[0] == f"{mean_adv(case, m, other):.4f}"
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
