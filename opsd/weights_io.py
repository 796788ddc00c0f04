"""Weight files on a stream: write a safetensors file in one pass, read one from any `read(n)` stream.

The format is safetensors' own (safetensors is the reader of record: what
`write_weights` writes loads with `safetensors.safe_open` / `load_file`):
  8 bytes    header length N, little-endian u64 (a multiple of 8: the JSON is padded with spaces)
  N bytes    JSON: {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}
  data       every tensor's raw little-endian bytes, back to back, offsets relative to the data start

`write_weights` streams tensor by tensor (one CPU copy of one tensor at a
time) and computes the content digest (`opsd.weights.tensor_digest`) in the
same pass, recording it under `opsd.weights.DIGEST_KEY` by patching a
fixed-width placeholder in the header at the end. `iter_tensors` checks
every tensor (finite values) before yielding it and the digest before
yielding the last one, so a consumer that streams into an engine never
receives the end of a corrupt file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from opsd.weights import DIGEST_KEY, digest_frame

MAX_HEADER_BYTES = 100_000_000  # safetensors' own cap on the JSON header
_CHUNK = 16 << 20  # bytes per read() call and per hash update: overlaps reading with hashing
_PLACEHOLDER = "0" * 64  # a sha256 hex digest's width: patched in place, the header length never changes

# safetensors dtype name <-> torch dtype (the dtypes a policy file can hold)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # no float8: a policy is never stored in it, and the finite check (aminmax) has no float8 kernel on CPU
_NAMES = {v: k for k, v in _DTYPES.items()}


class WeightsError(ValueError):
    """A weights file that cannot be used: bad header, truncated data, non-finite values, digest mismatch."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, safetensors dtype ("BF16", ...), shape, and byte range [start, end) in the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed, validated header: metadata (str -> str), entries in file (offset) order, total data bytes."""

    metadata: dict[str, str]
    entries: list[Entry]
    data_bytes: int


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path: str) on a temp file next to `path`, make it world-readable, rename it to `path`.

    The temp name (".<name>.<random>.tmp") never matches a published version's
    name. Creates the parent directory. On any error the temp file is removed
    and the error re-raised.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp made it owner-only; readers may be other processes/users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _unique(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names in sorted order, a tensor sharing all its memory with an earlier name dropped (as `tensor_digest` counts)."""
    names, seen = [], set()
    for name in sorted(tensors):
        t = tensors[name]
        if t.numel():
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key in seen:
                continue
            seen.add(key)
        names.append(name)
    return names


def write_weights(tensors: Mapping[str, torch.Tensor], path, metadata: dict[str, str] | None = None,
                  dtype: torch.dtype | None = None) -> str:
    """Write `tensors` as a safetensors file at `path` atomically (temp file + rename); returns its digest (64 hex).

    tensors: name -> tensor (any device, any dtype of `_DTYPES`); stored in
    sorted name order, a tensor sharing all its memory with an earlier name
    (a tied LM head) once under the first name. dtype: floating tensors are
    cast to it, one at a time (None: kept). metadata: str -> str, stored with
    `opsd.weights.DIGEST_KEY` set to the digest of what the file holds (equal
    to `tensor_digest` of the cast tensors), computed while writing.
    Memory: one tensor's CPU copy (two while the hash thread lags one behind).
    Raises TypeError (non-string metadata), WeightsError (unsupported dtype),
    OSError (write failure; no temp file is left).
    """
    meta = {DIGEST_KEY: _PLACEHOLDER}  # first: its place in the header is found below
    for k, v in (metadata or {}).items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise TypeError(f"write_weights: metadata must map str to str, got {k!r}: {v!r}")
        if k != DIGEST_KEY:
            meta[k] = v
    names = _unique(tensors)

    def stored(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    header: dict = {"__metadata__": meta}
    offset = 0
    for name in names:
        t, want = tensors[name], stored(tensors[name])
        if want not in _NAMES:
            raise WeightsError(f"write_weights: {name} has dtype {want}, which safetensors files here do not hold")
        end = offset + t.numel() * want.itemsize
        header[name] = {"dtype": _NAMES[want], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data start to 8 bytes
    at = 8 + text.index(f'"{DIGEST_KEY}":"{_PLACEHOLDER}"'.encode()) + len(DIGEST_KEY) + 4

    def write(tmp: str) -> str:
        h = hashlib.sha256()
        with open(tmp, "wb") as f, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opsd-hash") as pool:
            f.write(struct.pack("<Q", len(text)) + text)
            pending = None
            for name in names:
                t = tensors[name].detach().to(stored(tensors[name]))
                data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()  # any dtype, bf16 included
                if pending is not None:
                    pending.result()  # the previous tensor's bytes are hashed: at most two copies alive
                h.update(digest_frame(name, t.dtype, t.shape, data.nbytes))
                pending = pool.submit(h.update, data)  # hashlib drops the GIL on large buffers: beside the write
                f.write(data)
            if pending is not None:
                pending.result()
            digest = h.hexdigest()
            f.seek(at)
            f.write(digest.encode())
        return digest

    out: list[str] = []
    atomic_write(Path(path), lambda tmp: out.append(write(tmp)))
    return out[0]


def open_weights(ref: str | os.PathLike) -> BinaryIO:
    """Open a weights file for reading as a binary stream read front to back.

    ref: a local path (str or PathLike) -> a buffered file; an http:// or
    https:// URL -> the trainer's served file (`opsd.weights_http.open_url`,
    which says what it raises). Raises FileNotFoundError for a missing path.
    """
    if isinstance(ref, str) and ref[:8].lower().startswith(("http://", "https://")):
        from opsd.weights_http import open_url

        return open_url(ref)
    return open(ref, "rb", buffering=_CHUNK)


def _read_exactly(stream: BinaryIO, n: int, what: str) -> bytes:
    """n bytes from `stream` by read() calls (a socket may return fewer); WeightsError when it ends first."""
    parts, left = [], n
    while left:
        part = stream.read(min(left, _CHUNK))
        if not part:
            raise WeightsError(f"truncated weights: {what} ended {left} bytes short of {n}")
        parts.append(part)
        left -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def all_finite(t: torch.Tensor) -> bool:
    """True when tensor `t` (any device) holds no NaN or inf; always True for integer and bool tensors.

    One fused min/max reduction (min and max propagate NaN; an inf is an extreme): about 12x faster than
    `isfinite(t).all()` on bf16 on one CPU core, which made the finite check the slowest part of a load.
    """
    if not t.is_floating_point() or not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _fill(stream: BinaryIO, view: memoryview) -> int:
    """Read up to len(view) bytes into `view`; returns how many (0 at the end). Straight into the tensor's buffer
    where the stream has readinto (files, `opsd.weights_http.UrlStream`): no copy of the bytes on the way."""
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        return readinto(view) or 0
    part = stream.read(len(view))
    view[: len(part)] = part
    return len(part)


def read_header(stream: BinaryIO, source: str = "weights") -> Header:
    """Read and validate a safetensors header from `stream` (positioned at the file start; read() calls only).

    Checked: the JSON size (<= MAX_HEADER_BYTES), its structure, string
    metadata, known dtypes, shapes whose element count matches the byte
    range, ranges contiguous from 0 in offset order. Raises WeightsError
    naming `source` (an empty file as such).
    """
    if _stream_size(stream) == 0:  # else reported as a header length 8 bytes short, as if some bytes were there
        raise WeightsError(f"{source}: the file is empty (0 bytes): truncated or never written, not a weights file")
    (n,) = struct.unpack("<Q", _read_exactly(stream, 8, f"{source}: header length"))
    if n > MAX_HEADER_BYTES:
        raise WeightsError(f"{source}: header of {n} bytes exceeds {MAX_HEADER_BYTES} (not a weights file?)")
    try:
        raw = json.loads(_read_exactly(stream, n, f"{source}: header"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise WeightsError(f"{source}: header is not a JSON object of unique keys: {str(e)[:200]}") from e
    if not isinstance(raw, dict):
        raise WeightsError(f"{source}: header is a {type(raw).__name__}, not an object")
    meta = raw.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise WeightsError(f"{source}: __metadata__ must map strings to strings")
    entries = []
    for name, spec in raw.items():
        try:
            dt, shape, (start, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise WeightsError(f"{source}: tensor {name!r} has a malformed entry {spec!r}") from e
        if dt not in _DTYPES:
            raise WeightsError(f"{source}: tensor {name!r} has unknown dtype {dt!r}")
        ints = (*shape, start, end)
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in ints):
            raise WeightsError(f"{source}: tensor {name!r} has a bad shape {list(shape)} or offsets {[start, end]}")
        if end - start != math.prod(shape) * _DTYPES[dt].itemsize:
            raise WeightsError(f"{source}: tensor {name!r} {dt} {list(shape)} does not fill its {end - start} bytes")
        entries.append(Entry(name, dt, shape, start, end))
    entries.sort(key=lambda e: (e.start, e.end))
    at = 0
    for e in entries:
        if e.start != at:
            raise WeightsError(f"{source}: tensor {e.name!r} starts at byte {e.start}, expected {at} (gap or overlap)")
        at = e.end
    size = _stream_size(stream)
    if size is not None and size != 8 + n + at:  # before any tensor is allocated: a header may claim terabytes
        raise WeightsError(f"{source}: the header describes {8 + n + at} bytes but the file holds {size} "
                           f"({'truncated' if size < 8 + n + at else 'trailing bytes'})")
    return Header(meta, entries, at)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object_pairs_hook: a dict, refusing a key given twice (two tensors of one name: which one is meant?)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return out


_ASYNC_HASH_BYTES = 1 << 16  # reads at least this long are hashed on the worker thread, overlapped with the next read


def _stream_size(stream: BinaryIO) -> int | None:
    """The total bytes `stream` will deliver when known: a served file's Content-Length (`size`), a file's
    length; None otherwise."""
    size = getattr(stream, "size", None)
    if isinstance(size, int) and size >= 0:
        return size
    try:
        return os.fstat(stream.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None


def iter_tensors(stream: BinaryIO, header: Header, source: str = "weights") -> "TensorReader":
    """The tensors of `header`, read from `stream` (read() calls only, positioned right after the header:
    `read_header`): an iterable of (name, CPU tensor) in file order, to be read once.

    Each floating tensor is checked finite before it is yielded; the content
    digest (`opsd.weights.tensor_digest` of what the file holds) is computed
    while reading, and when the header records one (`DIGEST_KEY`) the two are
    compared before the LAST tensor is yielded. The reader's `digest` is that
    verified digest (64 hex) once the last tensor was read (None before):
    what a consumer that read them all holds, never merely what the header claims.
    Raises WeightsError naming `source` (truncated data, NaN/inf, digest
    mismatch); the tensors yielded so far are then all a consumer got.
    """
    return TensorReader(stream, header, source)


class TensorReader:
    """What `iter_tensors` returns: iterate it once for (name, tensor); `digest` is set before the last
    tensor is yielded (the content digest of every tensor read, checked against the header's record)."""

    def __init__(self, stream: BinaryIO, header: Header, source: str):
        self.stream, self.header, self.source = stream, header, source
        self.digest: str | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._read()

    def _verified(self, h) -> None:
        recorded, computed = self.header.metadata.get(DIGEST_KEY), h.hexdigest()
        if recorded is not None and computed != recorded:
            raise WeightsError(f"{self.source}: content digest {computed} differs from the recorded {recorded} "
                               "(corrupt or replaced while read)")
        self.digest = computed

    def _read(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream, source, entries = self.stream, self.source, self.header.entries
        # Hashed whether or not the header records a digest: what was loaded is then always known by content.
        h = hashlib.sha256()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opsd-hash") as pool:
            for i, e in enumerate(entries):
                dtype, nbytes = _DTYPES[e.dtype], e.end - e.start
                buf = bytearray(nbytes)
                view, done, hashed = memoryview(buf), 0, None
                h.update(digest_frame(e.name, dtype, e.shape, nbytes))
                while done < nbytes:
                    k = _fill(stream, view[done:done + min(nbytes - done, _CHUNK)])
                    if not k:
                        raise WeightsError(f"{source}: truncated: tensor {e.name!r} ends {nbytes - done} bytes early")
                    if k >= _ASYNC_HASH_BYTES:
                        hashed = pool.submit(h.update, view[done:done + k])  # hashes this chunk while the next is read
                    else:  # a short read (a trickling socket): handing it to the thread costs more than hashing it
                        if hashed is not None:
                            hashed.result()  # the updates stay in file order
                        h.update(view[done:done + k])
                    done += k
                t = torch.frombuffer(buf, dtype=dtype).reshape(e.shape) if nbytes else torch.empty(e.shape, dtype=dtype)
                if not all_finite(t):
                    raise WeightsError(f"{source}: tensor {e.name!r} holds non-finite values (NaN or inf)")
                if hashed is not None:
                    hashed.result()  # updates run in order on one thread: the last one done means all are
                if i == len(entries) - 1:
                    self._verified(h)
                yield e.name, t
        if not entries:
            self._verified(h)
