"""Weights path: publish a policy version and load it into 1, 2 and 4 workers, per transport, beside this machine's limits.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weights.py [--quick] [--json OUT] [--shapes 0.5B 1.5B 3B]
                                                             [--workers 1 2 4] [--transports file http]
                                                             [--digest-mb 500]

Models: randomly initialised Qwen2.5-0.5B / 1.5B / 3B shapes (`opsd.footprint.PRESETS`; no download), in
bf16, the served dtype. For each shape:
- publish: the trainer's write of one version (`opsd.weights_io.write_weights` through
  `HFBackend.save_weights`, digest in the same pass) into `<run>/weights/`: seconds, bytes written.
- N workers (separate processes, each an `HFBackend` holding the model in bf16, the transformers engine)
  load the new version through `opsd.weights.ensure_version` from the transport's source: `file` (the run
  dir's file, page cache dropped first when this process may: another node reading a shared volume) or
  `http` (the trainer's weights app, `services.trainer.weights_api`, on loopback with its bearer token;
  the trainer's file stays in its page cache, as on the trainer's own node). Reported: seconds from the
  moment the version is published until the N-th worker serves it (all N start at once), and bytes read.
- limits, same bytes, same run: a plain sequential file write (+fsync, as the publish does), a plain
  sequential read after dropping the page cache, and a plain loopback TCP transfer (memory to memory).
  Target: each transport's one-worker rate (and the publish's write rate) >= 0.7x its limit.
- disk peak of a run at the default settings (`opsd.footprint.disk_peak_bytes`), and the 7B / 8B rows
  computed from the measured rates of the largest shape measured.

Workers that would not fit this machine's memory (each holds the model once, plus one version in flight)
are not started: their rows say so.

`--digest-mb N` measures only what verifying a load's digest costs on an N MB bf16 file in the page cache
(every load hashes the bytes it reads, `opsd.weights_io.iter_tensors`): a plain read, sha256 of the same
bytes alone, the finite check alone, and the whole checked read as a worker does it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks.common` importable

from benchmarks.common import Row, command_line, print_rows, write_json  # noqa: E402

SHAPES = {"0.5B": "Qwen2.5-0.5B-Instruct", "1.5B": "Qwen2.5-1.5B-Instruct", "3B": "Qwen2.5-3B-Instruct"}
BIG = {"7B": "Qwen2.5-7B-Instruct", "8B": "Llama-3.1-8B-Instruct"}
TARGET = ">= 0.7 x"
CHUNK = 64 << 20


# -- this machine's limits -------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Drop the kernel's page cache (root only): the next read comes from the disk. True when it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def file_write_limit(path: Path, nbytes: int, source: Path | None = None) -> float:
    """Seconds for a plain sequential write of `nbytes` (64 MiB blocks) and fsync: the bytes of `source` (read
    first, untimed, into the page cache), or random bytes."""
    block = os.urandom(CHUNK) if source is None else None
    if source is not None:
        with open(source, "rb") as f:  # into the page cache: the timed loop reads memory, as a model write does
            while f.read(CHUNK):
                pass
    t0 = time.perf_counter()
    with open(path, "wb") as f, (open(source, "rb") if source is not None else contextlib.nullcontext()) as src:
        left = nbytes
        while left:
            n = min(left, CHUNK)
            data = src.read(n) if src is not None else (block[:n] if n < CHUNK else block)
            f.write(data)
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def file_read_limit(path: Path) -> float:
    """Seconds for a plain sequential read of `path` into one reused 64 MiB buffer (cache dropped first)."""
    drop_page_cache()
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def loopback_limit(nbytes: int) -> float:
    """Seconds to send `nbytes` from memory to memory over a loopback TCP connection (one sender thread)."""
    server = socket.create_server(("127.0.0.1", 0))
    block = os.urandom(CHUNK)

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            left = nbytes
            while left:
                n = min(left, CHUNK)
                conn.sendall(block[:n] if n < CHUNK else block)
                left -= n

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with socket.create_connection(server.getsockname()) as c:
        got = 0
        while got < nbytes:
            n = c.recv_into(buf)
            if not n:
                break
            got += n
    dt = time.perf_counter() - t0
    sender.join()
    server.close()
    return dt


# -- the model, the trainer's publish and the workers ----------------------------------------------------


def make_model_dir(preset: str, out: Path) -> int:
    """Write a randomly initialised bf16 model of `preset`'s shape (`opsd.footprint.PRESETS`) as a loadable HF
    directory at `out` (`benchmarks.memory.write_random_model`: weights, config, a stand-in tokenizer); returns
    its parameter count."""
    import torch

    from benchmarks.memory import write_random_model
    from opsd.footprint import model_config, param_count

    config = model_config(preset)
    write_random_model(out, config, dtype=torch.bfloat16)
    return param_count(config)


def publish(model_dir: Path, run_dir: Path, version: int) -> tuple[float, int]:
    """The trainer's publish of `version` (the model of `model_dir`, one weight nudged so its digest is new):
    seconds of `HFBackend.save_weights` in bf16, bytes written."""
    import torch

    from opsd.config import ModelSection
    from opsd.models.hf import HFBackend
    from opsd.weights import weights_path

    backend = HFBackend(ModelSection(name=str(model_dir), dtype="bfloat16"))
    with torch.no_grad():
        next(backend.model.parameters()).add_(1e-2 * version)
    path = weights_path(run_dir, version)
    backend.policy_version = version
    os.sync()
    t0 = time.perf_counter()
    backend.save_weights(path, dtype=torch.bfloat16)
    with open(path, "rb") as f:  # the publish is durable before workers are told (fsync, as the limit does)
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    return dt, path.stat().st_size


def worker_main(model_dir: str, run_dir: str) -> None:
    """A worker process: load the model (bf16 HFBackend), then per stdin line `<what> <transport> <url or -> <version>`
    either load that version through `ensure_version` (what "load"; forced: policy_version reset first) or only
    move its bytes (what "transfer": `open_weights` read into one reused buffer, no checks, no engine), printing
    one JSON line each."""
    from opsd.config import ModelSection
    from opsd.models.hf import HFBackend
    from opsd.weights import FileSource, ensure_version
    from opsd.weights_http import HttpSource
    from opsd.weights_io import open_weights

    backend = HFBackend(ModelSection(name=model_dir, dtype="bfloat16"))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        what, transport, url, version = line.split()
        source = FileSource(Path(run_dir)) if transport == "file" else HttpSource(lambda: url)
        t0 = time.perf_counter()
        if what == "transfer":
            buf = bytearray(CHUNK)
            with open_weights(source.ref(int(version))) as stream:
                while stream.readinto(buf) == CHUNK:
                    pass
        else:
            backend.policy_version, backend.policy_digest = -1, None
            ensure_version(backend, source, int(version))
        print(json.dumps({"end": time.time(), "seconds": time.perf_counter() - t0}), flush=True)


class Workers:
    """`n` worker processes (`worker_main`), started and loaded once; `load` times one version switch."""

    def __init__(self, n: int, model_dir: Path, run_dir: Path, env: dict[str, str]):
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(model_dir), str(run_dir)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(n)]
        for p in self.procs:
            self._answer(p)

    @staticmethod
    def _answer(p: subprocess.Popen) -> dict:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {p.pid} exited with {p.wait()}")
        return json.loads(line)

    def run(self, what: str, n: int, transport: str, url: str, version: int) -> float:
        """Seconds from now until the first `n` workers all finished `what` ("load" or "transfer") of `version`
        (they start together; a file transport reads cold: the page cache is dropped first)."""
        if transport == "file":
            drop_page_cache()
        t0 = time.time()
        for p in self.procs[:n]:
            p.stdin.write(f"{what} {transport} {url} {version}\n")
            p.stdin.flush()
        return max(self._answer(p)["end"] for p in self.procs[:n]) - t0

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=60)


def serve_weights(run_dir: Path, token: str) -> str:
    """The trainer's weights app on a loopback port (a daemon thread); returns its base URL."""
    from opsd.service import bind_socket, serve_in_thread
    from services.trainer.weights_api import weights_app

    sock = bind_socket("127.0.0.1", 0)
    serve_in_thread(weights_app(run_dir, token), sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# -- one shape --------------------------------------------------------------------------------------------


def measure_shape(label: str, args, work: Path, token: str) -> tuple[list[Row], dict]:
    """Every row of one model shape; also returns the rates (bytes/s) the 7B/8B rows are computed from."""
    from opsd.footprint import disk_peak_bytes

    preset = SHAPES[label]
    model_dir, run_dir = work / f"model-{label}", work / f"run-{label}"
    run_dir.mkdir()
    url = serve_weights(run_dir, token) if "http" in args.transports else "-"
    params = make_model_dir(preset, model_dir)
    os.sync()
    seconds, nbytes = publish(model_dir, run_dir, 1)
    # The limits move the same bytes (this VM's disk writes random bytes ~2.5x slower than weights: the host
    # compresses), each after a sync; the source of the plain write is in the page cache (as the model is).
    from opsd.weights import weights_path

    os.sync()
    limit_w = file_write_limit(work / "limit.bin", nbytes, source=weights_path(run_dir, 1))
    limit_r = file_read_limit(work / "limit.bin")
    (work / "limit.bin").unlink()
    limit_net = loopback_limit(nbytes)
    gb = nbytes / 1e9
    rows = [Row(f"{label}: parameters", params / 1e9, "B"),
            Row(f"{label}: publish (write + digest, bf16)", seconds, "s", note=f"{gb:.2f} GB written once a step"),
            Row(f"{label}: disk peak of a run (defaults)", disk_peak_bytes(params, steps=100)["total"] / 1e9, "GB",
                note="opsd.footprint.disk_peak_bytes(params, steps=100): weights files + checkpoints")]
    rates = {"bytes": nbytes, "publish": nbytes / seconds, "write": nbytes / limit_w, "read": nbytes / limit_r,
             "loopback": nbytes / limit_net}
    rows += [Row(f"{label}: limit: sequential file write + fsync", nbytes / limit_w / 1e9, "GB/s"),
             Row(f"{label}: limit: sequential file read (cold)", nbytes / limit_r / 1e9, "GB/s"),
             Row(f"{label}: limit: loopback TCP, memory to memory", nbytes / limit_net / 1e9, "GB/s"),
             Row(f"{label}: publish rate over the write limit", limit_w / seconds, "x", TARGET)]
    # Each worker holds the model once and one version in flight; keep 2 GB for everything else.
    available = available_bytes()
    fits = max(0, int((available - 2e9) // (2 * nbytes)))
    n_max = min(max(args.workers), fits)
    workers = None
    try:
        if n_max:
            env = dict(os.environ, OPSD_API_TOKEN=token)
            workers = Workers(n_max, model_dir, run_dir, env)
            # The first load of a fresh process also faults in its model's pages: not a version switch's cost.
            workers.run("load", n_max, "file", "-", 1)
        for transport in args.transports:
            ref = url if transport == "http" else "-"
            limit = limit_r if transport == "file" else limit_net
            what_limit = "cold file read" if transport == "file" else "loopback TCP"
            for n in args.workers:
                name = f"{label}: {transport}: publish -> {n} worker(s) serve"
                if n > n_max:
                    rows.append(Row(name, None, "s", note=f"not run: {n} workers x {2 * gb:.1f} GB (the model and a "
                                                          f"version in flight) do not fit {available / 1e9:.1f} GB "
                                                          "available less 2 GB"))
                    continue
                if n == 1:  # the transport alone: the bytes into one reused buffer, no checks, no engine
                    dt = workers.run("transfer", 1, transport, ref, 1)
                    rows.append(Row(f"{label}: {transport}: transfer rate over its limit", limit / dt, "x", TARGET,
                                    note=f"{nbytes / dt / 1e9:.2f} GB/s vs {what_limit} {nbytes / limit / 1e9:.2f} GB/s"))
                dt = workers.run("load", n, transport, ref, 1)
                rows.append(Row(name, seconds + dt, "s", note=f"publish {seconds:.1f} s + load {dt:.1f} s; "
                                                             f"{nbytes * n / 1e9:.2f} GB read" +
                                                             (" from the trainer over loopback" if transport == "http"
                                                              else " from the run dir")))
                if n == 1:
                    rates[f"load_{transport}"] = nbytes / dt
                    rows.append(Row(f"{label}: {transport}: one worker's load rate (transfer + checks + engine)",
                                    nbytes / dt / 1e9, "GB/s", note="read, finite check, digest, copy into the model"))
    finally:
        if workers is not None:
            workers.close()
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows, rates


def digest_rows(work: Path, megabytes: int) -> list[Row]:
    """The cost of the digest a load verifies, on a file of `megabytes` MB of random bf16 tensors (32 MB each)
    read from the page cache: seconds of a plain read, of sha256 alone, of the finite check alone, and of the
    checked read (`read_header` + `iter_tensors`: read, finite check, digest hashed on a second thread)."""
    import hashlib

    import torch

    from opsd.weights_io import all_finite, iter_tensors, open_weights, read_header, write_weights

    per, n = 16 << 20, max(1, round(megabytes * 10**6 / (32 << 20)))
    g = torch.Generator().manual_seed(0)
    path = work / "digest.safetensors"
    write_weights({f"w{i:03d}": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n)}, path)
    nbytes = path.stat().st_size
    limit = file_read_limit(path)  # cold, as the limit rows
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:  # warm: what every row below reads
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    data = path.read_bytes()
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    hash_s = time.perf_counter() - t0
    del data
    with open_weights(path) as stream:
        t0 = time.perf_counter()
        tensors = dict(iter_tensors(stream, read_header(stream, str(path)), str(path)))
        checked_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert all(all_finite(t) for t in tensors.values())
    finite_s = time.perf_counter() - t0
    gb = nbytes / 1e9
    return [Row(f"digest: file of {gb:.2f} GB bf16: plain read (page cache)", read_s, "s",
                note=f"{gb / read_s:.2f} GB/s; cold read {gb / limit:.2f} GB/s"),
            Row("digest: sha256 of the same bytes alone (one core)", hash_s, "s", note=f"{gb / hash_s:.2f} GB/s"),
            Row("digest: finite check alone", finite_s, "s"),
            Row("digest: checked read as a load does it (read + finite + sha256)", checked_s, "s",
                note=f"{gb / checked_s:.2f} GB/s; the hash runs beside the read on a second thread")]


def projected_rows(rates: dict, measured: str) -> list[Row]:
    """7B / 8B rows from the measured rates of shape `measured`: publish seconds, bytes a step, disk peak."""
    from opsd.footprint import disk_peak_bytes, model_config, param_count

    rows = []
    for label, preset in BIG.items():
        params = param_count(model_config(preset))
        nbytes = 2 * params
        note = f"computed: {nbytes / 1e9:.1f} GB bf16 at the {measured} rates"
        rows += [Row(f"{label}: publish (computed)", nbytes / rates["publish"], "s", note=note),
                 Row(f"{label}: bytes written a step (weights)", nbytes / 1e9, "GB", note="one bf16 file"),
                 Row(f"{label}: disk peak of a run (defaults)", disk_peak_bytes(params, steps=100)["total"] / 1e9, "GB",
                     note="opsd.footprint.disk_peak_bytes(params, steps=100)")]
        for transport in ("file", "http"):
            if f"load_{transport}" in rates:
                rows.append(Row(f"{label}: {transport}: publish -> 1 worker serves (computed)",
                                nbytes / rates["publish"] + nbytes / rates[f"load_{transport}"], "s", note=note))
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="0.5B only, 1 and 2 workers")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    p.add_argument("--workers", nargs="+", type=int, default=None)
    p.add_argument("--transports", nargs="+", choices=["file", "http"], default=["file", "http"])
    p.add_argument("--json", default=None)
    p.add_argument("--digest-mb", type=int, default=None, help="only the digest's cost on a file of this many MB")
    args = p.parse_args()
    if args.digest_mb is not None:
        with tempfile.TemporaryDirectory(prefix="opsd-bench-digest-", dir=os.environ.get("OPSD_BENCH_DIR")) as tmp:
            rows = digest_rows(Path(tmp), args.digest_mb)
        print_rows(rows)
        if args.json:
            write_json(args.json, "weights", command_line(), rows)
        return
    args.shapes = args.shapes or (["0.5B"] if args.quick else ["0.5B", "1.5B", "3B"])
    args.workers = args.workers or ([1, 2] if args.quick else [1, 2, 4])
    if any(n < 1 for n in args.workers):
        p.error("--workers: each count must be >= 1")
    token = secrets.token_urlsafe(32)
    os.environ["OPSD_API_TOKEN"] = token
    rows: list[Row] = []
    last = None
    with tempfile.TemporaryDirectory(prefix="opsd-bench-weights-", dir=os.environ.get("OPSD_BENCH_DIR")) as tmp:
        work = Path(tmp)
        for label in args.shapes:
            shape_rows, rates = measure_shape(label, args, work, token)
            rows += shape_rows
            print_rows(shape_rows)
            last = (label, rates)
    if last is not None:
        rows += projected_rows(last[1], last[0])
    print_rows(rows)
    if args.json:
        write_json(args.json, "weights", command_line(), rows)


if __name__ == "__main__":
    main()
