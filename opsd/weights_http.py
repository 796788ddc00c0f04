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

import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from opsd.auth import api_token
from opsd.service import read_port, service_url
from opsd.weights import FileSource, ema_path, weights_path

log = logging.getLogger(__name__)
URL_ENV = "OPSD_WEIGHTS_URL"  # the trainer's base URL (compose, k8s): wins over weights.url
TRANSPORT_ENV = "OPSD_WEIGHTS_TRANSPORT"  # file | http (compose, k8s: with the volumes they mount): wins over weights.transport
DIGEST_HEADER = "X-Opsd-Digest"
CHUNK_BYTES = 1 << 20
RETRIES = 5  # reconnects of one transfer (and of a request) before giving up
BACKOFF_FIRST_S = 0.5  # doubled after each failed attempt
TIMEOUT = httpx.Timeout(30.0, connect=10.0)  # read: seconds without a byte


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
    byte for TIMEOUT's read seconds) is resumed with `Range: bytes=<offset>-`
    and `If-Range: <the first answer's ETag>`, up to `retries` times in a
    row without a byte received (a doubling backoff from `backoff_s`; a
    transfer that progresses keeps going); a resumed answer must be 206 for the
    same offset, size and digest, else the version was rewritten and
    WeightsTransferError is raised (no byte of two versions is ever
    returned). Attributes: size (bytes), digest (the X-Opsd-Digest, None
    when the file records none), url.
    """

    def __init__(self, url: str, retries: int = RETRIES, backoff_s: float = BACKOFF_FIRST_S,
                 timeout: httpx.Timeout = TIMEOUT):
        super().__init__()
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self._client = httpx.Client(timeout=timeout)
        self._response: httpx.Response | None = None
        self._chunks = None
        self._buffer = b""
        self._offset = 0  # bytes returned by read, plus those in _buffer
        self._etag: str | None = None
        self.size = -1
        self.digest: str | None = None
        try:
            self._connect(first=True)
        except BaseException:
            self.close()
            raise

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset - len(self._buffer)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read(self, n: int = -1) -> bytes:
        """Exactly `n` bytes (all the rest for n < 0) unless the file ends first. Raises WeightsTransferError
        (see the class), FileNotFoundError when the file was deleted (pruned) before a resume."""
        want = self.size - self.tell() if n is None or n < 0 else n
        parts, have = [self._buffer], len(self._buffer)
        while have < want and self._offset < self.size:
            parts.append(self._next_chunk())
            have += len(parts[-1])
        data = b"".join(parts)  # one copy of a large read, not one per chunk
        self._buffer = data[want:]
        return data[:want]

    def close(self) -> None:
        if not self.closed:
            if self._response is not None:
                self._response.close()
            self._client.close()
        super().close()

    def _next_chunk(self) -> bytes:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                chunk = next(self._chunks, b"")
                if not chunk:  # the body ended: short when the server closed early without the framing noticing
                    raise httpx.RemoteProtocolError(f"body ended at byte {self._offset} of {self.size}")
                self._offset += len(chunk)
                return chunk
            except httpx.TransportError as e:
                if attempt == self.retries:
                    raise WeightsTransferError(f"{self.url}: transfer interrupted at byte {self._offset} of {self.size} "
                                               f"{self.retries + 1} times in a row; last: {e}") from e
                log.warning("%s: transfer interrupted at byte %d of %d (%s); resuming in %.1f s", self.url,
                            self._offset, self.size, e, delay)
                time.sleep(delay)
                delay *= 2
                self._reconnect()
        raise AssertionError("unreachable")

    def _reconnect(self) -> None:
        """Ask for the rest from _offset; a connection failure here counts as the caller's next attempt."""
        try:
            self._connect(first=False)
        except WeightsTransferError as e:
            if not isinstance(e.__cause__, httpx.TransportError):  # refused, rewritten: final
                raise
            self._chunks = iter(())  # the caller's next attempt sees an empty body and reconnects again

    def _connect(self, first: bool) -> None:
        if self._response is not None:
            self._response.close()
        if first:
            r = _send(self._client, self.url, stream=True, retries=self.retries, backoff_s=self.backoff_s)
        else:
            r = _send(self._client, self.url, headers={"Range": f"bytes={self._offset}-", "If-Range": self._etag},
                      stream=True, retries=0)
        self._response = r
        if r.status_code == 404:
            raise FileNotFoundError(f"{self.url}: not published (404)")
        digest = r.headers.get(DIGEST_HEADER)
        if first:
            if r.status_code != 200 or "content-length" not in r.headers:
                raise WeightsTransferError(f"{self.url}: unexpected answer {r.status_code} (200 with a length expected)")
            self.size, self._etag, self.digest = int(r.headers["content-length"]), r.headers.get("etag"), digest
            if not self._etag:
                raise WeightsTransferError(f"{self.url}: the answer has no ETag: a transfer could not resume safely")
        else:
            expected = f"bytes {self._offset}-{self.size - 1}/{self.size}"
            if r.status_code != 206 or r.headers.get("content-range") != expected or digest != self.digest \
                    or r.headers.get("etag") != self._etag:
                raise WeightsTransferError(
                    f"{self.url}: the version was rewritten while it was being fetched (resume at byte {self._offset} "
                    f"answered {r.status_code}, digest {digest}, was {self.digest}): load it again")
        self._chunks = r.iter_raw(CHUNK_BYTES)


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
            r = _send(self._client, self.ref(version), "HEAD")
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
    url = os.environ.get(URL_ENV) or cfg.weights.url
    if url:
        return url
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
    Raises ValueError for a bad OPSD_WEIGHTS_TRANSPORT, RuntimeError (`api_token`) for http without a usable
    OPSD_API_TOKEN: at start, not at the first load."""
    if weights_transport(cfg) == "http":
        api_token()
        return HttpSource(lambda: weights_url(cfg, run_dir), ema)
    return FileSource(run_dir, ema_path if ema else weights_path)
