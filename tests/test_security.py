"""The HTTP surface and the code base against hostile input.

- auth: every embedder route but /health, /metrics, /readyz and /livez needs the run's bearer token;
- body limit: announced, chunked or lying bodies over the limit get 413, and the server keeps serving;
- schemathesis: generated (valid and invalid) requests never get a 5xx or an answer outside the schema;
- no pickle/marshal/eval/exec/torch.load/yaml.load/allow_pickle anywhere in the shipped code (AST scan);
- embedder down: the teacher's client retries 5xx and connection errors until its deadline, then the
  group is scored with identity views and counted; an embedder that comes back is used again.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import queue
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import schemathesis
from fastapi import Response
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from prometheus_client import REGISTRY
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from opsd.auth import ApiGuard, api_token
from opsd.chat import ChatFormat
from opsd.config import EmbedderSection, EnvSection, RunConfig
from opsd.envs.textworld import make_games
from opsd.probes import Liveness
from opsd.service import add_observability, bind_socket, serve_in_thread
from opsd.types import TaskGroup
from opsd.encoder import Encoder
from services.embedder.app import build_app
from services.rollout.episodes import run_group
from services.teacher.scoring import EmbedderAuthError, EmbedderClient, EmbedderUnavailable, score_group

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "security-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 8192  # embedder.max_request_bytes of the live server
TURN = {"rollout_id": "r0", "turn_id": 0, "student_text": "open the box", "teacher_text": "open the chest",
        "student_valid": True, "teacher_valid": True}


def rejected(status: int) -> float:
    return REGISTRY.get_sample_value("opsd_http_rejected_total", {"role": "embedder", "status": str(status)}) or 0.0


def fallbacks() -> float:
    return REGISTRY.get_sample_value("opsd_embedder_fallbacks_total", {"role": "teacher"}) or 0.0


@pytest.fixture(scope="module")
def encoder():
    return Encoder("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def app(encoder):
    app = build_app(EmbedderSection(max_texts=64, max_text_chars=500), encoder, TOKEN)
    add_observability(app, "embedder", dict, unready=lambda: None, liveness=Liveness(60))  # as RoleProcess.serve does
    return app


class Flaky:
    """ASGI front that answers `fail_status` (503 unless set) to the next `fail_next` requests, then passes
    them on; counts requests."""

    def __init__(self, app):
        self.app, self.fail_next, self.fail_status, self.calls, self.headers = app, 0, 503, 0, []
        self.url = ""  # set once served

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls += 1
            self.headers.append(dict(scope["headers"]))
            if self.fail_next > 0:
                self.fail_next -= 1
                await Response("refused", status_code=self.fail_status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def live(encoder):
    """The embedder app (limit LIMIT bytes) behind `Flaky`, served by uvicorn on a free loopback port."""
    app = build_app(EmbedderSection(max_request_bytes=LIMIT), encoder, TOKEN)
    add_observability(app, "embedder", dict, unready=lambda: None, liveness=Liveness(60))
    front = Flaky(app)
    sock = bind_socket("127.0.0.1", 0)
    server = serve_in_thread(front, sock)
    front.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield front
    server.should_exit = True


def closed_port_url() -> str:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ================================================================ auth


def test_token_is_required_except_for_health_metrics_and_probes(app):
    client = TestClient(app)
    before = rejected(401)
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abc"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}):
        r = client.post("/embed", json={"texts": ["go north"]}, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer" and "bearer token" in r.json()["detail"]
    assert rejected(401) == before + 5
    r = client.post("/embed", json={"texts": ["go north"]}, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["vectors"][0]) == 384
    assert client.post("/embed", json={"texts": ["go north"]}, headers={"authorization": f"bearer {TOKEN}"}).status_code == 200
    assert client.get("/health").json()["role"] == "embedder"
    assert client.get("/readyz").json() == {"role": "embedder", "ready": True}  # the probes carry no token
    assert client.get("/livez").json()["live"] is True
    assert "opsd_http_rejected_total" in client.get("/metrics").text
    for path in ("/openapi.json", "/docs", "/redoc"):  # the API's description is behind the token too
        assert client.get(path).status_code == 401
    assert client.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "opsd embedder"
    assert rejected(401) == before + 8


def test_a_repeated_authorization_header_is_refused(live):
    before = rejected(401)
    wrong = "Bearer wrong-token-0123456789abc"
    with httpx.Client(base_url=live.url, timeout=30) as client:
        # Whichever copy a reader takes, two copies are refused: the right one last, first, or both.
        for pair in ((wrong, AUTH["Authorization"]), (AUTH["Authorization"], wrong), (AUTH["Authorization"],) * 2):
            r = client.post("/embed", json={"texts": ["go north"]}, headers=[("Authorization", v) for v in pair])
            assert r.status_code == 401 and r.json()["detail"] == "more than one Authorization header", pair
            assert r.headers["www-authenticate"] == "Bearer"
        assert client.post("/embed", json={"texts": ["go north"]}, headers=AUTH).status_code == 200
    assert rejected(401) == before + 3


def test_api_token_from_the_environment():
    assert api_token({"OPSD_API_TOKEN": TOKEN}) == TOKEN
    for env in ({}, {"OPSD_API_TOKEN": ""}, {"OPSD_API_TOKEN": "short"}, {"OPSD_API_TOKEN": "x" * 20 + " y"},
                {"OPSD_API_TOKEN": "é" * 20}):
        with pytest.raises(RuntimeError, match="OPSD_API_TOKEN"):
            api_token(env)


# ================================================================ body limit


def test_over_limit_bodies_get_413_and_the_server_keeps_serving(live):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as client:
        before = rejected(413)
        body = b'{"texts": ["' + b"a" * LIMIT + b'"]}'
        r = client.post("/embed", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and f"the limit is {LIMIT} bytes" in r.json()["detail"]
        assert f"a body of {len(body)} bytes" in r.json()["detail"]

        def chunks():  # no Content-Length: Transfer-Encoding chunked
            yield b'{"texts": ["'
            for _ in range(8):
                yield b"b" * 4096
            yield b'"]}'

        r = client.post("/embed", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "more than 8192 bytes sent" in r.json()["detail"]
        assert rejected(413) == before + 2
        # A chunked body under the limit is served, and so is every request after the refusals.
        r = client.post("/embed", content=iter([b'{"texts": ', b'["go north"]}']), headers={"content-type": "application/json"})
        assert r.status_code == 200 and np.isclose(np.linalg.norm(r.json()["vectors"][0]), 1.0, atol=1e-5)
        assert client.post("/embed", json={"texts": ["go south"]}).status_code == 200


def _asgi_call(guard, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, bytes]:
    """Drive `guard` with one POST whose body arrives in `chunks`; returns (status, response body)."""
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/embed", "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_lying_content_length_cannot_pass_more_than_the_limit():
    seen: list[bytes] = []

    async def inner(scope, receive, send):  # a stand-in app: records the body it was handed
        seen.append((await receive())["body"])
        await Response("ok")(scope, receive, send)

    guard = ApiGuard(inner, role="embedder", token=TOKEN, max_body_bytes=1024)
    # Content-Length says 10; 2000 bytes come: refused after the limit, the app never runs.
    status, body = _asgi_call(guard, {"authorization": AUTH["Authorization"], "content-length": "10"}, [b"x" * 500] * 4)
    assert status == 413 and b"more than 1024 bytes sent" in body and seen == []
    status, body = _asgi_call(guard, {"authorization": AUTH["Authorization"], "content-length": "ten"}, [b"x"])
    assert status == 400 and seen == []
    # Exactly the limit, in pieces: the app gets the whole body in one message.
    status, _ = _asgi_call(guard, {"authorization": AUTH["Authorization"]}, [b"y" * 1000, b"z" * 24])
    assert status == 200 and seen == [b"y" * 1000 + b"z" * 24]


# ================================================================ schemathesis


@pytest.fixture(scope="module")
def embedder_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


schema = schemathesis.pytest.from_fixture("embedder_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_generated_requests_never_get_a_server_error(case):
    # Valid and invalid requests (schemathesis' positive and negative modes) against the real encoder.
    case.call_and_validate(headers=AUTH,
                           checks=[not_a_server_error, response_schema_conformance, content_type_conformance])


# ================================================================ no unsafe deserialization / code execution

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_CALLS = {
    "eval", "exec", "compile", "builtins.eval", "builtins.exec", "builtins.compile",
    "torch.load", "pandas.read_pickle",
    "yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
}


def unsafe_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every import of a pickle-like module and every unsafe call in `source`, as "file:line: what".

    Names are resolved through the file's imports (`import numpy as np`,
    `from torch import load`), so `re.compile` or `model.eval()` are not
    flagged but an aliased `torch.load` is. Also flags any `allow_pickle=`
    that is not the literal False and `__import__`/`importlib.import_module`
    of a pickle-like module by name.
    """
    tree = ast.parse(source, filename)
    origin: dict[str, str] = {}  # local name -> what it was imported as
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                origin[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                origin[a.asname or a.name] = f"{node.module}.{a.name}"
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{filename}:{node.lineno}: from {node.module} import")

    def dotted(expr: ast.expr) -> str | None:
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        return ".".join([origin.get(expr.id, expr.id), *reversed(parts)]) if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name in UNSAFE_CALLS:
            found.append(f"{filename}:{node.lineno}: {name}()")
        if name in ("__import__", "importlib.import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).split(".")[0] in UNSAFE_MODULES:
            found.append(f"{filename}:{node.lineno}: {name}({node.args[0].value!r})")
        for kw in node.keywords:
            if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{filename}:{node.lineno}: {name}(allow_pickle=...)")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


PLANTED = """\
import pickle
import cloudpickle as cp
from marshal import loads
import numpy as np, torch, yaml
from torch import load as tload
x = eval("1 + 1")
exec("y = 2")
code = compile("1", "f", "eval")
m = torch.load("w.pt")
w = tload("w.pt")
d = yaml.load(open("c.yaml"))
e = yaml.unsafe_load("a: 1")
a = np.load("a.npy", allow_pickle=True)
b = np.load("a.npy", allow_pickle=flag)
mod = __import__("dill")
def f():
    import shelve
"""

SAFE = """\
import re, yaml, numpy as np, torch
from re import compile
pat = re.compile("x")
pat2 = compile("y")
model.eval()
cfg = yaml.safe_load("a: 1")
arr = np.load("a.npy")
arr2 = np.load("a.npy", allow_pickle=False)
fast = torch.compile(model)
"""


def test_the_scanner_finds_every_planted_unsafe_use():
    found = unsafe_uses(PLANTED)
    lines = [int(f.split(":")[1]) for f in found]
    assert lines == [1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17], found
    assert "<snippet>:10: torch.load()" in found and "<snippet>:14: numpy.load(allow_pickle=...)" in found
    assert unsafe_uses(SAFE) == []


def test_shipped_code_has_no_unsafe_deserialization_or_code_execution():
    files = [p for d in ("opsd", "services", "benchmarks", "scripts") if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20  # the scan is not vacuous
    found = [f for p in files for f in unsafe_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


# ================================================================ embedder down


def backoffs_logged(caplog) -> list[float]:
    """The seconds EmbedderClient said it would wait before each retry ("attempt N in S s"), in order."""
    return [float(m) for r in caplog.records if r.name == "teacher"
            for m in re.findall(r"^embedder call failed .*; attempt \d+ in ([\d.]+)s$", r.getMessage(), re.S)]


def test_client_retries_5xx_then_succeeds_and_sends_the_token(live, caplog):
    live.fail_next, live.calls, live.headers = 2, 0, []
    client = EmbedderClient(lambda: live.url, TOKEN, timeout_s=30, deadline_s=30)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "teacher"):
        out = client.correspond({"task_id": "t", "turns": [TURN, {**TURN, "rollout_id": "r1"}]})
    assert live.calls == 3 and len(out["similarity"]) == 2
    assert backoffs_logged(caplog) == [0.5, 1.0]  # exponential backoff from 0.5 s, far inside the deadline
    assert time.monotonic() - t0 >= 1.5  # and it did wait them (a lower bound: a loaded machine only adds)
    assert all(h[b"authorization"] == f"Bearer {TOKEN}".encode() for h in live.headers)


def test_client_does_not_retry_4xx_and_a_refused_token_is_its_own_error(live):
    live.calls = 0
    with pytest.raises(EmbedderAuthError, match=r"answered 401 Unauthorized: the teacher's OPSD_API_TOKEN") as e:
        EmbedderClient(lambda: live.url, "wrong-token-0123456789abc", 30, 30).correspond({"task_id": "t", "turns": [TURN]})
    assert live.calls == 1 and not isinstance(e.value, (httpx.HTTPError, EmbedderUnavailable, ValueError))
    live.calls, live.fail_next, live.fail_status = 0, 1, 403
    try:
        with pytest.raises(EmbedderAuthError, match=r"answered 403 Forbidden: .*OPSD_API_TOKEN"):
            EmbedderClient(lambda: live.url, TOKEN, 30, 30).correspond({"task_id": "t", "turns": [TURN]})
    finally:
        live.fail_status = 503
    assert live.calls == 1
    live.calls = 0
    with pytest.raises(httpx.HTTPStatusError) as e:
        EmbedderClient(lambda: live.url, TOKEN, 30, 30).correspond({"task_id": "t", "turns": []})
    assert e.value.response.status_code == 422 and live.calls == 1
    assert e.value.response.json()["detail"][0]["loc"] == ["body", "turns"]  # the error's body is readable


def _drip_server(body: bytes, every_s: float, ended: queue.Queue) -> tuple[str, socket.socket]:
    """A loopback HTTP server that answers 200 with `body`, one byte every `every_s` seconds. Each
    connection puts in `ended` how it ended: "cut" (the client hung up mid-body) or "whole"."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed by the test
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn):
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
                for b in body:
                    conn.sendall(bytes([b]))
                    time.sleep(every_s)
            except OSError:  # the client hung up (a send after its close fails): what the test wants
                ended.put("cut")
                return
            ended.put("whole")

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


def test_an_answer_dripping_in_cannot_outlast_the_deadline(caplog):
    # Every read returns within 0.1 s, far under the 0.5 s timeout: only the total tells it is too slow.
    body = b'{"similarity": [[0.5]], "eligible": [[false]], "selected_sources": [[]], "source_weights": [[]]}'
    body += b" " * (200 - len(body))  # trailing JSON whitespace: the whole drip takes 200 * 0.05 = 10 s
    ended: queue.Queue = queue.Queue()
    url, srv = _drip_server(body, every_s=0.05, ended=ended)
    try:
        client = EmbedderClient(lambda: url, TOKEN, timeout_s=0.5, deadline_s=1.0)
        # Attempt 1 is cut at its 0.5 s budget, the backoff sleeps to the deadline, attempt 2 gets the 0.1 s
        # minimum: 2 attempts. Only a machine so loaded that attempt 1 overran the whole deadline makes it 1;
        # never 3 (attempt 2 starts at the deadline).
        gave_up = r"no answer after [12] attempts in 1\.0s; last error: "
        with caplog.at_level(logging.WARNING, "teacher"), pytest.raises(EmbedderUnavailable, match=gave_up) as err:
            client.correspond({"task_id": "t", "turns": [TURN]})
        attempts = int(str(err.value).split("no answer after ", 1)[1].split()[0])
        # Each attempt hung up on the server mid-body: none read the whole drip (unbounded, each would, and
        # the server would say "whole"). The 30 s are a hang guard only: the server sees a close in ~0.1 s.
        assert [ended.get(timeout=30) for _ in range(attempts)] == ["cut"] * attempts
    finally:
        srv.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "teacher"]
    retries = [m for m in logged if "embedder call failed" in m]
    assert len(retries) == attempts - 1
    # Attempt 1 (0.5 s budget, 0.5 s read timeout) was cut by its total, not by a slow read: this is
    # what httpx's own per-read timeouts would never do. Attempt 2's 0.1 s budget is too close to the
    # drip's pace to tell the two apart on a loaded machine, so its error is not checked.
    first = retries[0] if retries else str(err.value)
    assert "the answer was still arriving after 0.5s" in first, first


def test_client_gives_up_at_the_deadline_and_finds_a_late_embedder(live, caplog):
    client = EmbedderClient(closed_port_url, TOKEN, timeout_s=30, deadline_s=1.2)
    t0 = time.monotonic()
    # Refused connections are instant: attempts at 0, 0.5 and 1.2 s (the second backoff is cut to the
    # deadline); a loaded machine can only make it fewer. Without the deadline it would retry forever.
    with caplog.at_level(logging.WARNING, "teacher"), \
            pytest.raises(EmbedderUnavailable, match=r"no answer after [23] attempts in 1.2s"):
        client.correspond({"task_id": "t", "turns": [TURN]})
    waits = backoffs_logged(caplog)
    assert waits and sum(waits) <= 1.2 + 0.05  # no backoff runs past the deadline (0.05: the log's %.1f rounding)
    assert time.monotonic() - t0 >= 1.2  # it gave up at the deadline, not before (a lower bound)
    # The port is looked up before every attempt: not announced yet, then announced.
    answers = iter([None, None, live.url])
    client = EmbedderClient(lambda: next(answers, live.url), TOKEN, timeout_s=30, deadline_s=30)
    assert len(client.correspond({"task_id": "t", "turns": [TURN]})["rho"]) == 1


@pytest.fixture(scope="module")
def scoring(policy_backend, tmp_path_factory):
    """(backend, chat, cfg, group): one real 2-trajectory group to score."""
    env = EnvSection(game_pool=1, seed=1234, max_turns=2)
    cfg = RunConfig.model_validate({"env": env.model_dump(), "rollout": {"group_size": 2, "max_new_tokens": 10},
                                    "teacher": {"thinking_max_new_tokens": 8},
                                    "credit": {"alignopsd": {"similarity_threshold": 0.0, "action_filter_enabled": False}}})
    game = make_games(env, tmp_path_factory.mktemp("games"))[0]
    task = TaskGroup(group_id="g-security", task_id=game.task_id, step=0, policy_version=0, group_size=2,
                     env="textworld", game=game.to_dict(), privileged_info=game.privileged_info(), max_turns=2)
    chat = ChatFormat(policy_backend.tokenizer, "action")
    group, _ = run_group(task, policy_backend, chat, cfg.env, cfg.rollout, cfg.model.max_model_len, seed=3)
    return policy_backend, chat, cfg, group


def test_score_group_falls_back_when_the_embedder_is_down_and_recovers(scoring, live):
    backend, chat, cfg, group = scoring
    before = fallbacks()
    t0 = time.monotonic()
    down, _ = score_group(group, backend, chat, cfg, EmbedderClient(closed_port_url, TOKEN, 5, deadline_s=1.0))
    assert time.monotonic() - t0 >= 1.0 and fallbacks() == before + 1
    assert down.identity_fallback and not down.alpha_M.any() and all(not s for s in down.selected_sources_M)
    for a, b in zip(down.teacher_logprobs_S, down.corrected_logprobs_S):
        assert np.array_equal(a, b)
    # 503 twice, then the real embedder answers: no fallback, the same identity views, matched sources.
    live.fail_next, live.calls = 2, 0
    up, _ = score_group(group, backend, chat, cfg, EmbedderClient(lambda: live.url, TOKEN, 30, deadline_s=30))
    assert live.calls == 3 and fallbacks() == before + 1
    assert not up.identity_fallback and any(up.selected_sources_M)  # gamma_H = 0: siblings match
    for a, b in zip(down.teacher_logprobs_S, up.teacher_logprobs_S):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_refused_token_fails_the_job_instead_of_falling_back(scoring, live):
    backend, chat, cfg, group = scoring
    before = fallbacks()
    with pytest.raises(EmbedderAuthError, match="OPSD_API_TOKEN"):
        score_group(group, backend, chat, cfg, EmbedderClient(lambda: live.url, "wrong-token-0123456789abc", 30, 30))
    assert fallbacks() == before
