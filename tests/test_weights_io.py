"""opsd.weights_io: one-pass safetensors writes with the digest in the header, stream reads that check as they go.

On the packaged tiny-random model (a real checkpoint, tied LM head); safetensors is the reader of record.
"""

from __future__ import annotations

import io
import json
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

from opsd.config import ModelSection
from opsd.models import load_backend
from opsd.weights import DIGEST_KEY, _NAME, tensor_digest
from opsd.weights_io import WeightsError, iter_tensors, open_weights, read_header, write_weights


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_backend(ModelSection(name="tiny-random", threads=1), device="cpu", backend="hf")


def _read_all(path):
    with open_weights(path) as s:
        h = read_header(s, str(path))
        return h, dict(iter_tensors(s, h, str(path)))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_round_trip_of_a_real_model(tiny, tmp_path, dtype):
    state = tiny.model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    path = tmp_path / "policy-v00001.safetensors"
    digest = write_weights(state, path, {"format": "pt", "policy_version": "1"}, dtype=dtype)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    loaded = load_file(str(path))
    assert "lm_head.weight" in loaded and "model.embed_tokens.weight" not in loaded  # the tie once, first name
    want = dtype or torch.float32
    for name, t in loaded.items():
        assert t.dtype == want and torch.equal(t, state[name].to(want)), name
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta == {DIGEST_KEY: digest, "format": "pt", "policy_version": "1"}
    cast = {k: v for k, v in loaded.items()}
    assert digest == tensor_digest(cast) == tensor_digest({k: state[k].to(want) for k in loaded})
    if dtype is None:
        assert digest == tensor_digest(state)
    header, read = _read_all(path)
    assert header.metadata == meta and list(read) == sorted(loaded)
    assert all(torch.equal(read[k], loaded[k]) for k in loaded)


def test_file_matches_save_model_byte_for_byte_in_data(tiny, tmp_path):
    """The same tensors, order and offsets as safetensors' own writer: only the metadata differs."""
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_weights(tiny.model.state_dict(), ours)
    save_model(tiny.model, str(theirs))
    with open(ours, "rb") as a, open(theirs, "rb") as b:
        ha, hb = read_header(a), read_header(b)
        assert [(e.name, e.dtype, e.shape) for e in ha.entries] == [(e.name, e.dtype, e.shape) for e in hb.entries]
        assert a.read() == b.read()


def test_header_is_8_byte_aligned_and_temp_names_are_not_versions(tmp_path):
    path = tmp_path / "policy-v00003.safetensors"
    write_weights({"w": torch.ones(3)}, path, {"x": "y" * 5})
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0
    assert not _NAME.fullmatch(".policy-v00003.safetensors.abc123.tmp")


def test_writes_gpu_like_views_and_refuses_bad_metadata(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = {"t": base.t(), "v": base[1]}  # non-contiguous, and a view sharing part of the storage: both stored
    digest = write_weights(t, tmp_path / "a.safetensors")
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert torch.equal(loaded["t"], base.t()) and torch.equal(loaded["v"], base[1])
    assert digest == tensor_digest(t)
    with pytest.raises(TypeError, match="str to str"):
        write_weights(t, tmp_path / "b.safetensors", {"n": 1})
    assert not (tmp_path / "b.safetensors").exists()


@pytest.fixture
def written(tiny, tmp_path):
    path = tmp_path / "policy-v00001.safetensors"
    write_weights(tiny.model.state_dict(), path, {"format": "pt"})
    return path


def _count(path):
    """(tensors yielded, error) reading `path` to the end."""
    got = 0
    with open_weights(path) as s:
        h = read_header(s, str(path))
        try:
            for _ in iter_tensors(s, h, str(path)):
                got += 1
        except WeightsError as e:
            return got, len(h.entries), str(e)
    return got, len(h.entries), None


def test_flipped_data_byte_is_refused_before_the_last_tensor(written):
    data = bytearray(written.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n + 1] ^= 1  # a low byte of the first tensor's first value: still finite
    written.write_bytes(bytes(data))
    got, total, err = _count(written)
    assert err is not None and "digest" in err
    assert got == total - 1  # every tensor but the last was yielded, the last never


def test_truncated_file(written):
    data = written.read_bytes()
    written.write_bytes(data[:-100])
    with open_weights(written) as s, pytest.raises(WeightsError, match="truncated"):  # its size gives it away
        read_header(s)
    stream = io.BytesIO(data[:-100])  # a stream of unknown length that ends early: the last tensor never comes
    h = read_header(stream)
    got = []
    with pytest.raises(WeightsError, match="truncated"):
        got.extend(iter_tensors(stream, h))
    assert len(got) == len(h.entries) - 1
    written.write_bytes(data[:20])
    with open_weights(written) as s, pytest.raises(WeightsError, match="truncated"):
        read_header(s)


def test_an_empty_file_is_named_empty_and_is_no_adapter_problem(tiny, tmp_path):
    """A zero-byte file (a copy cut short, a disk that filled) read as "header length ended 8 bytes short of 8",
    and opsd.lora's reader called it an AdapterError: the file is no weights file at all (issue 37)."""
    from opsd.lora import AdapterError, merged_weights, read_adapter

    path = tmp_path / "policy-v00001.safetensors"
    path.write_bytes(b"")
    empty = "^" + re.escape(f"{path}: the file is empty (0 bytes): truncated or never written, not a weights file")
    with open_weights(path) as s, pytest.raises(WeightsError, match=empty):
        read_header(s, str(path))
    before = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    version = tiny.policy_version
    for load in (lambda: tiny.load_weights(path, 7), lambda: read_adapter(path), lambda: merged_weights({}, path)):
        with pytest.raises(WeightsError, match=empty) as e:
            load()
        assert not isinstance(e.value, AdapterError)
    assert tiny.policy_version == version
    assert all(torch.equal(p, before[n]) for n, p in tiny.model.named_parameters())


def test_the_reader_reports_the_digest_it_verified(tiny, written, tmp_path):
    """`iter_tensors`' digest: computed from the bytes read, recorded or not in the header, set by the last tensor."""
    h, tensors = _read_all(written)
    with open_weights(written) as s:
        reader = iter_tensors(s, read_header(s))
        assert reader.digest is None
        got = dict(reader)
    assert reader.digest == h.metadata[DIGEST_KEY] == tensor_digest(tensors) == tensor_digest(got)
    bare = tmp_path / "bare.safetensors"
    save_model(tiny.model, str(bare))  # no digest recorded: still computed
    with open_weights(bare) as s:
        reader = iter_tensors(s, read_header(s))
        assert reader.digest is None
        got = dict(reader)
    assert reader.digest == tensor_digest(got) == tensor_digest(tiny.model.state_dict())


def test_nan_tensor_is_never_yielded(tmp_path):
    t = {"a": torch.ones(4), "b": torch.tensor([1.0, float("nan")]), "c": torch.ones(2)}
    path = tmp_path / "nan.safetensors"
    save_file(t, str(path))  # no digest recorded: the values are still checked
    got, total, err = _count(path)
    assert got == 1 and total == 3 and "non-finite" in err and "'b'" in err
    t["b"] = torch.tensor([float("inf"), 1.0])
    write_weights(t, path)
    assert _count(path)[0] == 1


def _with_header(header: dict, data: bytes = b"") -> io.BytesIO:
    text = json.dumps(header).encode()
    return io.BytesIO(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "does not fill"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "expected 0"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}, "gap or overlap"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "bad shape"),
    ({"a": {"dtype": "F32"}}, "malformed"),
    ({"__metadata__": {"k": 1}}, "strings"),
    ([1, 2], "not an object"),
])
def test_bad_headers(header, match):
    with pytest.raises(WeightsError, match=match):
        read_header(_with_header(header))


def test_bad_header_bytes():
    with pytest.raises(WeightsError, match="exceeds"):
        read_header(io.BytesIO(struct.pack("<Q", 10**9) + b"{}"))
    with pytest.raises(WeightsError, match="not a JSON object"):
        read_header(io.BytesIO(struct.pack("<Q", 4) + b"{{{{"))
    text = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "I32", "shape": [1], ' \
           b'"data_offsets": [0, 4]}}'
    with pytest.raises(WeightsError, match="'a' appears twice"):
        read_header(io.BytesIO(struct.pack("<Q", len(text)) + text + bytes(4)))
    for meta in ([], 0, "", None):
        with pytest.raises(WeightsError, match="__metadata__ must map"):
            read_header(_with_header({"__metadata__": meta}))
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(WeightsError, match="not a JSON object"):
        read_header(io.BytesIO(struct.pack("<Q", len(deep)) + deep))


@pytest.mark.parametrize("data, match", [(bytes(3), "truncated"), (bytes(5), "trailing bytes")])
def test_a_file_whose_size_disagrees_with_its_header_is_refused_before_any_allocation(tmp_path, data, match):
    """A header may claim terabytes: the claim is compared with the file's size (a served file's Content-Length)
    before a tensor buffer is allocated; trailing bytes are refused too, as safetensors refuses them."""
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    path = tmp_path / "w.safetensors"
    path.write_bytes(_with_header(header, data).getvalue())
    with open_weights(path) as f, pytest.raises(WeightsError, match=match):
        read_header(f)
    huge = {"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}
    path.write_bytes(_with_header(huge, bytes(4)).getvalue())
    with open_weights(path) as f, pytest.raises(WeightsError, match="truncated"):
        read_header(f)


class _Trickle:
    """A socket-like stream with read(n) alone, returning at most 7 bytes (no seek, no readinto)."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def read(self, n=-1):
        part = self.data[self.at:self.at + min(n, 7)]
        self.at += len(part)
        return part


def test_reads_from_a_stream_returning_short_reads(written):
    s = _Trickle(written.read_bytes())
    h = read_header(s)
    got = dict(iter_tensors(s, h))
    assert all(torch.equal(got[k], v) for k, v in load_file(str(written)).items())


def test_hf_loads_a_bf16_file_into_a_bf16_model(tiny, tmp_path):
    path = tmp_path / "policy-v00001.safetensors"
    with torch.no_grad():
        before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
        tiny.model.to(torch.bfloat16)
        try:
            for p in tiny.model.parameters():
                p.add_(0.5)
            tiny.save_weights(path)
            want = {k: v.clone() for k, v in tiny.model.state_dict().items()}
            for p in tiny.model.parameters():  # other weights, then the file's back
                p.zero_()
            tiny.load_weights(path, 1)
            got = tiny.model.state_dict()
            assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
            assert tiny.model.lm_head.weight.data_ptr() == tiny.model.model.embed_tokens.weight.data_ptr()
        finally:
            tiny.model.to(torch.float32)
            tiny.model.load_state_dict(before)
            tiny.policy_version = 0
    # A float32 trainer publishing in the served dtype: save_weights(dtype=bfloat16) writes bf16.
    tiny.save_weights(path, dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(str(path)).values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype differs"):  # and a float32 model refuses it, unchanged
        tiny.load_weights(path, 2)
    assert tiny.policy_version == 0


def test_engine_weights_full_file_and_adapter(tiny, tmp_path):
    """What a vLLM worker streams into its engine (checked on CPU, no vLLM): a full file's tensors with the tied
    head under the embedding's name; an adapter as every initial weight, the targeted ones merged."""
    import copy

    from opsd.config import LoRASection
    from opsd.lora import apply_lora, merged_weights, save_adapter
    from opsd.models.vllm_worker import engine_weights

    model_dir = str(tiny.path)
    initial = load_file(str(tiny.path / "model.safetensors"))
    full = tmp_path / "full.safetensors"
    tiny.save_weights(full)
    with open_weights(full) as s:
        got = dict(engine_weights(s, str(full), model_dir))
    assert got.keys() == initial.keys() and "lm_head.weight" not in got
    assert all(torch.equal(got[k], initial[k]) for k in initial)

    trainer = copy.deepcopy(tiny.model)
    apply_lora(trainer, LoRASection(r=4, alpha=8.0))
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    adapter = tmp_path / "adapter.safetensors"
    save_adapter(trainer, adapter, 2)
    with open_weights(adapter) as s:
        got = dict(engine_weights(s, str(adapter), model_dir))
    merged = merged_weights(initial, adapter)
    assert got.keys() == initial.keys() and merged
    assert all(torch.equal(got[k], merged.get(k, initial[k])) for k in initial)

    state = load_file(str(full))  # refused before any tensor: a missing weight, a wrong dtype
    state.pop("model.norm.weight")
    save_file(state, str(tmp_path / "bad.safetensors"))
    with open_weights(tmp_path / "bad.safetensors") as s, pytest.raises(KeyError, match="missing"):
        engine_weights(s, "bad", model_dir)
    # The served dtype may differ from the checkpoint's (Qwen's hub files are bf16, model.dtype float32, or the
    # reverse): floating weights must arrive in the SERVED dtype, whatever the checkpoint holds; anything else
    # (another dtype, one tensor of another dtype) is refused, not cast by vLLM.
    write_weights(tiny.model.state_dict(), tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    with open_weights(tmp_path / "bf16.safetensors") as s:
        got = dict(engine_weights(s, "bf16", model_dir, served="bfloat16"))
    assert got.keys() == initial.keys() and all(t.dtype == torch.bfloat16 for t in got.values())
    for served in (None, "float32"):  # the checkpoint's dtype (float32 here), or served in float32
        with open_weights(tmp_path / "bf16.safetensors") as s, pytest.raises(ValueError, match="dtype differs"):
            engine_weights(s, "bf16", model_dir, served=served)
    state = load_file(str(full))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(tmp_path / "int.safetensors"))
    with open_weights(tmp_path / "int.safetensors") as s, pytest.raises(ValueError, match="dtype differs"):
        engine_weights(s, "int", model_dir)
