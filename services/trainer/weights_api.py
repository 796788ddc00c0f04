"""The trainer's published weights over HTTP (weights.transport http; the client is opsd/weights_http.py).

On the trainer's /health + /metrics app, behind opsd.auth.ApiGuard (bearer token required):
- `GET /weights`: {"policy": [versions], "ema": [versions]}, the files published now, ascending: a worker
  tells "pruned, too stale" from "not published yet" from it, as it does from the run dir's listing.
- `GET /weights/<name>` (name: policy-vNNNNN.safetensors or ema-vNNNNN.safetensors, nothing else): the file,
  with `ETag` and `X-Opsd-Digest` carrying the digest it records (`opsd.weights.DIGEST_KEY`), and one byte
  range (`Range: bytes=a-` / `bytes=a-b`, honoured unless `If-Range` names another ETag: then the whole file,
  200). `HEAD` answers the same headers without the body (the digest alone).

Starlette's FileResponse also serves ranges, but it stats the path and then opens it by name: a version
renamed into place in between (a resumed trainer rewriting it) would be served with the other file's length
and headers. Here the file is opened once and every header and byte comes from that descriptor (a file pruned
while it is being served stays readable until it is closed).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import anyio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from opsd.auth import ApiGuard
from opsd.weights import DIGEST_KEY, published_versions

ROLE = "trainer"
FILE_NAME = re.compile(r"(policy|ema)-v(\d{5,9})\.safetensors")
CHUNK_BYTES = 4 << 20
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own cap on its JSON header
MAX_REQUEST_BYTES = 1 << 10  # every route is a GET: no request carries a body
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def fd_digest(fd: int) -> str | None:
    """The digest (DIGEST_KEY) a safetensors file records, read from the open descriptor `fd`'s header; None when
    it records none or the header does not parse."""
    try:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > MAX_HEADER_BYTES:
            return None
        meta = json.loads(os.pread(fd, n, 8)).get("__metadata__") or {}
        digest = meta.get(DIGEST_KEY)
        return digest if isinstance(digest, str) else None
    except (struct.error, ValueError, AttributeError, OSError):
        return None


def _byte_range(request: Request, etag: str, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of the one range asked for, or None for the whole file (no Range, an If-Range of
    another version, several ranges). Raises HTTPException 416 for a range outside the file."""
    asked = request.headers.get("range")
    if asked is None or request.headers.get("if-range", etag) != etag:
        return None
    m = _RANGE.fullmatch(asked.strip())
    if m is None:  # several ranges or another unit: RFC 9110 lets a server answer with the whole file
        return None
    start, end = int(m.group(1)), int(m.group(2)) + 1 if m.group(2) else size
    if start >= size or end <= start:
        raise HTTPException(416, f"range {asked} outside a file of {size} bytes", {"Content-Range": f"bytes */{size}"})
    return start, min(end, size)


class _FdResponse(StreamingResponse):
    """Bytes [start, end) of the open descriptor `fd`, closed when the response ends (sent, failed, or the
    client gone)."""

    def __init__(self, fd: int, start: int, end: int, status_code: int, headers: dict[str, str]):
        self.fd = fd

        async def chunks():
            pos = start
            while pos < end:
                chunk = await anyio.to_thread.run_sync(os.pread, fd, min(CHUNK_BYTES, end - pos), pos)
                if not chunk:  # cannot happen for a published file (never written again): end short, loudly
                    raise OSError(f"weights file ended at byte {pos} of {end}")
                pos += len(chunk)
                yield chunk

        super().__init__(chunks(), status_code, headers, media_type="application/octet-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self.fd)


def add_weights_routes(app: FastAPI, run_dir: Path) -> None:
    """Add GET /weights and GET|HEAD /weights/{name} over `<run_dir>/weights/` to `app` (see the module)."""
    folder = Path(run_dir) / "weights"

    @app.get("/weights")
    def _listing() -> dict[str, list[int]]:
        names = os.listdir(folder) if folder.is_dir() else []
        ema = sorted(int(m.group(2)) for n in names if (m := FILE_NAME.fullmatch(n)) and m.group(1) == "ema")
        return {"policy": published_versions(run_dir), "ema": ema}

    @app.api_route("/weights/{name}", methods=["GET", "HEAD"])
    def _file(name: str, request: Request) -> Response:
        if not FILE_NAME.fullmatch(name):
            raise HTTPException(404, "not a published weights file name (policy-vNNNNN.safetensors, ema-vNNNNN.safetensors)")
        try:
            fd = os.open(folder / name, os.O_RDONLY)
        except FileNotFoundError:
            raise HTTPException(404, f"{name} is not published (not yet, or pruned)") from None
        try:
            st = os.fstat(fd)
            digest = fd_digest(fd)
            # Strong validator of these exact bytes: the digest, else the inode and time of the file renamed in.
            etag = f'"{digest}"' if digest else f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'
            span = _byte_range(request, etag, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        start, end = span or (0, st.st_size)
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Length": str(end - start)}
        if digest:
            headers["X-Opsd-Digest"] = digest
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
        if request.method == "HEAD":
            os.close(fd)
            return Response(status_code=206 if span else 200, headers=headers)
        return _FdResponse(fd, start, end, 206 if span else 200, headers)


def weights_app(run_dir: Path, token: str) -> FastAPI:
    """The trainer's app with the weights routes behind ApiGuard (`token`: the run's OPSD_API_TOKEN; /health and
    /metrics, added by RoleProcess.serve, stay open). Raises ValueError for an empty token."""
    if not token:
        raise ValueError("serving weights needs a non-empty API token")
    app = FastAPI(title=f"opsd {ROLE}", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiGuard, role=ROLE, token=token, max_body_bytes=MAX_REQUEST_BYTES)
    add_weights_routes(app, run_dir)
    return app
