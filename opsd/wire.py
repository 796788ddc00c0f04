"""Message encoding for the streams: msgpack envelopes checked against the dataclasses.

Wire format (msgpack, never pickle):

    {"schema": SCHEMA_VERSION, "type": "<class name>", "body": {<field>: <value>}}

Fields are encoded by their annotation in `opsd.types`: str/int/bool as is,
float as a finite float, lists and `dict[str, ...]` element-wise, nested
dataclasses as maps, `dict[str, Any]` as JSON-like data (None, bool, int,
finite float, str, list, str-keyed map), and numpy arrays as
`{"dtype": name, "shape": [..], "data": little-endian bytes}` with `dtype` one
of `ARRAY_DTYPES`. Decoding trusts nothing: every field is checked against
the annotations (missing, unknown or mistyped fields raise `WireError` naming
the field path; a missing field that has a default takes it, so messages from
before an optional field was added still decode), then the message's own
`validate()` runs. Nothing on the wire
can make the decoder build an arbitrary object.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from typing import Any, TypeVar

import msgpack
import numpy as np

from opsd.types import SCHEMA_VERSION, MessageError

T = TypeVar("T")

ARRAY_DTYPES = ("int32", "uint8", "float32", "bool", "int64")
MAX_ARRAY_NDIM = 8
MAX_JSON_DEPTH = 32  # game specs are shallow; this keeps recursion far from Python's limit


class WireError(MessageError):
    """A message cannot be encoded or decoded; `reason` is a short metric label.

    reason: "oversized" (more bytes than allowed) or "malformed" (anything else).
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


def encode(msg: Any, max_bytes: int | None = None) -> bytes:
    """Serialize a message dataclass (e.g. `RolloutGroup`) to msgpack bytes.

    The message is type-checked against its annotations and `validate()`d
    first, so a producer cannot put on the wire what a consumer would reject
    (e.g. a NaN log-prob, case 5 of bad-inputs.md).
    Raises WireError on a type or validation error, or if the result is longer
    than `max_bytes` (reason "oversized").
    """
    cls = type(msg)
    if not dataclasses.is_dataclass(cls):
        raise WireError(f"cannot encode {cls.__name__}: not a message dataclass")
    body = _pack(msg, cls, cls.__name__)  # first: its type errors name the field path
    _validate(msg, cls.__name__)
    envelope = {"schema": SCHEMA_VERSION, "type": cls.__name__, "body": body}
    try:
        data = msgpack.packb(envelope, use_bin_type=True)
    except UnicodeEncodeError as err:  # a lone surrogate (e.g. from errors="surrogateescape" decoding) in a str field
        raise WireError(f"cannot encode {cls.__name__}: a string is not valid UTF-8 ({err.reason})") from err
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"{cls.__name__}: encoded size {len(data)} B > limit {max_bytes} B", reason="oversized")
    return data


def decode(data: bytes, cls: type[T], max_bytes: int, vocab_size: int | None = None) -> T:
    """Rebuild a message of class `cls` from bytes made by `encode`.

    Checks, in order: size <= `max_bytes`, msgpack well-formed, envelope
    schema version and type name, every field against `cls`'s annotations
    (recursively), then `validate()` (given `vocab_size` when not None and the
    message takes one, so token ids >= vocab_size are rejected). Arrays are
    fresh writable copies.
    Raises WireError (a MessageError) on any violation; never anything else
    for bad input.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"{cls.__name__}: message of {len(data)} B > limit {max_bytes} B", reason="oversized")
    try:
        # strict_map_key: only str/bytes keys; no ext_hook: ext types stay inert ExtType values.
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"{cls.__name__}: undecodable msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(envelope, dict) or set(envelope) != {"schema", "type", "body"}:
        raise WireError(f"{cls.__name__}: not a message envelope")
    if type(envelope["schema"]) is not int or envelope["schema"] != SCHEMA_VERSION:
        raise WireError(f"{cls.__name__}: schema version {envelope['schema']!r} != {SCHEMA_VERSION}")
    if envelope["type"] != cls.__name__:
        raise WireError(f"expected message type {cls.__name__}, got {envelope['type']!r}")
    msg = _unpack(envelope["body"], cls, cls.__name__)
    _validate(msg, cls.__name__, vocab_size)
    return msg


def _validate(msg: Any, path: str, vocab_size: int | None = None) -> None:
    if not hasattr(msg, "validate"):
        return
    try:
        if vocab_size is not None and "vocab_size" in inspect.signature(msg.validate).parameters:
            msg.validate(vocab_size)
        else:
            msg.validate()
    except MessageError as e:
        raise WireError(f"{path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - any crash while checking untrusted data means the data is bad
        raise WireError(f"{path}: validate() failed: {type(e).__name__}: {e}") from e


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional_arg(hint: Any) -> Any | None:
    """`X` for a hint `X | None`, else None. Other unions are not part of the schema."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise TypeError(f"unsupported union in message schema: {hint}")
        return args[0]
    return None


def _fail(path: str, expected: str, value: Any) -> WireError:
    return WireError(f"{path}: expected {expected}, got {type(value).__name__}")


# ---------------------------------------------------------------- encoding


def _pack(value: Any, hint: Any, path: str) -> Any:
    """Python value -> msgpack-able value, checked against `hint`."""
    inner = _optional_arg(hint)
    if inner is not None:
        return None if value is None else _pack(value, inner, path)
    if hint is Any:
        _check_json(value, path, 0)
        return value
    if dataclasses.is_dataclass(hint):
        if type(value) is not hint:
            raise _fail(path, hint.__name__, value)
        return {
            f.name: _pack(getattr(value, f.name), _hints(hint)[f.name], f"{path}.{f.name}")
            for f in dataclasses.fields(hint)
        }
    if hint is np.ndarray:
        return _pack_array(value, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _fail(path, "list", value)
        return [_pack(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, "dict", value)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError(f"{path}: map key {k!r} is not a str")
            out[k] = _pack(v, args[1], f"{path}[{k!r}]")
        return out
    return _scalar(value, hint, path)


def _pack_array(arr: Any, path: str) -> dict[str, Any]:
    if not isinstance(arr, np.ndarray):
        raise _fail(path, "numpy array", arr)
    if arr.dtype.name not in ARRAY_DTYPES:
        raise WireError(f"{path}: dtype {arr.dtype} not allowed on the wire (allowed: {', '.join(ARRAY_DTYPES)})")
    if arr.ndim > MAX_ARRAY_NDIM:
        raise WireError(f"{path}: {arr.ndim}-d array, at most {MAX_ARRAY_NDIM} dims")
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": little.tobytes()}


# ---------------------------------------------------------------- decoding


def _unpack(value: Any, hint: Any, path: str) -> Any:
    """msgpack value -> Python value of type `hint`; raises WireError naming `path`."""
    inner = _optional_arg(hint)
    if inner is not None:
        return None if value is None else _unpack(value, inner, path)
    if hint is Any:
        _check_json(value, path, 0)
        return value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _fail(path, f"{hint.__name__} map", value)
        fields = dataclasses.fields(hint)
        names = [f.name for f in fields]
        # A field with a default may be absent (a message from before the field existed).
        missing = [f.name for f in fields if f.name not in value and not _has_default(f)]
        unknown = sorted(str(k) for k in value if k not in names)
        if missing:
            raise WireError(f"{path}: missing field(s) {', '.join(missing)}")
        if unknown:
            raise WireError(f"{path}: unknown field(s) {', '.join(unknown)}")
        hints = _hints(hint)
        return hint(**{n: _unpack(value[n], hints[n], f"{path}.{n}") for n in names if n in value})
    if hint is np.ndarray:
        return _unpack_array(value, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _fail(path, "list", value)
        return [_unpack(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, "map", value)
        # strict_map_key admits bytes keys too; the schema wants str.
        if not all(isinstance(k, str) for k in value):
            raise WireError(f"{path}: map key is not a str")
        return {k: _unpack(v, args[1], f"{path}[{k!r}]") for k, v in value.items()}
    return _scalar(value, hint, path)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _unpack_array(value: Any, path: str) -> np.ndarray:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise _fail(path, "array map {dtype, shape, data}", value)
    name, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(name, str) or name not in ARRAY_DTYPES:
        raise WireError(f"{path}: dtype {name!r} not allowed on the wire (allowed: {', '.join(ARRAY_DTYPES)})")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_ARRAY_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise WireError(f"{path}: bad shape {shape!r}")
    if not isinstance(data, bytes):
        raise _fail(path + ".data", "bytes", data)
    dtype = np.dtype(name)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(f"{path}: {len(data)} data bytes for shape {tuple(shape)} of {name} ({expected} expected)")
    if name == "bool" and data.translate(None, b"\x00\x01"):
        # numpy would silently view bytes 2..255 as True; only 0/1 are valid bools.
        raise WireError(f"{path}: bool array holds bytes other than 0/1")
    # frombuffer views the (immutable) message; astype copies it into a writable native-order array.
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=True)


# ---------------------------------------------------------------- shared leaves


def _scalar(value: Any, hint: Any, path: str) -> Any:
    # bool is a subclass of int: check it exactly, and never accept it as a number.
    if hint is bool:
        if type(value) is not bool:
            raise _fail(path, "bool", value)
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(path, "int", value)
        _check_int64(value, path)
        return int(value)
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _fail(path, "float", value)
        value = float(value)
        if not math.isfinite(value):
            raise WireError(f"{path}: {value} is not a finite float")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise _fail(path, "str", value)
        return str(value)
    raise TypeError(f"{path}: unsupported annotation {hint!r} in message schema")


def _check_int64(value: int, path: str) -> None:
    # msgpack integers are 64-bit; a bigger one would fail deep inside packb.
    if not -(2**63) <= value < 2**64:
        raise WireError(f"{path}: int {value} does not fit in 64 bits")


def _check_json(value: Any, path: str, depth: int) -> None:
    """JSON-like data only: None, bool, int, finite float, str, lists and str-keyed maps."""
    if depth > MAX_JSON_DEPTH:
        raise WireError(f"{path}: nested deeper than {MAX_JSON_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        _check_int64(value, path)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise WireError(f"{path}: {value} is not a finite float")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError(f"{path}: map key {k!r} is not a str")
            _check_json(v, f"{path}[{k!r}]", depth + 1)
        return
    raise _fail(path, "JSON-like value", value)
