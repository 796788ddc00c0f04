"""Search-QA: exact match, the shipped data, the env over a real encoder + FAISS index, and /retrieve in the embedder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from opsd.config import EmbedderSection, EnvSection
from opsd.envs import EnvContext, get_adapter
from opsd.envs.search import (SHIPPED_CORPUS, SHIPPED_QUESTIONS, SKILL_KEYS, HTTPRetriever, LocalRetriever, RetrievalError,
                              exact_match, load_questions, make_tasks, normalize_answer, open_env, search_r1_row)
from opsd.encoder import Encoder
from opsd.retrieval import CorpusIndex, LazyCorpusIndex, corpus_for_config, load_corpus
from services.embedder.app import build_app

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def encoder():
    return Encoder("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def retriever(encoder):
    return LocalRetriever(SHIPPED_CORPUS, encoder)


@pytest.fixture(scope="module")
def app_client(encoder, retriever):
    app = build_app(EmbedderSection(max_text_chars=300), encoder, TOKEN, retriever.index)  # the same LazyCorpusIndex
    return TestClient(app)


def cfg(**kw) -> EnvSection:
    return EnvSection(name="search", **kw)


def tasks_by_id(split: str = "train", **kw):
    c = cfg(game_pool=100, eval_pool=100, **kw)
    return {t.task_id: t for t in make_tasks(c, EnvContext(), split)}


# ---------------------------------------------------------------------------- exact match


def test_normalization_and_exact_match_classic_cases():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("  A cat, an apple; THE end. ") == "cat apple end"
    assert normalize_answer("Stratford-upon-Avon") == "stratforduponavon"
    assert normalize_answer("I. M. Pei") == "i m pei"
    assert normalize_answer("theatre") == "theatre"  # an article only as a whole word
    assert exact_match("the Louvre", ["Louvre Museum", "Louvre"]) == 1.0  # any of the references
    assert exact_match("Louvre, Paris", ["Louvre"]) == 0.0  # exact, not contains
    assert exact_match("42.195 km", "42.195 km") == 1.0 and exact_match("42195", "42.195") == 1.0  # punctuation goes
    assert exact_match("", ["Paris"]) == 0.0 and exact_match("Paris", []) == 0.0
    # Text of only articles / punctuation normalizes to "": it never matches, on either side.
    assert exact_match("the", ["a"]) == 0.0 and exact_match("?!", ["The The"]) == 0.0 and exact_match("the", "The") == 0.0


# ---------------------------------------------------------------------------- data and tasks


def test_shipped_data_is_consistent():
    passages = {p.id: p for p in load_corpus(SHIPPED_CORPUS)}
    rows = load_questions(SHIPPED_QUESTIONS)
    assert len(passages) == 159 and len(rows) == 60
    assert all(p.title and p.text for p in passages.values())
    for r in rows:
        assert r["skill"] in SKILL_KEYS and r["data_source"] in ("single_hop", "multi_hop")
        assert all(s in passages for s in r["support"]) and len(r["gold_queries"]) == len(r["support"])
        support = normalize_answer(" ".join(passages[s].contents for s in r["support"]))
        assert r["golden_answers"] in (["yes"], ["no"]) or any(normalize_answer(a) in support for a in r["golden_answers"]), r["id"]


def test_make_tasks_is_deterministic_and_splits_are_disjoint():
    c = cfg(game_pool=8, eval_pool=16, seed=7)
    train, again = make_tasks(c, EnvContext(), "train"), make_tasks(c, EnvContext(), "train")
    assert [t.to_dict() for t in train] == [t.to_dict() for t in again] and len(train) == 8
    ev = make_tasks(c, EnvContext(), "eval")
    assert len(ev) == 16
    all_train, all_eval = tasks_by_id("train"), tasks_by_id("eval")
    assert len(all_train) == 41 and len(all_eval) == 19 and not set(all_train) & set(all_eval)
    other = make_tasks(cfg(game_pool=8, seed=8), EnvContext(), "train")
    assert [t.task_id for t in other] != [t.task_id for t in train]  # the seed picks the train pool
    t = {**all_train, **all_eval}["search-sq31"]
    assert t.category == "multi_hop" and t.skill_key == "multi_hop" and t.objective.startswith("In which country")
    assert t.gold_path == ["<search>first ascent of Mount Everest</search>", "<search>Edmund Hillary born</search>",
                           "<answer>New Zealand</answer>"]
    with pytest.raises(ValueError, match="split"):
        make_tasks(c, EnvContext(), "test")


def test_search_r1_rows_and_separate_eval_file(tmp_path):
    row = {"question": "who wrote hamlet?", "golden_answers": np.array(["Shakespeare", "William Shakespeare"]),
           "data_source": "hotpotqa", "type": "comparison", "extra_info": {"index": 7, "split": "train"}}
    out = search_r1_row(row)
    assert out == {"id": "hotpotqa-7", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare", "William Shakespeare"],
                   "data_source": "hotpotqa", "type": "comparison"}
    nested = search_r1_row({"id": "test_3", "question": "q?", "data_source": "nq",
                            "reward_model": {"ground_truth": {"target": ["a"]}}})
    assert nested["golden_answers"] == ["a"] and nested["id"] == "test_3"
    with pytest.raises(ValueError, match="golden answers"):
        search_r1_row({"question": "q?"})
    tr, ev = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    tr.write_text("\n".join(json.dumps({"id": f"t{i}", "question": "q", "golden_answers": ["a"], "data_source": "nq"})
                            for i in range(5)))
    ev.write_text(json.dumps({**row, "golden_answers": ["Shakespeare"]}) + "\n")
    c = cfg(game_pool=5, eval_pool=5, search={"questions": str(tr), "eval_questions": str(ev)})
    assert len(make_tasks(c, EnvContext(), "train")) == 5  # every row: the eval rows are elsewhere
    (t,) = make_tasks(c, EnvContext(), "eval")
    assert t.category == "hotpotqa" and t.skill_key == "comparison"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "q", "golden_answers": ["a"]}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        load_questions(bad)


# ---------------------------------------------------------------------------- the env


def find_task(task_id, **kw):
    return {**tasks_by_id("train", **kw), **tasks_by_id("eval", **kw)}[task_id]


def play(task_id, actions, retriever, **kw):
    task = find_task(task_id, **kw)
    env = open_env(task, cfg(**kw), EnvContext(retriever=retriever))
    first = env.reset()
    return env, first, [env.step(a) for a in actions]


def test_gold_path_wins_and_step_after_done_raises(retriever):
    task = find_task("search-sq47")
    env, first, steps = play(task.task_id, task.gold_path, retriever)
    assert first.observation == f"Question: {task.spec['question']}" and not first.done
    for s, title in zip(steps, ["Saturn", "Titan", "Christiaan Huygens"]):
        assert s.observation.startswith("<information>Doc 1 (Title: ") and s.observation.endswith("</information>")
        assert f"(Title: {title})" in s.observation and s.reward == 0.0 and not s.done and not s.invalid_action
    last = steps[-1]
    assert last.won and last.done and last.reward == 1.0 and last.info["em"] == 1.0 and not last.lost
    with pytest.raises(RuntimeError, match="finished"):
        env.step("<answer>The Hague</answer>")
    env.reset()  # a new episode: any reference, any case, articles and punctuation ignored
    assert env.step("<answer> hague. </answer>").won


def test_wrong_answer_and_search_only_leave_reward_zero(retriever):
    _, _, (s,) = play("search-sq03", ["<answer>Sydney</answer>"], retriever)
    assert s.done and not s.won and s.lost and s.reward == 0.0 and s.info["em"] == 0.0
    _, _, steps = play("search-sq03", ["<search>Sydney</search>"] * 3 + ["<search>Melbourne</search>"], retriever)
    assert all(not s.done and s.reward == 0.0 and not s.won for s in steps)


def test_invalid_actions_are_flagged_and_do_not_end_the_episode(retriever):
    bad = ["capital of Australia", "<search></search>", "<answer>  </answer>",
           "<search>a</search><answer>b</answer>", "<search>a</search> trailing", "<search>x<answer>y</answer></search>",
           "<action>look</action>", "<search>unclosed", "\ud800\x00🙂", "<answer>" + "z" * 10_000]
    env, _, steps = play("search-sq03", bad, retriever)
    assert all(s.invalid_action and not s.done and s.reward == 0.0 for s in steps)
    assert "<search>query</search>" in steps[0].observation
    s = env.step("<SEARCH>\n capital \n of Australia\n</SEARCH>")  # tags in any case, content flattened
    assert not s.invalid_action and "(Title: Canberra)" in s.observation and s.info["query"] == "capital of Australia"
    assert env.step("<answer>" + "Canberra " * 300 + "</answer>").done  # an overlong answer is cut, not a crash


def test_observations_are_capped(retriever):
    _, _, (s,) = play("search-sq03", ["<search>capital of Australia</search>"], retriever,
                      max_observation_chars=120, search={"top_k": 5, "max_passage_chars": 50})
    assert len(s.observation) <= 120 and s.observation.endswith("...</information>")
    assert all(len(line) <= 50 + len("<information>") for line in s.observation.split("\n"))


def test_open_env_needs_a_retriever_and_the_adapter_is_registered():
    mod = get_adapter("search")
    assert mod.ACTION_TAGS == ("search", "answer") and mod.METRIC == "em"
    assert "<search>" in mod.PROMPT.example[2]["action"] and mod.PROMPT.example[2]["think"].startswith("<think>")
    assert set(mod.PROMPT.system) == {"action", "think"}
    with pytest.raises(RuntimeError, match="retriever"):
        open_env(find_task("search-sq03"), cfg(), EnvContext())


def test_every_gold_query_retrieves_its_passage(retriever):
    index = retriever.index.get()  # the real encoder over a FAISS inner-product index of the shipped corpus
    for r in load_questions(SHIPPED_QUESTIONS):
        for q, pid in zip(r["gold_queries"], r["support"]):
            assert pid in [p.id for p, _ in index.search(q, 3)], (r["id"], q)


def test_index_cache_is_written_and_reused(encoder, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(line for i, line in enumerate(SHIPPED_CORPUS.open()) if i < 20))
    built = CorpusIndex.build(corpus, encoder, "all-MiniLM-L6-v2", tmp_path)
    (cached,) = (tmp_path / "retrieval").glob("*-all-MiniLM-L6-v2-384.faiss")
    again = CorpusIndex.build(corpus, encoder, "all-MiniLM-L6-v2", tmp_path)
    assert again.index.ntotal == 20
    assert [p.id for p, _ in again.search("deepest lake", 3)] == [p.id for p, _ in built.search("deepest lake", 3)]
    cached.write_bytes(b"garbage")  # a corrupt cache file is rebuilt, not trusted
    assert CorpusIndex.build(corpus, encoder, "all-MiniLM-L6-v2", tmp_path).index.ntotal == 20


# ---------------------------------------------------------------------------- /retrieve in the embedder


def test_retrieve_endpoint_answers_and_guards(app_client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = app_client.post("/retrieve", json={"query": "deepest lake in the world", "k": 2}, headers=auth)
    assert r.status_code == 200, r.text
    (best, second) = r.json()["passages"]
    assert best["id"] == "baikal" and best["title"] == "Lake Baikal" and best["contents"].startswith('"Lake Baikal"\n')
    assert 0 < second["score"] <= best["score"] <= 1.0
    assert app_client.post("/retrieve", json={"query": "x", "k": 1}).status_code == 401
    assert app_client.post("/retrieve", json={"query": "x"}, headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}).status_code == 401
    for body, loc in [({"query": "x", "k": 0}, "k"), ({"query": "x", "k": -3}, "k"), ({"query": "x", "k": 10**9}, "k"),
                      ({"query": "", "k": 1}, "query"), ({"query": "  \n ", "k": 1}, "query"), ({"k": 1}, "query"),
                      ({"query": ["x"], "k": 1}, "query")]:
        r = app_client.post("/retrieve", json=body, headers=auth)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", loc], (body, r.text)
    r = app_client.post("/retrieve", json={"query": "x", "k": 1, "extra": 1}, headers=auth)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "extra_forbidden"
    r = app_client.post("/retrieve", json={"query": "x" * 301, "k": 1}, headers=auth)
    assert r.status_code == 413 and "exceed 300 characters" in r.json()["detail"]


def test_retrieve_small_corpus_unknown_or_broken_corpus(encoder, tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"id": "a", "contents": "\\"A\\"\\nApples are fruit."}\n{"id": "b", "title": "B", "text": "Bees make honey."}\n')
    auth = {"Authorization": f"Bearer {TOKEN}"}
    lazy = LazyCorpusIndex(tiny, encoder)
    lazy.build_in_background().join(timeout=60)  # as the embedder may warm it at startup
    client = TestClient(build_app(EmbedderSection(), encoder, TOKEN, lazy))
    r = client.post("/retrieve", json={"query": "honey", "k": 50}, headers=auth)  # k > corpus: no -1 ids (case 18)
    assert r.status_code == 200 and [p["id"] for p in r.json()["passages"]] == ["b", "a"]
    assert r.json()["passages"][0]["title"] == "B"
    none = TestClient(build_app(EmbedderSection(), encoder, TOKEN))  # no corpus: the embedder's API as before
    assert none.post("/retrieve", json={"query": "honey"}, headers=auth).status_code == 404
    assert "/retrieve" not in none.get("/openapi.json", headers=auth).json()["paths"]
    with pytest.raises(RetrievalError, match="404.*serves no corpus"):
        HTTPRetriever(lambda: "http://testserver", TOKEN, client=none).search("honey", 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    broken = TestClient(build_app(EmbedderSection(), encoder, TOKEN, LazyCorpusIndex(empty, encoder)))
    for _ in range(2):  # the failure is remembered, with its reason
        r = broken.post("/retrieve", json={"query": "honey"}, headers=auth)
        assert r.status_code == 503 and "holds no passages" in r.json()["detail"]
    assert corpus_for_config(type("C", (), {"env": cfg()})()) == SHIPPED_CORPUS
    assert corpus_for_config(type("C", (), {"env": EnvSection()})()) is None


def test_http_retriever_matches_the_local_one_and_fails_clearly(app_client, retriever):
    http = HTTPRetriever(lambda: "http://testserver", TOKEN, 5.0, client=app_client)
    for q in ("capital city of Australia", "Titan moon discovered by"):
        assert http.search(q, 3) == retriever.search(q, 3)
    with pytest.raises(RetrievalError, match="401.*not the embedder's"):
        HTTPRetriever(lambda: "http://testserver", "another-token-0123456789", client=app_client).search("x", 1)
    with pytest.raises(RetrievalError, match="422"):
        http.search("x", 0)
    with pytest.raises(RetrievalError, match="not announced"):
        HTTPRetriever(lambda: None, TOKEN, retry_s=0.2).search("x", 1)
    with pytest.raises(RetrievalError, match="unreachable"):
        HTTPRetriever(lambda: "http://127.0.0.1:9", TOKEN, timeout_s=1.0, retry_s=0.3).search("x", 1)
    # The env on the HTTP retriever: the same information as in-process.
    env = open_env(find_task("search-sq03"), cfg(), EnvContext(retriever=http))
    env.reset()
    assert "(Title: Canberra)" in env.step("<search>capital city of Australia</search>").observation


def test_retrieve_answers_503_while_the_index_builds_and_the_client_waits_for_it(encoder):
    """A corpus still being embedded is a 503 with Retry-After (never a request blocked for the whole
    build); HTTPRetriever retries it until the index is ready."""
    import threading

    from fastapi.testclient import TestClient

    from opsd.config import EmbedderSection
    from opsd.envs.search import HTTPRetriever
    from services.embedder.app import build_app
    from opsd.retrieval import IndexBuilding

    class SlowIndex:  # stands in for LazyCorpusIndex while a build holds its lock
        def __init__(self, inner):
            self.inner, self.ready = inner, threading.Event()

        def get(self, wait=True):
            if not self.ready.is_set():
                raise IndexBuilding("still being built")
            return self.inner

    class OneHit:
        def search(self, query, k):
            from opsd.retrieval import Passage

            return [(Passage(id="p1", title="T", contents="the answer passage"), 0.9)]

    slow = SlowIndex(OneHit())
    client = TestClient(build_app(EmbedderSection(), encoder, "t" * 32, slow))
    r = client.post("/retrieve", json={"query": "q", "k": 1}, headers={"Authorization": "Bearer " + "t" * 32})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    threading.Timer(1.0, slow.ready.set).start()
    retriever = HTTPRetriever(lambda: "http://testserver", "t" * 32, retry_s=30, client=client)
    assert retriever.search("q", 1) == ["the answer passage"]


@pytest.mark.parametrize("line", ['[1, 2]', '"just a string"', '{"id": "1", "question": "q", "golden_answers": 42}',
                                  '{"id": "1", "question": "q", "golden_answers": [{"a": 1}]}',
                                  '{"id": "1", "question": "q", "reward_model": "x"}'])
def test_bad_question_rows_name_their_line(tmp_path, line):
    q = tmp_path / "q.jsonl"
    q.write_text('{"id": "0", "question": "ok", "golden_answers": ["a"]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=r"q\.jsonl:3: row 1"):
        load_questions(q)


@pytest.mark.parametrize("body", [["bad gateway"], "down", 5])
def test_http_retriever_non_object_error_body_is_a_retrieval_error(body):
    import httpx

    client = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(502, json=body)))
    with pytest.raises(RetrievalError, match="answered 502"):
        HTTPRetriever(lambda: "http://embedder", "tok", client=client).search("q", 3)
