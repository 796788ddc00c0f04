"""Published weights over the network: rollout and teacher fetch versions from the trainer (weights.transport http).

The trainer serves its published files (services/trainer/weights_api.py, bearer token OPSD_API_TOKEN):
`GET /weights` lists the versions published now, `GET|HEAD /weights/<file name>` serves one file with
Range support and its content digest (`opsd.weights.DIGEST_KEY`) in `X-Opsd-Digest` and the ETag.

`HttpSource` answers what `opsd.weights.ensure_version` asks a source (digest, versions, ref); the ref a
backend loads is the file's URL, which it opens with `open_url`: a stream that resumes an interrupted
transfer where it stopped, of the SAME version only. Needs the token only from the environment, so an
engine's worker processes (which inherit it) can open a ref themselves.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import time
from collections.abc import Callable
import urllib.parse
from pathlib import Path

import httpx

from opsd.auth import api_token
from opsd.config import base_url
from opsd.service import read_port, service_url
from opsd.weights import FileSource, ema_path, weights_path

log = logging.getLogger(__name__)
URL_ENV = "OPSD_WEIGHTS_URL"  # the trainer's base URL (compose, k8s): wins over weights.url
TRANSPORT_ENV = "OPSD_WEIGHTS_TRANSPORT"  # file | http (compose, k8s: with the volumes they mount): wins over weights.transport
DIGEST_HEADER = "X-Opsd-Digest"
RETRIES = 5  # reconnects of one transfer (and of a request) before giving up
BACKOFF_FIRST_S = 0.5  # doubled after each failed attempt
READ_TIMEOUT_S = 30.0  # a transfer with no byte for this long is resumed
TIMEOUT = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)  # the listing and HEAD requests


class WeightsTransferError(RuntimeError):
    """A weights file could not be fetched whole: the trainer refused the token, answered what a weights
    endpoint never answers, rewrote the version mid-transfer (another digest), or stayed unreachable
    through every retry. The caller's backend keeps the weights it held; the job is retried later."""


class TokenRefusedError(WeightsTransferError):
    """The trainer answered 401/403: this role's OPSD_API_TOKEN is not the run's (no retry can fix it)."""


def _send(client: httpx.Client, url: str, method: str = "GET", headers: dict[str, str] | None = None,
          stream: bool = False, retries: int = RETRIES, backoff_s: float = BACKOFF_FIRST_S) -> httpx.Response:
    """One request with the bearer token, retried through connection failures (`retries` times, doubling
    backoff). Raises TokenRefusedError on 401/403, WeightsTransferError when every attempt failed."""
    delay = backoff_s
    for attempt in range(retries + 1):
        try:
            request = client.build_request(method, url, headers={"Authorization": f"Bearer {api_token()}",
                                                                 "Accept-Encoding": "identity", **(headers or {})})
            r = client.send(request, stream=stream)
            break
        except httpx.TransportError as e:
            if attempt == retries:
                raise WeightsTransferError(f"{method} {url}: trainer unreachable after {retries + 1} attempts: {e}") from e
            log.warning("%s %s failed (%s); retrying in %.1f s", method, url, e, delay)
            time.sleep(delay)
            delay *= 2
    if r.status_code in (401, 403):
        r.close()
        raise TokenRefusedError(f"{url}: the trainer refused the API token ({r.status_code}): every role of a run "
                                f"needs the same OPSD_API_TOKEN")
    return r


class UrlStream(io.RawIOBase):
    """A published weights file read over HTTP, front to back (`open_url`).

    `read(n)` returns exactly n bytes unless the file ends first (b"" at the
    end). An interrupted transfer (connection reset, a body cut short, no
    byte for `timeout_s` seconds) is resumed with `Range: bytes=<offset>-`
    and `If-Range: <the first answer's ETag>`, up to `retries` times in a
    row without a byte received (a doubling backoff from `backoff_s`; a
    transfer that progresses keeps going); a resumed answer must be 206 for the
    same offset, size and digest, else the version was rewritten and
    WeightsTransferError is raised (no byte of two versions is ever
    returned). Attributes: size (bytes), digest (the X-Opsd-Digest, None
    when the file records none), url.

    The body is read with the standard library's http.client straight into
    the caller's buffer (`readinto` on the socket): httpx's 64 KiB reads
    through h11 moved a weights file at a third of that rate on our machines.
    """

    def __init__(self, url: str, retries: int = RETRIES, backoff_s: float = BACKOFF_FIRST_S,
                 timeout_s: float = READ_TIMEOUT_S):
        super().__init__()
        self.url, self.retries, self.backoff_s, self.timeout_s = url, retries, backoff_s, timeout_s
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WeightsTransferError(f"{url}: not an http(s) URL")
        self._parts = parts
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        self._offset = 0  # bytes received so far
        self._etag: str | None = None
        self.size = -1
        self.digest: str | None = None
        try:
            self._open_first()
        except BaseException:
            self.close()
            raise

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset

    def read(self, n: int = -1) -> bytearray:
        """Exactly `n` bytes (all the rest for n < 0) unless the file ends first. Raises WeightsTransferError
        (see the class), FileNotFoundError when the file was deleted (pruned) before a resume."""
        want = self.size - self._offset if n is None or n < 0 else min(n, self.size - self._offset)
        buf = bytearray(want)
        got = self.readinto(buf)
        return buf if got == want else buf[:got]  # a bytearray: bytes-like, without a copy of a large read

    def readinto(self, b) -> int:
        """Fill `b` (exactly, unless the file ends first); returns the bytes written. Raises as `read`."""
        view = memoryview(b).cast("B")
        want = min(len(view), self.size - self._offset)
        got, failures, delay = 0, 0, self.backoff_s
        while got < want:
            try:
                k = self._response.readinto(view[got:want]) if self._response is not None else 0
                if not k:  # http.client returns 0 when the connection closed before Content-Length bytes
                    raise ConnectionError(f"body ended at byte {self._offset} of {self.size}")
                got += k
                self._offset += k
                failures, delay = 0, self.backoff_s
            except (OSError, http.client.HTTPException) as e:
                failures += 1
                if failures > self.retries:
                    raise WeightsTransferError(f"{self.url}: transfer interrupted at byte {self._offset} of {self.size} "
                                               f"{failures} times in a row; last: {e}") from e
                log.warning("%s: transfer interrupted at byte %d of %d (%s); resuming in %.1f s", self.url,
                            self._offset, self.size, e, delay)
                time.sleep(delay)
                delay *= 2
                self._resume()
        return got

    def close(self) -> None:
        if not self.closed and self._conn is not None:
            self._conn.close()
        super().close()

    def _request(self, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET the URL on a new connection; raises OSError / HTTPException for a connection failure,
        TokenRefusedError for 401/403, FileNotFoundError for 404."""
        if self._conn is not None:
            self._conn.close()
        p = self._parts
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(p.hostname, p.port, timeout=self.timeout_s)
        self._response = None
        path = p.path + (f"?{p.query}" if p.query else "")
        self._conn.request("GET", path, headers={"Authorization": f"Bearer {api_token()}",
                                                 "Accept-Encoding": "identity", **headers})
        r = self._conn.getresponse()
        if r.status in (401, 403):
            raise TokenRefusedError(f"{self.url}: the trainer refused the API token ({r.status}): every role of a "
                                    "run needs the same OPSD_API_TOKEN")
        if r.status == 404:
            raise FileNotFoundError(f"{self.url}: not published (404)")
        return r

    def _open_first(self) -> None:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                r = self._request({})
                break
            except (OSError, http.client.HTTPException) as e:
                if isinstance(e, FileNotFoundError):
                    raise
                if attempt == self.retries:
                    raise WeightsTransferError(f"GET {self.url}: trainer unreachable after {self.retries + 1} "
                                               f"attempts: {e}") from e
                log.warning("GET %s failed (%s); retrying in %.1f s", self.url, e, delay)
                time.sleep(delay)
                delay *= 2
        length = r.getheader("content-length")
        if r.status != 200 or length is None:
            raise WeightsTransferError(f"{self.url}: unexpected answer {r.status} (200 with a length expected)")
        self.size, self._etag, self.digest = int(length), r.getheader("etag"), r.getheader(DIGEST_HEADER)
        if not self._etag:
            raise WeightsTransferError(f"{self.url}: the answer has no ETag: a transfer could not resume safely")
        self._response = r

    def _resume(self) -> None:
        """Ask for the rest from the offset reached. A connection failure leaves no response (the caller's next
        attempt fails at once and counts); a refused token, a pruned or a rewritten version raise."""
        try:
            r = self._request({"Range": f"bytes={self._offset}-", "If-Range": self._etag})
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, FileNotFoundError):
                raise
            return
        expected = f"bytes {self._offset}-{self.size - 1}/{self.size}"
        digest, etag = r.getheader(DIGEST_HEADER), r.getheader("etag")
        # The trainer answers 200 (the whole file) when If-Range names another ETag: the version was rewritten. A
        # 206 means the ETag matched; one whose headers disagree was cut mid-header: one more failed attempt.
        if r.status == 200:
            raise WeightsTransferError(
                f"{self.url}: the version was rewritten while it was being fetched (resume at byte {self._offset} "
                f"answered 200 with digest {digest}, was {self.digest}): load it again")
        if r.status != 206 or r.getheader("content-range") != expected or etag != self._etag or digest != self.digest:
            log.warning("%s: resume at byte %d answered %d %s: retrying", self.url, self._offset, r.status,
                        r.getheader("content-range"))
            return
        self._response = r


def open_url(url: str, retries: int = RETRIES, backoff_s: float = BACKOFF_FIRST_S) -> UrlStream:
    """Open a weights file the trainer serves (`GET <url>` with the bearer token from OPSD_API_TOKEN) as a
    binary stream read front to back; see `UrlStream` for resuming and what `read(n)` returns.

    Raises FileNotFoundError (404: not published, or already pruned), WeightsTransferError (token refused,
    trainer unreachable after `retries` reconnects, a non-weights answer), RuntimeError from `api_token`
    when OPSD_API_TOKEN is unset or unusable. Close it (or use `with`) to free the connection.
    """
    return UrlStream(url, retries, backoff_s)


class HttpSource:
    """Published versions as the trainer serves them (weights.transport http); a source for
    `opsd.weights.ensure_version` / `VersionGate`, like `opsd.weights.FileSource`.

    base_url(): the trainer's base URL, or None while it is unknown (looked up on each call: a trainer that
    restarts may come back on another port); ema: the moving-average files (teacher.version ema:D).
    """

    def __init__(self, base_url: Callable[[], str | None], ema: bool = False):
        self.base_url, self.path_of = base_url, ema_path if ema else weights_path
        self._client = httpx.Client(timeout=TIMEOUT)

    def _base(self) -> str:
        base = self.base_url()
        if base is None:  # the trainer has not written its port file yet: nothing is published yet
            raise FileNotFoundError("the trainer's weights URL is not known yet (no OPSD_WEIGHTS_URL, weights.url "
                                    "or trainer port file)")
        return base.rstrip("/")

    def ref(self, version: int) -> str:
        """The URL of `version`'s file (what `open_url` opens). Raises FileNotFoundError while the URL is unknown."""
        return f"{self._base()}/weights/{self.path_of(Path('.'), version).name}"

    def digest(self, version: int) -> str | None:
        """The digest of `version` as published now (HEAD); None when not published, recorded nowhere, the URL is
        unknown or the trainer is unreachable: no evidence of other content. Raises WeightsTransferError for a
        refused token (no retry can fix it)."""
        try:
            # One attempt: VersionGate asks under its lock, and an unreachable trainer only means "no evidence".
            r = _send(self._client, self.ref(version), "HEAD", retries=0)
        except TokenRefusedError:
            raise
        except (FileNotFoundError, WeightsTransferError):
            return None
        return r.headers.get(DIGEST_HEADER) if r.status_code == 200 else None

    def versions(self) -> list[int]:
        """The policy versions the trainer publishes now, ascending (GET /weights). Raises FileNotFoundError
        while the URL is unknown, WeightsTransferError when the trainer cannot be asked."""
        url = f"{self._base()}/weights"
        r = _send(self._client, url)
        if r.status_code != 200:
            raise WeightsTransferError(f"GET {url}: unexpected answer {r.status_code}")
        return [int(v) for v in r.json()["policy"]]


def weights_url(cfg, run_dir: Path) -> str | None:
    """The trainer's base URL: OPSD_WEIGHTS_URL, else weights.url, else from the trainer's port file in
    `run_dir` (None while there is none, or it cannot be read)."""
    if os.environ.get(URL_ENV):
        return base_url(os.environ[URL_ENV], URL_ENV)  # checked at start too (`weight_source`): a clear line there
    if cfg.weights.url:
        return cfg.weights.url
    try:
        info = read_port(Path(run_dir), "trainer")
        return service_url(info) if info else None
    except (OSError, ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        log.warning("unreadable trainer port file (%s)", e)
        return None


def weights_transport(cfg) -> str:
    """"file" or "http": OPSD_WEIGHTS_TRANSPORT when set (a deployment that mounts no weights volume on the
    workers says so beside its volumes, whatever config file it runs), else weights.transport of `cfg` (a
    RunConfig). Raises ValueError naming the variable for another value."""
    value = os.environ.get(TRANSPORT_ENV, "").strip() or cfg.weights.transport
    if value not in ("file", "http"):
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: expected file or http")
    return value


def weight_source(cfg, run_dir: Path, ema: bool = False) -> FileSource | HttpSource:
    """Where rollout and teacher take published versions from, per `weights_transport(cfg)` (cfg: a RunConfig):
    the run dir's files, or the trainer over HTTP. ema: the moving-average files (teacher.version ema:D).
    Raises ValueError for a bad OPSD_WEIGHTS_TRANSPORT or OPSD_WEIGHTS_URL, RuntimeError (`api_token`) for http without a usable
    OPSD_API_TOKEN: at start, not at the first load."""
    if weights_transport(cfg) == "http":
        api_token()
        if os.environ.get(URL_ENV):
            base_url(os.environ[URL_ENV], URL_ENV)
        return HttpSource(lambda: weights_url(cfg, run_dir), ema)
    return FileSource(run_dir, ema_path if ema else weights_path)
