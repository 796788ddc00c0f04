"""WebShop adapter (opsd/envs/webshop.py) against a stand-in server (tests/webshop_standin.py).

The stand-in is not WebShop: it is a five-goal, eight-product imitation of
WebShop's Flask app (same routes, same HTML shapes, a WebShop-like reward),
started on a free port in a thread. The real server's setup: opsd/envs/WEBSHOP.md.
"""

from __future__ import annotations

import math
import queue
import socket
import threading
import time

import httpx

import pytest

from opsd.config import EnvSection, WebShopSection
from opsd.envs import EnvContext, Task, get_adapter
from opsd.envs import webshop as ws
from opsd.skills import privileged_text
from tests.webshop_standin import GOALS, StandinWebShop


@pytest.fixture(scope="module")
def shop():
    with StandinWebShop() as server:
        yield server


def _cfg(url: str, **kw) -> EnvSection:
    section = WebShopSection(url=url, goals=[2, 3, 4], eval_goals=[0, 1], timeout_s=kw.pop("timeout_s", 5.0))
    return EnvSection(name="webshop", game_pool=3, eval_pool=2, webshop=section, **kw)


def _env(shop: StandinWebShop, goal: int, **kw) -> ws.WebShopEnv:
    cfg = _cfg(shop.url, **kw)
    return get_adapter("webshop").open_env(Task(task_id=f"webshop-{goal}", category="x", spec={"goal": goal}), cfg, EnvContext())


def _play(env: ws.WebShopEnv, actions: list[str]):
    step = env.reset()
    for action in actions:
        step = env.step(action)
        assert not step.invalid_action, (action, step.admissible_commands)
    return step


def test_gold_path_wins_reward_one(shop):
    with _env(shop, 1) as env:
        first = env.reset()
        assert first.admissible_commands == ["search[<keywords>]"]
        assert env.instruction == GOALS[1]["instruction_text"]
        assert first.observation.startswith("WebShop [SEP] Instruction:")
        step = env.step("search[wireless noise cancelling headphones]")
        assert "click[B0STAND003]" in step.admissible_commands and "search[<keywords>]" not in step.admissible_commands
        step = env.step("click[B0STAND003]")
        assert {"click[black]", "click[silver]", "click[Buy Now]", "click[Description]"} <= set(step.admissible_commands)
        step = env.step("click[black]")
        assert step.info["asin"] == "B0STAND003" and step.info["options"] == {"color": "black"}
        step = env.step("click[Buy Now]")
        assert (step.done, step.won, step.lost, step.reward, step.score) == (True, True, False, 1.0, 1.0)
        assert step.admissible_commands == []
        with pytest.raises(RuntimeError):
            env.step("click[Back to Search]")


def test_two_options_case_insensitive_clicks_win(shop):
    with _env(shop, 0) as env:
        step = _play(env, ["SEARCH[ lightweight running shoes ]", "click[b0stand001]", "click[NAVY BLUE]",
                           "click[10]", "click[Description]", "click[< Prev]", "click[buy now]"])
        assert step.won and step.reward == 1.0


def test_wrong_product_or_option_does_not_win(shop):
    with _env(shop, 1) as env:
        step = _play(env, ["search[usb charger]", "click[B0STAND004]", "click[Buy Now]"])
        assert step.done and not step.won and step.lost and 0.0 <= step.reward < 1.0
        assert step.reward == 0.0  # a charger is not headphones: WebShop's type factor is 0
    with _env(shop, 1) as env:
        step = _play(env, ["search[wireless headphones]", "click[B0STAND003]", "click[silver]", "click[Buy Now]"])
        assert step.done and not step.won and step.reward == pytest.approx(0.75)  # (2 attrs + 0 options + price) / 4


def test_bad_sequence_leaves_reward_zero_not_done(shop):
    with _env(shop, 2) as env:
        step = _play(env, ["search[shoes]", "click[B0STAND001]", "click[white]", "click[Back to Search]",
                           "search[chocolate]", "click[B0STAND006]", "click[< Prev]"])
        assert (step.done, step.won, step.reward, step.score) == (False, False, 0.0, 0.0)
        assert step.info["page"] == "search_results" and step.info["asin"] is None


def test_sibling_episodes_on_one_goal_are_independent(shop):
    a, b = _env(shop, 3), _env(shop, 3)
    try:
        a.reset(), b.reset()
        for act_a, act_b in [("search[waterproof lipstick]", "search[lipstick]"), ("click[B0STAND007]", "click[B0STAND007]"),
                             ("click[ruby red]", "click[berry]")]:
            a.step(act_a), b.step(act_b)
        ra, rb = a.step("click[Buy Now]"), b.step("click[Buy Now]")
        assert ra.won and ra.reward == 1.0 and not rb.won and rb.reward < 1.0
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("action", [
    "go north", "", "   ", "click[]", "search[]", "click[nothing here]", "click[search]", "buy[B0STAND003]",
    "click[Buy Now]",  # not on this page
    "click[ünïcödé 🛒]", "search" + "[" * 50, "click[" + "x" * 10_000 + "]", "<action>click[B0STAND003]</action>",
])
def test_invalid_actions_flagged_without_state_change(shop, action):
    with _env(shop, 1) as env:
        env.reset()
        before = env.step("search[headphones]")
        sent = shop.requests
        step = env.step(action)
        assert step.invalid_action and not step.done and step.reward == 0.0
        assert step.observation == before.observation and step.admissible_commands == before.admissible_commands
        assert step.info == before.info and shop.requests == sent  # nothing reached the server
        assert not env.step("click[B0STAND003]").invalid_action  # the episode goes on


def test_search_needs_search_box_and_newlines_are_flattened(shop):
    with _env(shop, 1) as env:
        env.reset()
        step = env.step("search[wireless\nheadphones]")
        assert not step.invalid_action and step.info["keywords"] == "wireless headphones"
        assert env.step("search[other words]").invalid_action  # results pages have no search box


def test_step_before_reset_raises(shop):
    with _env(shop, 1) as env, pytest.raises(RuntimeError):
        env.step("search[shoes]")


def test_pagination_next_and_prev():
    with StandinWebShop(page_size=3) as small:
        with _env(small, 0) as env:
            env.reset()
            step = env.step("search[shoes boots headphones charger chocolate lipstick]")
            assert "click[Next >]" in step.admissible_commands and "click[< Prev]" not in step.admissible_commands
            step = env.step("click[Next >]")
            assert step.info["page_num"] == 2 and "Page 2" in step.observation and "click[< Prev]" in step.admissible_commands
            step = env.step("click[< Prev]")
            assert step.info["page_num"] == 1 and "Page 1" in step.observation


def test_observation_capped(shop):
    actions = ["search[organic dark chocolate]", "click[B0STAND005]", "click[Description]"]  # a ~9000-char description
    with _env(shop, 2, max_observation_chars=400) as env:
        step = _play(env, actions)
        assert len(step.observation) == 400 and step.observation.endswith("...")
        assert "Seventy percent cocoa" in step.observation
    with _env(shop, 2) as env:  # the default cap: 2000 characters
        assert len(_play(env, actions).observation) == 2000


def test_make_tasks_deterministic_disjoint_with_categories(shop):
    adapter = get_adapter("webshop")
    cfg = _cfg(shop.url)
    train = adapter.make_tasks(cfg, EnvContext(), "train")
    assert [t.to_dict() for t in train] == [t.to_dict() for t in adapter.make_tasks(cfg, EnvContext(), "train")]
    evals = adapter.make_tasks(cfg, EnvContext(), "eval")
    assert [t.task_id for t in train] == ["webshop-2", "webshop-3", "webshop-4"]
    assert [t.task_id for t in evals] == ["webshop-0", "webshop-1"]
    assert {t.task_id for t in train}.isdisjoint(t.task_id for t in evals)
    assert [t.category for t in train + evals] == ["food", "makeup", "furniture", "fashion", "electronics"]
    assert all(t.skill_key == t.category and t.gold_path == [] for t in train + evals)
    assert evals[1].objective == GOALS[1]["instruction_text"]
    task = Task.from_dict(train[0].to_dict())  # tasks travel as dicts
    with adapter.open_env(task, cfg, EnvContext()) as env:
        assert env.reset().observation.count("organic gluten free dark chocolate") == 1
    with pytest.raises(ValueError, match="overlap"):
        adapter.make_tasks(cfg.model_copy(update={"webshop": WebShopSection(url=shop.url, goals=[1, 2, 3])}), EnvContext())
    with pytest.raises(ValueError, match="pool needs 4"):
        adapter.make_tasks(cfg.model_copy(update={"game_pool": 4}), EnvContext(), "train")
    with pytest.raises(ValueError):
        adapter.make_tasks(cfg, EnvContext(), "test")


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match=rf"(?s){url}.*opsd/envs/WEBSHOP.md"):
        ws.make_tasks(_cfg(url), EnvContext(), "train")
    env = ws.WebShopEnv(url, 0)
    with pytest.raises(ws.WebShopError, match="unreachable"):
        env.reset()
    env.close()


def test_server_failures_raise(shop):
    cfg = EnvSection(name="webshop", game_pool=1, eval_pool=1, webshop=WebShopSection(url=shop.url, goals=[7], eval_goals=[0]))
    with pytest.raises(RuntimeError, match="HTTP 500 for goal 7"):  # the stand-in has goals 0-4
        ws.make_tasks(cfg, EnvContext(), "train")
    with pytest.raises(ws.WebShopError, match="HTTP 500"):
        ws.WebShopEnv(shop.url, 7).reset()
    with _env(shop, 1) as env:
        env.reset()
        shop.fail_status = 503
        try:
            with pytest.raises(ws.WebShopError, match="HTTP 503"):
                env.step("search[headphones]")
        finally:
            shop.fail_status = None
        with pytest.raises(RuntimeError):  # the failed request ended the episode
            env.step("search[headphones]")
        assert env.reset().admissible_commands == ["search[<keywords>]"]  # a reset starts over
    with _env(shop, 1, timeout_s=0.2) as env:
        env.reset()
        shop.delay_s = 0.6
        try:
            with pytest.raises(ws.WebShopError, match="timed out"):
                env.step("search[headphones]")
        finally:
            shop.delay_s = 0.0


def test_score_and_accuracy_on_handmade_outcomes():
    assert ws.webshop_score([1.0, 0.5, 0.0, 1.0]) == pytest.approx(62.5)
    assert ws.webshop_accuracy([1.0, 0.5, 0.0, 1.0]) == pytest.approx(50.0)
    assert ws.webshop_score([0.75]) == pytest.approx(75.0) and ws.webshop_accuracy([0.75]) == 0.0
    assert ws.webshop_score([1, 1]) == 100.0 and ws.webshop_accuracy([1, 1]) == 100.0
    assert ws.webshop_score([0.0, 0.0, 0.0]) == 0.0
    for bad in ([], [1.5], [-0.1], [math.nan]):
        with pytest.raises(ValueError):
            ws.webshop_score(bad)
        with pytest.raises(ValueError):
            ws.webshop_accuracy(bad)


@pytest.mark.parametrize("instruction, category", [
    ("i need a black leather sofa for my living room", "furniture"),
    ("i want a glass coffee table under 100 dollars", "furniture"),
    ("looking for usb c cables 6 ft", "electronics"),
    ("i need a long lasting lipstick in ruby red", "makeup"),
    ("sugar free keto snacks, 12 pack", "food"),
    ("men's slim fit jeans, size 32", "fashion"),
    ("a birthday card with envelope", "other"),
])
def test_category_from_instruction(instruction, category):
    assert ws.webshop_category(instruction) == category


def test_skills_and_prompt():
    general = privileged_text("webshop", Task(task_id="t", category="other", spec={}, skill_key="other"), "both")
    assert "click[Buy Now]" in general  # "other" gets the general skills only
    for category in ws.CATEGORIES[:-1]:
        text = privileged_text("webshop", Task(task_id="t", category=category, spec={}, skill_key=category), "both")
        assert text.startswith(general) and len(text) > len(general) + 100
    adapter = get_adapter("webshop")
    assert (adapter.NAME, adapter.ACTION_TAGS, adapter.METRIC) == ("webshop", ("action",), "score")
    assert all("{pick}" in adapter.PROMPT.system[f] for f in ("action", "think"))
    obs, admissible, replies = adapter.PROMPT.example
    assert replies["action"] == "<action>search[blue ceramic coffee mug]</action>"
    assert replies["think"].startswith("<think>") and replies["think"].endswith(replies["action"])
    assert ws.parse_action(replies["action"][8:-9]) == ("search", "blue ceramic coffee mug")


def test_parser_on_real_webshop_shapes():
    # Markup shaped like WebShop's done page: a hidden block with stray end tags, then the visible score.
    page = ws.parse_page(
        '<html><head><title>WebShop</title></head><body><div id="stats">'
        '<div style="display:none"><h4 id="asin">asin<pre>B0X</pre></p><h4 id="goal">goal<pre>secret</pre></h4>'
        '<h2>Reward</h2></div><hr class="solid"><h3 id="reward">Your score (min 0.0, max 1.0)<pre>0.6666666666666666</pre></h3>'
        '<h4 hidden>Reward Details <div id="reward_info"><pre>{}</pre></div></h4></div></body></html>')
    assert page.reward() == pytest.approx(2 / 3)
    assert "secret" not in " ".join(page.texts) and "Reward Details" not in " ".join(page.texts)
    # The search page: the instruction split by <br>, the search form's button is not a clickable.
    page = ws.parse_page('<div id="instruction-text" class="text-center"><h4>Instruction: <br>find a red mug</h4></div>'
                         '<form id="form-buscar" method="post" action="/abc"><input id="search_input" name="search_query">'
                         '<button class="btn btn-success" type="submit">Search</button></form>')
    assert page.instruction == "find a red mug" and page.search == ("POST", "/abc", "search_query")
    assert page.clickables == {}


_ITEM = ('<html><body><div id="instruction-text"><h4>Instruction: buy a mug</h4></div>'
         '<form method="post" action="/done/fixed_1/B1/%7B%7D"><button class="btn">Buy Now</button></form></body></html>')


def _mock_env(handler, timeout_s=5.0, max_page_bytes=ws.MAX_PAGE_BYTES) -> ws.WebShopEnv:
    env = ws.WebShopEnv("http://shop", 1, 2000, timeout_s, max_page_bytes)
    env._client.close()
    env._client = httpx.Client(transport=httpx.MockTransport(handler), follow_redirects=True, timeout=timeout_s)
    return env


def _buy(score_html: str):
    def handler(req):
        if "/done/" in req.url.path:
            return httpx.Response(200, html=f'<html><body><h3 id="reward">{score_html}</h3></body></html>')
        return httpx.Response(200, html=_ITEM)

    env = _mock_env(handler)
    env.reset()
    return env.step("click[Buy Now]")


@pytest.mark.parametrize("score_html", ["Your score (min 0.0, max 1.0)", "Your score (min 0.0, max 1.0)<pre></pre>",
                                        "Your score (min 0.0, max 1.0)<pre>1e5</pre>", "Your score (min 0.0, max 1.0)<pre>nan</pre>",
                                        "Your score (min 0.0, max 1.0)<pre>-0.5</pre>", "Your score (min 0.0, max 1.0)<pre>1.0 0.5</pre>",
                                        "Your score (min 0.0, max 1.0)<pre>inf</pre>", "score 0.5 of 1.0"])
def test_garbage_purchase_score_is_a_server_failure(score_html):
    with pytest.raises(ws.WebShopError):
        _buy(score_html)


@pytest.mark.parametrize("score_html, reward", [("Your score (min 0.0, max 1.0)<pre>1.0</pre>", 1.0),
                                                ("Your score (min 0.0, max 1.0)<pre> 0.25 </pre>", 0.25),
                                                ("Your score (min 0.0, max 1.0)<pre>0</pre>", 0.0),
                                                ("Your score (min 0.0, max 1.0) 0.5", 0.5)])
def test_valid_purchase_scores_are_read_exactly(score_html, reward):
    step = _buy(score_html)
    assert step.done and step.reward == reward and step.won == (reward == 1.0)


def test_slow_drip_server_is_bounded_by_timeout_s():
    """timeout_s is a deadline for the whole request: a body dripped a byte every 0.3 s is cut at ~1 s.

    Unbounded, the drip takes DRIP * 0.3 = 9 s (each read well inside the 1 s read timeout) and the
    client reads all of it. The server tells which: the client hung up mid-body ("cut") or read it "whole"."""
    DRIP = 30
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port, ended = srv.getsockname()[1], queue.Queue()

    def serve():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            body = _ITEM.encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n" % (len(body) + DRIP) + body)
            try:
                for _ in range(DRIP):
                    time.sleep(0.3)
                    conn.sendall(b" ")
            except OSError:  # a send after the client's close fails
                ended.put("cut")
                return
            ended.put("whole")

    threading.Thread(target=serve, daemon=True).start()
    env = ws.WebShopEnv(f"http://127.0.0.1:{port}", 1, 2000, timeout_s=1.0)
    try:
        with pytest.raises(ws.WebShopError, match="timed out"):
            env.reset()
        assert ended.get(timeout=30) == "cut"  # 30 s: a hang guard only (the cut is seen ~0.6 s after the close)
    finally:
        srv.close()
        env.close()


def test_overlong_page_is_a_server_failure():
    big = _ITEM + "x" * 5000
    with pytest.raises(ws.WebShopError, match="max_page_bytes"):  # declared by Content-Length
        _mock_env(lambda req: httpx.Response(200, html=big), max_page_bytes=1000).reset()
    chunked = lambda req: httpx.Response(200, content=iter([big.encode()[i:i + 500] for i in range(0, len(big), 500)]))
    with pytest.raises(ws.WebShopError, match="max_page_bytes"):  # streamed without a length
        _mock_env(chunked, max_page_bytes=1000).reset()
    assert _mock_env(lambda req: httpx.Response(200, html=_ITEM), max_page_bytes=len(_ITEM)).reset().admissible_commands
    assert WebShopSection().max_page_bytes == 4_000_000
    with pytest.raises(ValueError):
        WebShopSection(max_page_bytes=0)


@pytest.mark.parametrize("spec", [{}, {"goal": None}, {"goal": -1}, {"goal": "x"}, {"goal": True}, {"goal": 1.5}])
def test_malformed_task_spec_is_a_value_error(spec):
    cfg = _cfg("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="'goal'"):
        get_adapter("webshop").open_env(Task(task_id="webshop-x", category="other", spec=spec), cfg, EnvContext())
