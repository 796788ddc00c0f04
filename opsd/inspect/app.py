"""The `opsd inspect` web app: a JSON API over one run directory and the static pages that draw it.

Routes (all behind the inspect server's own token; see `TokenGate`):
  GET /                        the single page (index.html; pages are #/ fragments: run, step, group, ...)
  GET /static/{name}           app.js, style.css (a fixed list: nothing else is ever read from disk here)
  GET /api/run                 steps with a dump, metrics.jsonl as series
  GET /api/step?step=N         a step's groups (offset, limit)
  GET /api/group?step&group    its trajectories turn by turn (offset, limit: turns)
  GET /api/trajectory?step&group&rollout   every response token with its advantage (offset, limit: turns)
  GET /api/compare?step&group&method&overrides   the step replayed with another method / settings
  GET /api/methods             registered credit methods
Errors are JSON `{"detail": reason}` with a 4xx status (opsd.inspect.data.InspectError), never a 500:
an answer that cannot be written as JSON (a dump's config nested past pydantic's serialisation depth)
is a 422 too.
"""

from __future__ import annotations

import hmac
import json
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.types import ASGIApp, Receive, Scope, Send

from opsd.inspect import data, models, views

COOKIE = "opsd_inspect"  # serve() names it per port: opsd_inspect_<port>
STATIC = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
_DENIED = """<!doctype html><meta charset="utf-8"><title>opsd inspect</title>
<p>This page needs the token printed by <code>opsd inspect</code>: open the URL it printed
(<code>http://127.0.0.1:PORT/?token=...</code>).</p>"""
# Sec-Fetch-Site values /api/ accepts: the page's own fetches (same-origin) and a typed URL or a
# non-browser client (none, or no header). Refused: cross-site, and same-site, which on 127.0.0.1 is
# any other local port (a site ignores the port), whose pages the browser sends our cookie with.
_FETCH_SITES = (b"same-origin", b"none")


class TokenGate:
    """ASGI middleware: a request passes with the token as the cookie `cookie` or `Authorization: Bearer`.

    A request carrying `?token=` with the right token is answered with a redirect to the same path
    (leading slashes and backslashes collapsed to one slash: never a scheme-relative `//host` URL)
    without it and the token set as an HttpOnly, SameSite=Strict, Path=/ cookie (so it leaves the
    address bar and the history). Anything else gets 401: JSON under /api/, a short HTML page
    elsewhere. Tokens are compared in constant time.

    /api/ also refuses (403) what a browser marks as sent by another page: `Sec-Fetch-Site` other
    than same-origin or none, or an `Origin` other than the Host it was sent to. Cookies are not
    isolated by port (RFC 6265), so a page on another 127.0.0.1 port gets ours sent along with its
    requests to us; SameSite=Strict only stops other sites.
    """

    def __init__(self, app: ASGIApp, token: str, cookie: str = COOKIE):
        if not token:
            raise ValueError("TokenGate needs a non-empty token")
        self.app, self._token, self.cookie = app, token.encode(), cookie

    def _ok(self, value: bytes | str | None) -> bool:
        if value is None:
            return False
        v = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(v, self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/api/") and (why := _foreign(scope["headers"])):
            await JSONResponse({"detail": f"refused: {why}"}, 403)(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if given:
            if len(given) == 1 and self._ok(given[0]):
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                # "//evil.example/x" (or /\evil, or /%2F%2Fevil once decoded) as a Location is another host.
                path = "/" + scope["path"].lstrip("/\\")
                resp: Response = RedirectResponse(path + (f"?{rest}" if rest else ""), status_code=303)
                resp.set_cookie(self.cookie, given[0], httponly=True, samesite="strict", path="/")
                await resp(scope, receive, send)
                return
        else:
            headers = [(k, v) for k, v in scope["headers"] if k in (b"authorization", b"cookie")]
            auth = [v for k, v in headers if k == b"authorization"]
            cookie = _cookie(b"; ".join(v for k, v in headers if k == b"cookie"), self.cookie)
            scheme, _, bearer = (auth[0] if len(auth) == 1 else b"").partition(b" ")
            if (scheme.lower() == b"bearer" and self._ok(bearer.strip())) or self._ok(cookie):
                await self.app(scope, receive, send)
                return
        if scope["path"].startswith("/api/"):
            resp = JSONResponse({"detail": "missing or wrong token"}, 401, headers={"WWW-Authenticate": "Bearer"})
        else:
            resp = HTMLResponse(_DENIED, 401)
        await resp(scope, receive, send)


def _foreign(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request reads as sent by another page (TokenGate), or None."""
    site = [v for k, v in headers if k == b"sec-fetch-site"]
    if len(site) > 1 or (site and site[0] not in _FETCH_SITES):
        return f"Sec-Fetch-Site {b', '.join(site).decode('latin-1')!r}: the API answers only this page and non-browser clients"
    origin = [v for k, v in headers if k == b"origin"]
    host = [v for k, v in headers if k == b"host"]
    if origin and (len(origin) > 1 or len(host) != 1 or origin[0] != b"http://" + host[0]):
        return f"Origin {b', '.join(origin).decode('latin-1')!r} is not this server's"
    return None


def _cookie(header: bytes, name: str) -> str | None:
    for part in header.decode("latin-1").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def _answer(fn, *args) -> Response:
    """`fn(*args)` (a pydantic model) as a JSON response. An error the checks in data.py did not foresee (a
    hostile dump's odd corner) is a 422 naming it, never a 500; so is an answer pydantic cannot write (a
    config nested past its serialisation depth), which is why the model is written here, inside the guard,
    and not by FastAPI after the handler returns."""
    try:
        model: BaseModel = fn(*args)
        return Response(model.model_dump_json(), media_type="application/json")
    except data.InspectError:
        raise
    except PydanticSerializationError as exc:
        raise data.InspectError(422, f"malformed dump: the answer cannot be written as JSON ({str(exc)[:300]})") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
        raise data.InspectError(422, f"malformed dump: {type(exc).__name__}: {str(exc)[:300]}") from None


def _static(name: str) -> bytes:
    return resources.files("opsd.inspect").joinpath("static", name).read_bytes()


def create_app(run_dir: Path, token: str, cookie: str = COOKIE, max_dump_bytes: int = data.MAX_DUMP_BYTES) -> ASGIApp:
    """The inspect app for `run_dir`, wrapped in TokenGate(token, cookie); dumps over `max_dump_bytes` get 413.
    Raises ValueError for an empty token."""
    run_dir = Path(run_dir)
    app = FastAPI(title="opsd inspect", docs_url=None, redoc_url=None, openapi_url=None)
    decoder: list[views.Decoder] = []  # loaded on the first trajectory page

    @app.exception_handler(data.InspectError)
    async def _inspect_error(_: Request, exc: data.InspectError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"detail": f"bad request: {where}: {first.get('msg', 'invalid')}"}, 422)

    @app.get("/", response_class=HTMLResponse)
    def index() -> Response:
        return Response(_static("index.html"), media_type="text/html",
                        headers={"Cache-Control": "no-store", "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:"})

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC or name == "index.html":
            raise data.InspectError(404, f"no static file {name!r}")
        return Response(_static(name), media_type=STATIC[name])

    @app.get("/api/run")
    def run_info() -> dict:
        records, bad = data.read_metrics(run_dir)
        return {"name": data.plain_text(run_dir.resolve().name), "steps": data.list_steps(run_dir),
                "metrics": data.metric_series(records), "metric_lines": len(records), "bad_metric_lines": bad}

    @app.get("/api/methods")
    def methods() -> dict:
        from opsd.credit import registered

        return {"methods": registered()}

    @app.get("/api/step", response_model=models.StepView)
    def step(step: int = Query(...), offset: int = 0, limit: int = 100) -> Response:
        return _answer(views.step_view, data.load_step(run_dir, step, max_dump_bytes), offset, limit)

    @app.get("/api/group", response_model=models.GroupView)
    def group(step: int, group: str, offset: int = 0, limit: int = 50) -> Response:
        return _answer(views.group_view, data.load_step(run_dir, step, max_dump_bytes), group, offset, limit)

    @app.get("/api/trajectory", response_model=models.TrajectoryView)
    def trajectory(step: int, group: str, rollout: str, offset: int = 0, limit: int = 20) -> Response:
        s = data.load_step(run_dir, step, max_dump_bytes)
        if not decoder:
            decoder.append(views.Decoder(run_dir))
        return _answer(views.trajectory_view, s, group, rollout, decoder[0], offset, limit)

    @app.get("/api/compare", response_model=models.CompareView)
    def compare(step: int, group: str, method: str, overrides: str = "{}") -> Response:
        try:
            over = json.loads(overrides)
        except (ValueError, RecursionError):
            raise data.InspectError(422, "overrides must be a JSON object, e.g. {\"agentopsd\": {\"gamma\": 0.9}}") from None
        if not isinstance(over, dict):
            raise data.InspectError(422, "overrides must be a JSON object")
        return _answer(views.compare_view, data.load_step(run_dir, step, max_dump_bytes), group, method, over)

    return TokenGate(app, token, cookie)
