"""`opsd inspect RUN_DIR`: a local web page over a run's credit dumps (where the credit went).

data.py reads the run directory (dumps, metrics, tokenizer), views.py turns a
step into what the pages show, app.py serves both as JSON behind a token plus
the static page in static/ (plain HTML, JS and CSS; plots are inline SVG).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from opsd.auth import MIN_TOKEN_CHARS, TOKEN_ENV

HOST = "127.0.0.1"  # loopback only: the pages show a run's trajectories


def choose_token(env: dict[str, str]) -> str:
    """The run's API token (OPSD_API_TOKEN) when set and long enough, else a fresh random one."""
    token = env.get(TOKEN_ENV, "")
    ok = len(token) >= MIN_TOKEN_CHARS and token.isascii() and token.isprintable() and " " not in token
    return token if ok else secrets.token_urlsafe(32)


def serve(run_dir: Path, port: int, token: str, on_ready=print) -> None:
    """Serve `run_dir` on http://127.0.0.1:`port` (0: a free port) until interrupted.

    `on_ready(url)` is called with the URL carrying the token once the socket listens.
    """
    import socket

    import uvicorn

    from opsd.inspect.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))  # bound here so port 0 is known before the URL is printed
    url = f"http://{HOST}:{sock.getsockname()[1]}/?token={token}"
    config = uvicorn.Config(create_app(run_dir, token), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    on_ready(url)
    server.run(sockets=[sock])
