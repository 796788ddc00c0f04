"""`opsd inspect RUN_DIR`: a local web page over a run's credit dumps (where the credit went).

data.py reads the run directory (dumps, metrics, tokenizer), views.py turns a
step into what the pages show, app.py serves both as JSON behind a token plus
the static page in static/ (plain HTML, JS and CSS; plots are inline SVG).
"""

from __future__ import annotations

import secrets
from pathlib import Path

HOST = "127.0.0.1"  # loopback only: the pages show a run's trajectories


def serve(run_dir: Path, port: int, on_ready=print, max_dump_mib: int | None = None) -> None:
    """Serve `run_dir` on http://127.0.0.1:`port` (0: a free port) until interrupted.

    The pages sit behind a token of this process's own (secrets.token_urlsafe(32)), never the run's
    OPSD_API_TOKEN: the browser keeps it in the cookie `opsd_inspect_<port>`, and a cookie is sent to
    every port of 127.0.0.1, so its value must open these pages and nothing else.
    Dumps over `max_dump_mib` MiB (default: data.MAX_DUMP_BYTES) are refused (413): a parse holds ~9x the file in memory.
    `on_ready(url)` is called with the URL carrying the token once the socket listens.
    Raises OSError when the port cannot be bound.
    """
    import socket

    import uvicorn

    from opsd.inspect import data
    from opsd.inspect.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))  # bound here so port 0 is known before the URL is printed
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(32)
    app = create_app(run_dir, token, cookie=f"opsd_inspect_{port}",
                     max_dump_bytes=data.MAX_DUMP_BYTES if max_dump_mib is None else max_dump_mib << 20)  # one per server: two runs' tabs keep both
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    on_ready(f"http://{HOST}:{port}/?token={token}")
    server.run(sockets=[sock])
