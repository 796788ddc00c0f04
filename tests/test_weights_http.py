"""Published weights over HTTP (weights.transport http): the trainer's routes (services/trainer/weights_api.py)
and the workers' client and source (opsd/weights_http.py), on a real uvicorn server, real weight files written
by HFBackend.save_weights of the packaged tiny-random model, a real token, and a real TCP proxy that cuts
connections mid-transfer.
"""

from __future__ import annotations

import re
import socket
import threading

import httpx
import pytest
import torch

from opsd.config import ModelSection, RunConfig, config_hash, hashed_config
from opsd.models.hf import HFBackend
from opsd.service import bind_socket, serve_in_thread, write_port
from opsd.weights import (FileSource, StalePolicyError, VersionGate, ema_path, ensure_version, published_digest,
                          weights_path)
from opsd.weights_http import (HttpSource, TokenRefusedError, WeightsTransferError, open_url, weight_source,
                               weights_transport, weights_url)
from opsd.weights_io import WeightsError
from services.trainer.weights_api import weights_app

TOKEN = "w" * 32


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("OPSD_API_TOKEN", TOKEN)
    monkeypatch.delenv("OPSD_WEIGHTS_URL", raising=False)
    monkeypatch.delenv("OPSD_WEIGHTS_TRANSPORT", raising=False)


@pytest.fixture(scope="module")
def trainer():
    return HFBackend(ModelSection(name="tiny-random"))


@pytest.fixture
def served(tmp_path):
    """(run_dir, base URL) of the trainer's weights app serving tmp_path/weights on a free loopback port."""
    sock = bind_socket("127.0.0.1", 0)
    server = serve_in_thread(weights_app(tmp_path, TOKEN), sock)
    yield tmp_path, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _publish(trainer, run_dir, version: int, seed: int | None = None, path_of=weights_path):
    """Write version `version` as the trainer does (other weights for each seed); returns the file's bytes."""
    if seed is not None:
        _perturb(trainer.model, seed)
    path = path_of(run_dir, version)
    trainer.save_weights(path)
    return path.read_bytes()


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class CuttingProxy:
    """A TCP proxy in front of `upstream` (host, port) that closes the client's connection number i (from 0)
    after passing `cuts[i]` bytes of the answer (None: never). Records each request's first bytes."""

    def __init__(self, upstream: tuple[str, int], cuts: list[int | None]):
        self.upstream, self.cuts, self.requests = upstream, cuts, []
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            i = len(self.requests)
            self.requests.append(b"")
            cut = self.cuts[i] if i < len(self.cuts) else None
            threading.Thread(target=self._pipe, args=(client, i, cut), daemon=True).start()

    def _pipe(self, client: socket.socket, i: int, cut: int | None) -> None:
        up = socket.create_connection(self.upstream)

        def upward():
            try:
                while data := client.recv(65536):
                    self.requests[i] += data
                    up.sendall(data)
            except OSError:
                pass

        threading.Thread(target=upward, daemon=True).start()
        sent = 0
        try:
            while data := up.recv(65536):
                if cut is not None and sent + len(data) >= cut:
                    client.sendall(data[: cut - sent])
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:  # the client left first
                pass
            client.close()
            up.close()

    def close(self) -> None:
        self.sock.close()


def _proxy(base: str, cuts) -> CuttingProxy:
    host, port = base.removeprefix("http://").split(":")
    return CuttingProxy((host, int(port)), cuts)


# ================================================================ the trainer's routes


def test_routes_need_the_token_and_serve_exact_bytes_digests_and_ranges(served, trainer):
    run_dir, base = served
    data = _publish(trainer, run_dir, 1)
    _publish(trainer, run_dir, 1, path_of=ema_path)
    _publish(trainer, run_dir, 3)
    digest = published_digest(weights_path(run_dir, 1))
    url = f"{base}/weights/policy-v00001.safetensors"
    for bad in ({}, _auth("x" * 32), {"Authorization": TOKEN}):
        assert httpx.get(url, headers=bad).status_code == 401
        assert httpx.get(f"{base}/weights", headers=bad).status_code == 401
    assert httpx.get(f"{base}/weights", headers=_auth()).json() == {"policy": [1, 3], "ema": [1]}
    for name in ("policy-v00002.safetensors", "policy-v1.safetensors", "..%2Fconfig.yaml", "%2E%2E", "checkpoint",
                 "policy-v00001.safetensors.tmp", "ema-v00003.safetensors"):
        assert httpx.get(f"{base}/weights/{name}", headers=_auth()).status_code == 404, name
    r = httpx.get(url, headers=_auth())
    assert r.status_code == 200 and r.content == data and len(data) > 1 << 20
    assert r.headers["x-opsd-digest"] == digest and r.headers["etag"] == f'"{digest}"'
    head = httpx.head(url, headers=_auth())
    assert head.status_code == 200 and head.content == b"" and head.headers["x-opsd-digest"] == digest
    assert int(head.headers["content-length"]) == len(data)
    part = httpx.get(url, headers={**_auth(), "Range": "bytes=1000-", "If-Range": f'"{digest}"'})
    assert part.status_code == 206 and part.content == data[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    part = httpx.get(url, headers={**_auth(), "Range": "bytes=5-9"})
    assert part.status_code == 206 and part.content == data[5:10]
    # If-Range of another version: the whole (current) file, never a range of it.
    other = httpx.get(url, headers={**_auth(), "Range": "bytes=1000-", "If-Range": '"' + "0" * 64 + '"'})
    assert other.status_code == 200 and other.content == data
    assert httpx.get(url, headers={**_auth(), "Range": f"bytes={len(data)}-"}).status_code == 416
    assert httpx.get(f"{base}/weights/ema-v00001.safetensors", headers=_auth()).content == \
        ema_path(run_dir, 1).read_bytes()


def test_a_file_rewritten_while_served_is_served_whole_from_the_version_opened(served, trainer):
    run_dir, base = served
    old = _publish(trainer, run_dir, 2)
    with open_url(f"{base}/weights/policy-v00002.safetensors") as stream:
        first = stream.read(10)
        new = _publish(trainer, run_dir, 2, seed=1)  # a resumed trainer renames another v2 into place
        assert new != old
        assert first + stream.read() == old and stream.digest != published_digest(weights_path(run_dir, 2))


# ================================================================ the client


def test_open_url_reads_exact_sizes_and_the_whole_file(served, trainer):
    run_dir, base = served
    data = _publish(trainer, run_dir, 1)
    with open_url(f"{base}/weights/policy-v00001.safetensors") as stream:
        assert stream.size == len(data) and stream.digest == published_digest(weights_path(run_dir, 1))
        parts, sizes = [], [8, 1, 3 << 20, 7, 1 << 20]
        for n in sizes:
            parts.append(stream.read(n))
            assert len(parts[-1]) == n  # exactly n: a read spans the server's chunks
        parts.append(stream.read(len(data)))  # more than is left: the rest
        assert stream.read(10) == b""
    assert b"".join(parts) == data
    with pytest.raises(FileNotFoundError):
        open_url(f"{base}/weights/policy-v00009.safetensors")


def test_an_empty_file_served_is_named_empty(served, trainer):
    """A zero-byte version over http: its Content-Length says so before a byte is read (issue 37)."""
    run_dir, base = served
    path = weights_path(run_dir, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    url = f"{base}/weights/{path.name}"
    version = trainer.policy_version
    with pytest.raises(WeightsError, match=re.escape(f"{url}: the file is empty (0 bytes)")):
        trainer.load_weights(url, 2)
    assert trainer.policy_version == version


def test_a_dropped_transfer_resumes_with_a_range_and_yields_exactly_the_file(served, trainer):
    run_dir, base = served
    data = _publish(trainer, run_dir, 1)
    proxy = _proxy(base, [len(data) // 3, len(data) // 2])  # two drops mid-body, then a whole connection
    try:
        with open_url(f"{proxy.url}/weights/policy-v00001.safetensors", backoff_s=0.01) as stream:
            got = stream.read()
    finally:
        proxy.close()
    assert got == data
    assert len(proxy.requests) == 3
    assert b"range: bytes=" not in proxy.requests[0].lower()
    offsets = [int(re.search(rb"range: bytes=(\d+)-", r.lower()).group(1)) for r in proxy.requests[1:]]
    assert 0 < offsets[0] < len(data) // 3 and offsets[0] < offsets[1] < len(data)  # resumed, not restarted
    assert all(f'if-range: "{stream.digest}"'.encode() in r.lower() for r in proxy.requests[1:])


def test_a_version_rewritten_between_the_drop_and_the_resume_raises_and_never_mixes(served, trainer):
    run_dir, base = served
    old = _publish(trainer, run_dir, 1, seed=2)
    proxy = _proxy(base, [len(old) // 2])
    try:
        stream = open_url(f"{proxy.url}/weights/policy-v00001.safetensors", backoff_s=0.01)
        head = stream.read(100)
        _publish(trainer, run_dir, 1, seed=3)  # the old bytes still flow on the open connection, then it drops
        with pytest.raises(WeightsTransferError, match="rewritten"):
            stream.read()
        stream.close()
    finally:
        proxy.close()
    assert head == old[:100]
    assert len(proxy.requests) == 2  # one resume, refused (200 of the new file): no retry can mix versions


def test_retries_are_bounded_and_the_token_is_required(served, trainer, monkeypatch):
    run_dir, base = served
    data = _publish(trainer, run_dir, 1)
    # The first connection brings a quarter, then every resume drops before its body: no progress.
    proxy = _proxy(base, [len(data) // 4] + [100] * 10)
    try:
        with pytest.raises(WeightsTransferError, match="3 times in a row"):
            with open_url(f"{proxy.url}/weights/policy-v00001.safetensors", retries=2, backoff_s=0.01) as stream:
                stream.read()
    finally:
        proxy.close()
    assert len(proxy.requests) == 3
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(WeightsTransferError, match="unreachable after 2 attempts"):
        open_url(f"{closed}/weights/policy-v00001.safetensors", retries=1, backoff_s=0.01)
    monkeypatch.setenv("OPSD_API_TOKEN", "z" * 32)  # not the run's
    with pytest.raises(TokenRefusedError, match="refused the API token"):
        open_url(f"{base}/weights/policy-v00001.safetensors")
    with pytest.raises(TokenRefusedError):
        HttpSource(lambda: base).digest(1)


# ================================================================ sources, ensure_version, VersionGate


class UrlLoadingBackend:
    """A real HFBackend (its load_weights opens the URL through opsd.weights_io.open_weights), counting loads."""

    def __init__(self, backend: HFBackend):
        self.backend, self.loads = backend, []

    @property
    def policy_version(self) -> int:
        return self.backend.policy_version

    def load_weights(self, ref, version: int) -> None:
        assert isinstance(ref, str) and ref.startswith("http://")
        self.backend.load_weights(ref, version)
        self.loads.append(version)


def _same_weights(model, path) -> bool:
    from safetensors.torch import load_file

    state, loaded = model.state_dict(), load_file(str(path))
    return all(torch.equal(state[k], t) for k, t in loaded.items())


def test_ensure_version_over_http_tells_stale_from_unpublished_and_reloads_rewritten_versions(served, trainer):
    run_dir, base = served
    for v in (2, 3):
        _publish(trainer, run_dir, v, seed=10 + v)
    worker = UrlLoadingBackend(HFBackend(ModelSection(name="tiny-random")))
    source = HttpSource(lambda: base)
    assert source.versions() == [2, 3] and source.digest(3) == published_digest(weights_path(run_dir, 3))
    assert source.digest(7) is None
    assert ensure_version(worker, source, 3) is True and worker.policy_digest == source.digest(3)
    assert _same_weights(worker.backend.model, weights_path(run_dir, 3))
    assert ensure_version(worker, source, 3) is False  # same version, same digest: no transfer
    with pytest.raises(StalePolicyError, match="too stale"):
        ensure_version(worker, source, 1)  # pruned: 2 and 3 exist
    with pytest.raises(FileNotFoundError, match="not published yet"):
        ensure_version(worker, source, 4)
    _publish(trainer, run_dir, 3, seed=20)  # a resumed trainer rewrites v3 with other weights
    assert ensure_version(worker, source, 3) is True and worker.loads == [3, 3]
    assert _same_weights(worker.backend.model, weights_path(run_dir, 3))
    # The teacher's moving average (teacher.version ema:D) travels the same way.
    _publish(trainer, run_dir, 3, seed=21, path_of=ema_path)  # the average differs from the policy
    assert ensure_version(worker, HttpSource(lambda: base, ema=True), 3) is True
    assert _same_weights(worker.backend.model, ema_path(run_dir, 3))
    unknown = HttpSource(lambda: None)  # no trainer port file yet: nothing is published yet
    with pytest.raises(FileNotFoundError):
        ensure_version(worker, unknown, 5)


def test_version_gate_switches_versions_over_http(served, trainer):
    run_dir, base = served
    for v in (1, 2):
        _publish(trainer, run_dir, v, seed=30 + v)
    worker = UrlLoadingBackend(HFBackend(ModelSection(name="tiny-random")))
    switches = []
    gate = VersionGate(worker, HttpSource(lambda: base), on_switch=lambda d, s: switches.append(s))
    with gate.serving(1):
        assert worker.policy_version == 1 and _same_weights(worker.backend.model, weights_path(run_dir, 1))
    with gate.serving(2):
        assert worker.policy_version == 2 and _same_weights(worker.backend.model, weights_path(run_dir, 2))
    with gate.serving(2):
        pass
    assert worker.loads == [1, 2] and len(switches) == 2


# ================================================================ config


def test_weights_config_picks_the_source_and_never_changes_the_run_hash(tmp_path, monkeypatch):
    cfg = RunConfig()
    assert cfg.weights.transport == "file" and cfg.weights.url is None
    http = RunConfig.model_validate({"weights": {"transport": "http", "url": "http://trainer:8000"}})
    assert config_hash(hashed_config(http)) == config_hash(hashed_config(cfg))  # how bytes travel: resumable
    with pytest.raises(ValueError):
        RunConfig.model_validate({"weights": {"transport": "nfs"}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"weights": {"url": "trainer:8000"}})
    source = weight_source(cfg, tmp_path, ema=True)
    assert isinstance(source, FileSource) and source.ref(4) == ema_path(tmp_path, 4)
    assert weight_source(http, tmp_path).ref(4) == "http://trainer:8000/weights/policy-v00004.safetensors"
    assert weight_source(http, tmp_path, ema=True).ref(4) == "http://trainer:8000/weights/ema-v00004.safetensors"
    monkeypatch.setenv("OPSD_WEIGHTS_URL", "http://10.0.0.5:8000")
    assert weights_url(http, tmp_path) == "http://10.0.0.5:8000"
    monkeypatch.delenv("OPSD_WEIGHTS_URL")
    local = RunConfig.model_validate({"weights": {"transport": "http"}})
    assert weights_url(local, tmp_path) is None  # the trainer has not written its port file yet
    write_port(tmp_path, "trainer", "0.0.0.0", 8123)
    assert weight_source(local, tmp_path).ref(1) == "http://127.0.0.1:8123/weights/policy-v00001.safetensors"
    # A deployment's OPSD_WEIGHTS_TRANSPORT wins over the config, both ways (docker-compose.http.yml).
    monkeypatch.setenv("OPSD_WEIGHTS_TRANSPORT", "http")
    assert weights_transport(cfg) == "http" and isinstance(weight_source(cfg, tmp_path), HttpSource)
    monkeypatch.setenv("OPSD_WEIGHTS_TRANSPORT", "file")
    assert weights_transport(http) == "file" and isinstance(weight_source(http, tmp_path), FileSource)
    monkeypatch.setenv("OPSD_WEIGHTS_TRANSPORT", "nfs")
    with pytest.raises(ValueError, match="OPSD_WEIGHTS_TRANSPORT='nfs'"):
        weight_source(cfg, tmp_path)
    monkeypatch.delenv("OPSD_WEIGHTS_TRANSPORT")
    monkeypatch.delenv("OPSD_API_TOKEN")
    with pytest.raises(RuntimeError, match="OPSD_API_TOKEN"):
        weight_source(local, tmp_path)
    assert isinstance(weight_source(cfg, tmp_path), FileSource)  # files need no token


@pytest.mark.parametrize("url", ["127.0.0.1:8000", " http://trainer:8000", "http://trainer:abc", "http://trainer:99999",
                                 "http://:80", "ftp://trainer", "http://x y"])
def test_a_bad_weights_url_is_refused_at_start_in_one_line(url, monkeypatch, tmp_path):
    """weights.url and OPSD_WEIGHTS_URL are checked before any load (not 31 s of retries per group later)."""
    import pydantic

    from opsd.config import RunConfig

    with pytest.raises(pydantic.ValidationError, match="is not an http"):
        RunConfig(weights={"transport": "http", "url": url})
    monkeypatch.setenv("OPSD_WEIGHTS_URL", url)
    with pytest.raises(ValueError, match=r"OPSD_WEIGHTS_URL .* is not an http\(s\) base URL"):
        weight_source(RunConfig(weights={"transport": "http"}), tmp_path)
    monkeypatch.setenv("OPSD_WEIGHTS_URL", "HTTP://Trainer:8000")  # a scheme in capitals is still http
    source = weight_source(RunConfig(weights={"transport": "http"}), tmp_path)
    assert source.ref(3) == "http://Trainer:8000/weights/policy-v00003.safetensors"
