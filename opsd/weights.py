"""Policy versions: the trainer publishes, rollout and teacher load.

Version v lives at `<run_dir>/weights/policy-v<v>.safetensors` (written to a
temp file, then renamed, so a reader never sees half a file). Version 0 is the
initial model from the model cache; the trainer also publishes it as a file
when `run.max_staleness >= 1`, because a worker that already loaded v1 may then
get a task of version 0 (k-step-off). The trainer keeps the newest
`max_staleness + 2` files: every version a task still in flight can carry.
The latest published version is also stored under the Redis key
`<prefix>:policy_version`.

A version number alone does not name one set of weights: a trainer resumed
from an older checkpoint trains the versions after it again, and (training
not being bit-deterministic) rewrites their files with other weights. So each
published file records a content digest in its safetensors metadata
(`DIGEST_KEY`, `tensor_digest`), inside the file it describes: the two are
renamed into place together. Every load recomputes the digest from the bytes
it reads (`opsd.weights_io.iter_tensors`) and refuses a file whose record
differs, the worker keeping the weights it held; `ensure_version` records that
verified digest as `backend.policy_digest` and reloads a version it holds when
its file now records another digest.

What the digest protects against, and what not: it is a checksum, not a
signature. It catches a version rewritten with other weights (a resumed
trainer's file records their digest: reloaded) and a corrupt or truncated
file (refused by whoever loads it). A file rewritten with other tensors
under the SAME recorded digest is refused by every worker that loads it, but
a worker already holding that version is not told (the held check reads the
header only, no re-hash): it keeps serving the verified weights that digest
names, never the new bytes, never a mix. Nor does it stop anyone who can
write the weights directory (or serve the trainer's API): such a writer
records the digest of their own tensors.

Workers find versions through a source: `FileSource` (the run dir's files,
on one machine or a shared volume) or, with weights.transport http,
`opsd.weights_http.HttpSource` (the trainer serves the same files over its
HTTP API: services/trainer/weights_api.py); `opsd.weights_http.weight_source`
builds the one a config asks for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
_NAME = re.compile(r"policy-v(\d+)\.safetensors")
_EMA_NAME = re.compile(r"ema-v(\d+)\.safetensors")
DIGEST_KEY = "opsd_content_sha256"  # safetensors metadata key of a published file's `tensor_digest`


class StalePolicyError(RuntimeError):
    """A job asks for a policy version whose weights the trainer has already deleted.

    The trainer keeps only the versions a job within `run.max_staleness` can
    need, so the job is too old to be trained on: workers dead-letter it at
    once (reason "stale_policy_version") instead of retrying it.
    """


def weights_path(run_dir: Path, version: int) -> Path:
    """Where policy version `version` (>= 0) is stored. Raises ValueError for a negative version."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return Path(run_dir) / "weights" / f"policy-v{version:05d}.safetensors"


def ema_path(run_dir: Path, version: int) -> Path:
    """Where the average of the policy up to version `version` is stored (teacher.version ema:D,
    services/trainer/ema.py). Raises ValueError for a negative version."""
    return weights_path(run_dir, version).with_name(f"ema-v{version:05d}.safetensors")


def published_versions(run_dir: Path) -> list[int]:
    """The versions whose weight files exist now, ascending (temp files of a write in progress excluded)."""
    folder = Path(run_dir) / "weights"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)))


def prune_versions(run_dir: Path, newest: int, keep: int) -> list[int]:
    """Delete the weight files of versions below `newest - keep + 1`; returns the versions deleted.

    Files of versions above `newest` (left by a trainer that ran further
    before it was resumed from an older checkpoint) are kept: tasks it issued
    may still carry them. Raises ValueError for keep < 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    gone = [v for v in published_versions(run_dir) if v <= newest - keep]
    for v in gone:
        weights_path(run_dir, v).unlink(missing_ok=True)
    folder = Path(run_dir) / "weights"
    for p in folder.iterdir() if folder.is_dir() else []:  # the averages published beside them
        if (m := _EMA_NAME.fullmatch(p.name)) and int(m.group(1)) <= newest - keep:
            p.unlink(missing_ok=True)
    return gone


def keep_snapshot(run_dir: Path, version: int, every: int) -> Path | None:
    """Keep version `version`'s published file in `<run_dir>/snapshots/` when `every` >= 1 divides it
    (version 0 when published); returns the snapshot path, or None when not kept. A hard link where the
    filesystem allows (no copy; pruning the published name leaves it), else a copy."""
    if every < 1 or version % every:
        return None
    src = weights_path(run_dir, version)
    dst = Path(run_dir) / "snapshots" / src.name
    dst.parent.mkdir(exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst


def tensor_digest(tensors) -> str:
    """The content digest of a weights file's tensors: sha256, 64 hex characters.

    tensors: a mapping name -> torch.Tensor (any dtype, shape, device), e.g.
    a model's state_dict() or what `safetensors.torch.load_file` returns.
    Hashed in name order: each tensor's name, dtype, shape and raw bytes.
    Tensors sharing all their memory with an earlier name (a tied embedding / LM
    head) count once, under the first name, as `safetensors.torch.save_model`
    stores them: the digest of a model equals the digest of `load_file` on
    the file `save_model` writes of it. Costs one pass over the bytes
    (about 0.8 GB/s on one core) and a CPU copy of one tensor at a time.
    """
    import hashlib

    import torch

    h, seen = hashlib.sha256(), set()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.numel():
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key in seen:
                continue
            seen.add(key)
        data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()  # any dtype, bf16 included
        h.update(digest_frame(name, t.dtype, t.shape, data.nbytes))
        h.update(data)
    return h.hexdigest()


def digest_frame(name: str, dtype, shape, nbytes: int) -> bytes:
    """What `tensor_digest` hashes before a tensor's raw bytes: name, torch dtype, shape and byte count.

    dtype: a torch.dtype; shape: a sequence of ints. Shared with opsd.weights_io, which hashes while it streams.
    """
    return f"{name}\0{dtype}\0{list(shape)}\0{nbytes}\0".encode()


def published_digest(path: Path) -> str | None:
    """The content digest (`DIGEST_KEY`) recorded in the safetensors file `path`, from its header alone.

    None when the file records none (written before digests were recorded,
    or by hand), is missing, or is no readable safetensors file: no evidence
    of other content, so callers keep what they hold. Never raises.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(DIGEST_KEY)
    except Exception:  # FileNotFoundError, safetensors' SafetensorError (a header that does not parse), ...
        return None


class FileSource:
    """Where a worker finds published versions when it shares the trainer's run dir (a volume, or one machine).

    path_of(run_dir, version): the file of a version (`weights_path`; `ema_path` for a teacher that scores
    with the policy's moving average). `opsd.weights_http.HttpSource` answers the same three questions
    over the trainer's HTTP API.
    """

    def __init__(self, run_dir: Path, path_of=weights_path):
        self.run_dir, self.path_of = Path(run_dir), path_of

    def ref(self, version: int) -> Path:
        """What `backend.load_weights` opens for `version`: its file's path."""
        return self.path_of(self.run_dir, version)

    def digest(self, version: int) -> str | None:
        """The digest `version` records as published now; None when missing or unknown (`published_digest`)."""
        return published_digest(self.ref(version))

    def versions(self) -> list[int]:
        """The policy versions published now, ascending."""
        return published_versions(self.run_dir)


def _source(source, path_of):
    """A source as given, or a run dir (Path or str) as a FileSource (the callers and tests before sources)."""
    return FileSource(source, path_of) if isinstance(source, (str, os.PathLike)) else source


def _holds(backend, source, version: int) -> bool:
    """True when `backend` holds `version` as published now: its policy_version is `version` and the file does not
    record another digest than the one verified when it was loaded (both known and different: replaced). Asks the
    source for the digest only when the backend recorded one; a version gone since (pruned) is no replacement."""
    if backend.policy_version != version:
        return False
    held = getattr(backend, "policy_digest", None)
    if held is None:  # the initial model (version 0, from the model cache) or a file without a digest: unknown
        return True
    now = source.digest(version)
    return now is None or now == held


def ensure_version(backend, source, version: int, path_of=weights_path) -> bool:
    """Load policy `version` into `backend` unless it already holds it; returns True if it loaded.

    source: where versions are published: a `FileSource`, an `opsd.weights_http.HttpSource`, or a run dir
    (Path/str; then path_of(run_dir, version) names the file: `weights_path`, or `ema_path` for a teacher
    that scores with the policy's moving average). `backend.load_weights(source.ref(version), version)`
    loads it: ref is a path for files, a URL for http.

    "Holds" means the same version AND the same content: the digest of what
    was loaded, as `backend.load_weights` returns it (computed from the bytes
    read and checked against the file's record; a backend that returns None
    gets the digest the source reported before the load), is kept as
    `backend.policy_digest`, and a version whose source now reports another
    digest (`published_digest` of the file's header, or the trainer's
    X-Opsd-Digest: rewritten by a resumed trainer) is loaded again. A
    missing digest (version 0 from the model cache; a file that records
    none) counts as unknown and never causes a reload. The check asks for
    the digest only (a header read or a HEAD request, no re-hash), and only
    when the backend recorded a digest: see the module for what it does not catch.

    Raises StalePolicyError when the version is gone (load_weights raised
    FileNotFoundError) and a newer version exists (the backend holds one,
    or the source publishes it): the trainer deleted it because a job of
    that version is too stale to train on (version 0 without a file counts
    as deleted once the backend moved on). Raises FileNotFoundError when the
    version is not published yet. On any error the backend keeps the
    weights it held.
    """
    source = _source(source, path_of)
    if _holds(backend, source, version):
        return False
    ref = source.ref(version)
    replaced = backend.policy_version == version
    # The claim, read before the load, is kept only for a backend that verifies none (returns None): a file
    # replaced during the load then leaves the older digest recorded, so the next call loads again.
    digest = source.digest(version)
    try:
        t0 = time.perf_counter()
        verified = backend.load_weights(ref, version)
        if replaced:
            log.info("policy version %d was published again with other weights (digest %s, was %s): reloading",
                     version, verified or digest, getattr(backend, "policy_digest", None))
        backend.policy_digest = verified if isinstance(verified, str) else digest
        log.info("loaded policy version %d from %s in %.2f s", version, ref, time.perf_counter() - t0)
        return True
    except FileNotFoundError:
        pass  # deleted between publishing and now, or never published: tell which
    newest = max(source.versions() + [backend.policy_version])
    if newest > version:
        raise StalePolicyError(
            f"policy version {version} was deleted ({ref} is gone; newest is {newest}): the job is too stale to train on"
        )
    raise FileNotFoundError(f"policy version {version} not published yet: {ref} is missing")


class VersionGate:
    """Serve the groups a worker holds one policy version at a time (rollout and teacher, many groups in flight).

    A group of version v runs only while the engine holds v (its content as
    published now: see `ensure_version`) and no group of a LOWER version
    waits: the lowest version held is served first (the trainer's oldest step
    is the one it waits for). A switch to another version, or a reload of v
    rewritten with other weights, waits until every running group of the
    current one has finished (drained), then loads it (`ensure_version(engine,
    source, v)`), so no request of version v runs after v+1 is loaded and no
    group mixes two.

    engine: what `ensure_version` loads into (policy_version, load_weights);
    source, path_of: as in `ensure_version`; on_switch(drain_s, load_s):
    called after each load (metrics), drain_s counted from the first group
    that waited for it; guard: a context manager factory each load runs
    under (the worker's liveness guard of probes.generate_s: a load that
    hangs, say on a stalled network filesystem, fails the worker's /livez).
    """

    def __init__(self, engine, source, on_switch=None, path_of=weights_path, guard=contextlib.nullcontext):
        self.engine, self.source, self.on_switch = engine, _source(source, path_of), on_switch
        self.guard = guard
        self._cond = threading.Condition()
        self._running = 0  # groups running, all of the engine's version
        self._waiting: list[int] = []  # versions of the groups waiting
        self._drain_since: float | None = None

    def enter(self, version: int) -> None:
        """Block until a group of `version` may run; loads it when the worker is drained.

        Raises what `ensure_version` raises (StalePolicyError,
        FileNotFoundError, a bad weights file) for this group alone; the
        engine then keeps the version it held.
        """
        with self._cond:
            self._waiting.append(version)
            try:
                while True:
                    lowest = min(self._waiting)
                    # False also when the file of the version held was replaced: drain, then reload it.
                    current = _holds(self.engine, self.source, version)
                    if version == lowest and current:
                        self._running += 1
                        return
                    if version == lowest and self._running == 0:
                        t0 = time.perf_counter()
                        drain_s = t0 - self._drain_since if self._drain_since is not None else 0.0
                        self._drain_since = None
                        with self.guard():
                            ensure_version(self.engine, self.source, version)  # others wait: the lock is held
                        if self.on_switch is not None:
                            self.on_switch(drain_s, time.perf_counter() - t0)
                        continue
                    if self._drain_since is None and self._running and not current:
                        self._drain_since = time.perf_counter()
                    self._cond.wait()
            finally:
                self._waiting.remove(version)
                self._cond.notify_all()

    def exit(self) -> None:
        """A group entered with `enter` has finished (or failed)."""
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def serving(self, version: int):
        """`enter(version)` ... `exit()` around a group's work."""
        self.enter(version)
        try:
            yield
        finally:
            self.exit()

    @property
    def running(self) -> int:
        """Groups running now."""
        with self._cond:
            return self._running
