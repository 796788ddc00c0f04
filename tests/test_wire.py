"""opsd.wire: round trips of every message type, and every kind of bad input rejected with WireError."""

from __future__ import annotations

import dataclasses
import math
import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsd import wire
from opsd.types import SCHEMA_VERSION, MessageError, RolloutGroup, ScoredGroup, TaskGroup, Trajectory
from opsd.wire import WireError, decode, encode
from tests.factories import make_rollout_group, make_scored_group, make_task

LIMIT = 1 << 20


def assert_same(a, b, path="msg"):
    """Deep equality of messages: same types, array dtypes, shapes and values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.array_equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def tamper(data: bytes, edit) -> bytes:
    """Unpack an encoded message, let `edit(envelope)` change it in place, repack."""
    env = msgpack.unpackb(data, raw=False)
    edit(env)
    return msgpack.packb(env, use_bin_type=True)


def rollout_bytes() -> bytes:
    return encode(make_rollout_group(G=3, turns=2, seed=7))


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "msg",
    [make_task(group_size=8, seed=3), make_rollout_group(G=4, turns=3, seed=1), make_scored_group(G=3, turns=4, seed=2)],
    ids=["TaskGroup", "RolloutGroup", "ScoredGroup"],
)
def test_round_trip_is_exact(msg):
    data = encode(msg, LIMIT)
    back = decode(data, type(msg), LIMIT)
    assert_same(msg, back)


def test_round_trip_keeps_dtypes_emoji_and_gives_writable_copies():
    sg = make_scored_group(G=2, turns=2, seed=5)
    sg.rollout.task.privileged_info = "go north 🙂 then ñ, 中文"
    back = decode(encode(sg), ScoredGroup, LIMIT)
    traj = back.rollout.trajectories[0]
    assert traj.token_ids_S.dtype == np.int32 and traj.loss_mask_S.dtype == np.uint8
    assert traj.sampler_logprobs_S.dtype == np.float32 and back.eligible_MM.dtype == np.bool_
    assert back.rollout.task.privileged_info == "go north 🙂 then ñ, 中文"
    assert "🚪" in traj.turns[0].observation and "\ufffd" not in traj.turns[0].observation
    traj.token_ids_S[0] = 5  # a read-only view of the message bytes would raise here
    assert back.rollout.task.game["goal"] == "take the coin 🪙"


def test_empty_trajectory_arrays_round_trip():
    rg = make_rollout_group(G=1, turns=0, seed=0)
    t = rg.trajectories[0]
    t.token_ids_S, t.sampler_logprobs_S, t.loss_mask_S = (np.zeros(0, d) for d in (np.int32, np.float32, np.uint8))
    t.sampler_entropy_S = np.zeros(0, np.float32)
    assert_same(rg, decode(encode(rg), RolloutGroup, LIMIT))


def test_wire_error_is_a_message_error():
    assert issubclass(WireError, MessageError)


# ---------------------------------------------------------------- encode refuses bad messages


def test_encode_rejects_a_lone_surrogate_and_a_malformed_hint_as_wire_errors():
    rg = make_rollout_group(G=1, turns=2, seed=0)
    rg.trajectories[0].turns[0].hint = ["take \udcff coin"]  # what errors="surrogateescape" decoding leaves
    with pytest.raises(WireError, match="UTF-8"):
        encode(rg)
    rg.trajectories[0].turns[0].hint = ["take coin"]
    assert decode(encode(rg), RolloutGroup, LIMIT).trajectories[0].turns[0].hint == ["take coin"]
    rg.trajectories[0].turns[0].hint = None  # validate() itself (not only the wire's type check) names the field
    with pytest.raises(MessageError, match="hint must be a list of str"):
        rg.validate()


def test_encode_rejects_nan_logprob():
    rg = make_rollout_group(G=2, turns=2, seed=0)
    rg.trajectories[1].sampler_logprobs_S[3] = np.nan
    with pytest.raises(WireError, match="NaN"):
        encode(rg)


def test_encode_rejects_nan_in_plain_float_field_with_path():
    rg = make_rollout_group(G=2, turns=2, seed=0)
    rg.trajectories[1].reward = float("nan")
    with pytest.raises(WireError, match=r"RolloutGroup\.trajectories\[1\]\.reward"):
        encode(rg)
    sg = make_scored_group(G=2, turns=2)
    sg.source_weights_M[0] = [float("inf")]
    with pytest.raises(WireError, match=r"source_weights_M\[0\]\[0\]"):
        encode(sg)


def test_encode_rejects_object_and_unlisted_dtypes():
    rg = make_rollout_group(G=2, turns=2, seed=0)
    rg.trajectories[0].token_ids_S = np.array([1, "x", None], dtype=object)
    with pytest.raises(WireError, match="dtype object not allowed"):
        encode(rg)
    rg = make_rollout_group(G=2, turns=2, seed=0)
    rg.trajectories[0].sampler_logprobs_S = rg.trajectories[0].sampler_logprobs_S.astype(np.float64)
    with pytest.raises(WireError, match="float64 not allowed"):
        encode(rg)


def test_encode_rejects_wrong_types_and_non_json_game():
    task = make_task()
    task.step = "3"
    with pytest.raises(WireError, match=r"TaskGroup\.step: expected int, got str"):
        encode(task)
    task = make_task()
    task.game = {"seed": np.int64(3)}
    with pytest.raises(WireError, match=r"TaskGroup\.game\['seed'\]: expected JSON-like"):
        encode(task)
    task = make_task()
    task.game = {"temperature": float("nan")}
    with pytest.raises(WireError, match="not a finite float"):
        encode(task)


def test_encode_oversized():
    with pytest.raises(WireError) as e:
        encode(make_rollout_group(G=4, turns=3), max_bytes=1000)
    assert e.value.reason == "oversized"


# ---------------------------------------------------------------- decode refuses bad bytes


def _set_array(env, traj_i, name, arr):
    env["body"]["trajectories"][traj_i][name] = {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}


def test_decode_rejects_nan_logprob_in_array_bytes():
    def edit(env):
        arr = np.frombuffer(env["body"]["trajectories"][0]["sampler_logprobs_S"]["data"], "<f4").copy()
        arr[-1] = np.nan
        env["body"]["trajectories"][0]["sampler_logprobs_S"]["data"] = arr.tobytes()

    with pytest.raises(WireError, match=r"sampler_logprobs_S: contains NaN"):
        decode(tamper(rollout_bytes(), edit), RolloutGroup, LIMIT)


def _float_arrays(node, path=""):
    """(path, array envelope) of every float array inside a decoded msgpack body."""
    if isinstance(node, dict) and {"dtype", "shape", "data"} <= node.keys():
        if str(node["dtype"]).startswith("float") and np.prod(node["shape"]) > 0:
            yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _float_arrays(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _float_arrays(v, f"{path}[{i}]")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cls, msg", [(RolloutGroup, make_rollout_group(G=2, turns=2, seed=5)),
                                      (ScoredGroup, make_scored_group(G=2, turns=2, seed=5))],
                         ids=["RolloutGroup", "ScoredGroup"])
def test_case5_non_finite_value_in_any_float_array_is_rejected(cls, msg, value):
    # Case 5 for the whole kind: a NaN/inf log-prob (or any other float: entropies, H, rho...)
    # in ANY array of the message, on a loss token or off it, never gets past decode.
    data = encode(msg)
    paths = [p for p, _ in _float_arrays(msgpack.unpackb(data, raw=False)["body"])]
    assert any("logprobs" in p for p in paths) and len(paths) >= 4
    for target in paths:
        for position in (0, -1):
            def edit(env):
                node = dict(_float_arrays(env["body"]))[target]
                arr = np.frombuffer(node["data"], np.dtype(node["dtype"]).newbyteorder("<")).copy()
                arr.reshape(-1)[position] = value
                node["data"] = arr.tobytes()

            with pytest.raises(WireError, match="NaN or inf"):
                decode(tamper(data, edit), cls, LIMIT)
    # The untouched message still decodes: the refusals are about the value.
    assert_same(decode(data, cls, LIMIT), msg)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_decode_rejects_non_finite_plain_float(value):
    def edit(env):
        env["body"]["trajectories"][2]["reward"] = value

    with pytest.raises(WireError, match=r"RolloutGroup\.trajectories\[2\]\.reward: .* not a finite float"):
        decode(tamper(rollout_bytes(), edit), RolloutGroup, LIMIT)


def test_decode_rejects_wrong_dtypes():
    data = rollout_bytes()
    # not on the whitelist at all
    with pytest.raises(WireError, match="dtype 'float64' not allowed"):
        decode(tamper(data, lambda env: _set_array(env, 0, "sampler_logprobs_S", np.zeros(10))), RolloutGroup, LIMIT)
    # on the whitelist, but not this field's dtype: validate() catches it
    rg = make_rollout_group(G=3, turns=2, seed=7)
    ids64 = rg.trajectories[0].token_ids_S.astype(np.int64)
    with pytest.raises(WireError, match="token_ids_S: expected dtype int32, got int64"):
        decode(tamper(data, lambda env: _set_array(env, 0, "token_ids_S", ids64)), RolloutGroup, LIMIT)


def test_decode_rejects_shape_mismatches():
    def wrong_shape(env):
        env["body"]["trajectories"][0]["token_ids_S"]["shape"][0] += 1

    with pytest.raises(WireError, match="data bytes for shape"):
        decode(tamper(rollout_bytes(), wrong_shape), RolloutGroup, LIMIT)

    def shorter_mask(env):
        _set_array(env, 1, "loss_mask_S", np.zeros(3, np.uint8))

    with pytest.raises(WireError, match="lengths differ"):
        decode(tamper(rollout_bytes(), shorter_mask), RolloutGroup, LIMIT)

    def negative_dim(env):
        env["body"]["trajectories"][0]["token_ids_S"]["shape"] = [-1]

    with pytest.raises(WireError, match="bad shape"):
        decode(tamper(rollout_bytes(), negative_dim), RolloutGroup, LIMIT)


def test_a_message_from_before_an_optional_field_takes_its_default():
    data = tamper(rollout_bytes(), lambda env: env["body"]["trajectories"][0].pop("opening"))
    back = decode(data, RolloutGroup, LIMIT)
    assert back.trajectories[0].opening == "" and "Kitchen" in back.trajectories[1].opening


def test_decode_rejects_missing_and_unknown_fields():
    with pytest.raises(WireError, match=r"RolloutGroup\.task: missing field\(s\) env"):
        decode(tamper(rollout_bytes(), lambda env: env["body"]["task"].pop("env")), RolloutGroup, LIMIT)
    with pytest.raises(WireError, match=r"RolloutGroup\.trajectories\[1\]\.turns\[0\]: unknown field\(s\) evil"):
        decode(
            tamper(rollout_bytes(), lambda env: env["body"]["trajectories"][1]["turns"][0].update(evil=1)),
            RolloutGroup, LIMIT,
        )


@pytest.mark.parametrize(
    "field,value,expected",
    [("step", "3", "expected int, got str"), ("group_size", True, "expected int, got bool"),
     ("env", 5, "expected str, got int"), ("game", [1, 2], "expected map, got list")],
)
def test_decode_rejects_wrong_types(field, value, expected):
    data = tamper(encode(make_task()), lambda env: env["body"].__setitem__(field, value))
    with pytest.raises(WireError, match=rf"TaskGroup\.{field}: {expected}"):
        decode(data, TaskGroup, LIMIT)


def test_decode_rejects_wrong_bool_and_list_types():
    def edit(env):
        env["body"]["trajectories"][0]["won"] = 1

    with pytest.raises(WireError, match=r"trajectories\[0\]\.won: expected bool, got int"):
        decode(tamper(rollout_bytes(), edit), RolloutGroup, LIMIT)
    with pytest.raises(WireError, match=r"RolloutGroup\.trajectories: expected list"):
        decode(tamper(rollout_bytes(), lambda env: env["body"].__setitem__("trajectories", {})), RolloutGroup, LIMIT)


def test_decode_rejects_schema_version_and_type_name():
    with pytest.raises(WireError, match=f"schema version 2 != {SCHEMA_VERSION}"):
        decode(tamper(rollout_bytes(), lambda env: env.__setitem__("schema", 2)), RolloutGroup, LIMIT)
    with pytest.raises(WireError, match="schema_version 9"):
        decode(tamper(rollout_bytes(), lambda env: env["body"].__setitem__("schema_version", 9)), RolloutGroup, LIMIT)
    with pytest.raises(WireError, match="expected message type ScoredGroup, got 'RolloutGroup'"):
        decode(rollout_bytes(), ScoredGroup, LIMIT)
    with pytest.raises(WireError, match="not a message envelope"):
        decode(msgpack.packb({"schema": 1, "body": {}}), RolloutGroup, LIMIT)


def test_decode_oversized():
    data = rollout_bytes()
    with pytest.raises(WireError) as e:
        decode(data, RolloutGroup, max_bytes=len(data) - 1)
    assert e.value.reason == "oversized"
    decode(data, RolloutGroup, max_bytes=len(data))  # exactly at the limit is fine


@pytest.mark.parametrize("cut", [1, 10, 0.5, 0.99])
def test_decode_rejects_truncated_bytes(cut):
    data = rollout_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    with pytest.raises(WireError, match="undecodable msgpack"):
        decode(data[:n], RolloutGroup, LIMIT)


def test_decode_rejects_trailing_bytes_and_empty_input():
    with pytest.raises(WireError):
        decode(rollout_bytes() + b"\x00", RolloutGroup, LIMIT)
    with pytest.raises(WireError):
        decode(b"", RolloutGroup, LIMIT)


def test_decode_rejects_object_array_attempts():
    for dtype in ("object", "O", "|O", "<U4", "V8"):
        with pytest.raises(WireError, match="not allowed on the wire"):
            decode(
                tamper(rollout_bytes(), lambda env: env["body"]["trajectories"][0]["token_ids_S"].__setitem__("dtype", dtype)),
                RolloutGroup, LIMIT,
            )
    # an ext type where an array belongs is data, never turned into an object
    def ext(env):
        env["body"]["trajectories"][0]["token_ids_S"] = msgpack.ExtType(42, pickle.dumps(object()))

    with pytest.raises(WireError, match="expected array map"):
        decode(tamper(rollout_bytes(), ext), RolloutGroup, LIMIT)
    # and a pickled message is just garbage
    with pytest.raises(WireError):
        decode(pickle.dumps(make_rollout_group()), RolloutGroup, LIMIT)


def test_decode_rejects_bool_array_bytes_other_than_0_1():
    data = encode(make_scored_group(G=2, turns=2))

    def edit(env):
        raw = bytearray(env["body"]["eligible_MM"]["data"])
        raw[0] = 2
        env["body"]["eligible_MM"]["data"] = bytes(raw)

    with pytest.raises(WireError, match="bool array holds bytes other than 0/1"):
        decode(tamper(data, edit), ScoredGroup, LIMIT)


def test_decode_rejects_nan_and_bytes_inside_json_game():
    data = encode(make_task())
    with pytest.raises(WireError, match=r"TaskGroup\.game\['x'\]\[1\]: nan is not a finite float"):
        decode(tamper(data, lambda env: env["body"]["game"].__setitem__("x", [1, math.nan])), TaskGroup, LIMIT)
    with pytest.raises(WireError, match="expected JSON-like value, got bytes"):
        decode(tamper(data, lambda env: env["body"]["game"].__setitem__("blob", b"\x00")), TaskGroup, LIMIT)


def test_decode_rejects_invalid_spans_via_validate():
    def edit(env):
        env["body"]["trajectories"][0]["turns"][1]["response_start"] = 0

    with pytest.raises(WireError, match="out of order or bounds"):
        decode(tamper(rollout_bytes(), edit), RolloutGroup, LIMIT)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_garbage_only_raises_wire_error(blob):
    with pytest.raises(WireError):
        decode(blob, RolloutGroup, LIMIT)


_VALID = encode(make_rollout_group(G=2, turns=2, seed=3))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(_VALID) - 1), st.integers(0, 255))
def test_corrupted_byte_gives_wire_error_or_a_valid_message(pos, byte):
    data = bytearray(_VALID)
    data[pos] = byte
    try:
        msg = decode(bytes(data), RolloutGroup, LIMIT)
    except WireError:
        return
    msg.validate()  # anything that gets through is a fully valid message
    assert all(np.isfinite(t.sampler_logprobs_S).all() for t in msg.trajectories)


def test_unsupported_schema_annotation_is_a_programming_error():
    @dataclasses.dataclass
    class Bad:
        x: int | str

    with pytest.raises(TypeError, match="unsupported union"):
        encode(Bad(1))
    assert wire.ARRAY_DTYPES == ("int32", "uint8", "float32", "bool", "int64")


# ---------------------------------------------------------------- optional credit fields (FiRe-OPD, credit dump)


def with_credit_fields(sg: ScoredGroup, D: int = 384, seed: int = 0) -> ScoredGroup:
    """`sg` with every optional field filled as the rollout and the teacher fill them."""
    rng = np.random.default_rng(seed)
    for t in sg.rollout.trajectories:
        t.sampler_entropy_S = np.where(t.loss_mask_S == 1, rng.uniform(0, 5, t.loss_mask_S.shape), 0).astype(np.float32)
    sg.teacher_entropy_S = [
        np.where(t.loss_mask_S == 1, rng.uniform(0, 5, t.loss_mask_S.shape), 0).astype(np.float32) for t in sg.rollout.trajectories
    ]
    turns = sg.rollout.canonical_turns()
    M = len(turns)
    recs = [sg.rollout.trajectories[i].turns[k] for i, k in turns]
    sg.teacher_response_M = [f"<action>look</action> 🙂 {m}" for m in range(M)]
    sg.student_thinking_M = [r.action for r in recs]  # action-only format: the action text stands in
    sg.student_action_M = [r.action for r in recs]
    sg.teacher_action_M = ["look" if m % 3 else "" for m in range(M)]

    def unit(texts):
        e = rng.normal(size=(M, D))
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        e[[not x for x in texts]] = 0
        return e.astype(np.float32)

    sg.student_thinking_emb_MD = unit(sg.student_thinking_M)
    sg.teacher_thinking_emb_MD = unit(sg.teacher_thinking_M)
    sg.student_action_emb_MD = unit(sg.student_action_M)
    sg.teacher_action_emb_MD = unit(sg.teacher_action_M)
    sg.cross_logprobs_M = [
        -rng.exponential(1.0, (len(sg.selected_sources_M[m]), r.response_end - r.response_start)).astype(np.float32)
        for m, r in enumerate(recs)
    ]
    return sg


def test_credit_fields_round_trip_exactly():
    sg = with_credit_fields(make_scored_group(G=3, turns=3, seed=4))
    # A target without sources has a [0, n_t] array: it must survive too.
    sg.selected_sources_M[0], sg.source_weights_M[0] = [], []
    sg.cross_logprobs_M[0] = np.zeros((0, sg.cross_logprobs_M[0].shape[1]), np.float32)
    data = encode(sg, LIMIT)
    back = decode(data, ScoredGroup, LIMIT, vocab_size=49_152)
    assert_same(sg, back)
    assert back.cross_logprobs_M[0].shape == (0, sg.cross_logprobs_M[0].shape[1])
    assert back.student_thinking_emb_MD.shape == (9, 384)
    # Size: the embeddings cost 4 x D x 4 bytes per turn (6 KiB at D = 384), plus a few bytes of header.
    plain = make_scored_group(G=3, turns=3, seed=4)
    plain.teacher_entropy_S = None
    for t in plain.rollout.trajectories:
        t.sampler_entropy_S = None
    extra = len(data) - len(encode(plain))
    M, S = 9, sum(t.token_ids_S.size for t in sg.rollout.trajectories)
    cross_bytes = sum(a.nbytes for a in sg.cross_logprobs_M)
    assert 4 * M * 384 * 4 + 2 * 4 * S + cross_bytes < extra < 4 * M * 384 * 4 + 2 * 4 * S + cross_bytes + 4096


def test_credit_fields_default_to_none_and_old_messages_decode():
    defaults = {f.name: f.default for f in dataclasses.fields(ScoredGroup)}
    assert defaults["teacher_entropy_S"] is None and defaults["cross_logprobs_M"] is None
    assert defaults["student_action_emb_MD"] is None
    assert {f.name: f.default for f in dataclasses.fields(Trajectory)}["sampler_entropy_S"] is None

    def strip(env):  # a message written before the optional fields existed
        for name in [f.name for f in dataclasses.fields(ScoredGroup)][-11:]:
            env["body"].pop(name)
        for t in env["body"]["rollout"]["trajectories"]:
            t.pop("sampler_entropy_S")

    full = encode(with_credit_fields(make_scored_group(G=2, turns=2, seed=1)))
    old = decode(tamper(full, strip), ScoredGroup, LIMIT)
    assert old.teacher_entropy_S is None and old.cross_logprobs_M is None and old.teacher_action_M is None
    assert old.teacher is None  # which teacher scored: unknown in a message from before the field
    named = with_credit_fields(make_scored_group(G=2, turns=2, seed=1))
    named.teacher = "model:/models/teacher"
    assert decode(encode(named), ScoredGroup, LIMIT).teacher == "model:/models/teacher"
    named.teacher = ""
    with pytest.raises(WireError, match="ScoredGroup.teacher: 1-4200 characters"):
        decode(encode(named), ScoredGroup, LIMIT)
    assert old.rollout.trajectories[0].sampler_entropy_S is None
    # Fields without a default are still required.
    with pytest.raises(WireError, match="missing field"):
        decode(tamper(full, lambda env: env["body"].pop("rho_M")), ScoredGroup, LIMIT)


def _broken(edit):
    """A full message (4 turns, every teacher thinking non-empty, teacher action 0 empty, some
    target with sources) broken by `edit`."""
    sg = with_credit_fields(make_scored_group(G=2, turns=2, seed=7))
    assert all(sg.teacher_thinking_M) and not sg.teacher_action_M[0] and any(sg.selected_sources_M)
    edit(sg)
    return sg


def _sourced(sg) -> int:
    """A target turn with at least one source (its cross log-probs are not empty)."""
    return next(t for t, src in enumerate(sg.selected_sources_M) if src)


def _set_emb(sg, name, value):
    setattr(sg, name, value)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda sg: sg.rollout.trajectories[0].sampler_entropy_S.__setitem__(np.flatnonzero(sg.rollout.trajectories[0].loss_mask_S)[0], np.nan),
         "sampler_entropy_S: contains NaN"),
        (lambda sg: setattr(sg.rollout.trajectories[1], "sampler_entropy_S", sg.rollout.trajectories[1].sampler_entropy_S[:-1]),
         "sampler_entropy_S: length"),
        (lambda sg: setattr(sg.rollout.trajectories[1], "sampler_entropy_S", sg.rollout.trajectories[1].sampler_entropy_S.astype(np.int32)),
         "expected dtype float32"),
        (lambda sg: sg.rollout.trajectories[0].sampler_entropy_S.__setitem__(np.flatnonzero(sg.rollout.trajectories[0].loss_mask_S)[0], -0.5),
         "negative entropy"),
        (lambda sg: sg.rollout.trajectories[0].sampler_entropy_S.__setitem__(0, 1.0), "nonzero off the loss mask"),
        (lambda sg: sg.teacher_entropy_S[1].__setitem__(np.flatnonzero(sg.rollout.trajectories[1].loss_mask_S)[0], np.inf),
         r"teacher_entropy_S\[1\]: contains NaN or inf"),
        (lambda sg: sg.teacher_entropy_S.pop(), "teacher_entropy_S count"),
        (lambda sg: sg.teacher_action_M.pop(), "teacher_action_M must have 4 entries"),
        (lambda sg: _set_emb(sg, "teacher_action_emb_MD", None), "all four or none"),
        (lambda sg: _set_emb(sg, "student_action_emb_MD", sg.student_action_emb_MD[:, :100]), r"expected shape \(4, 384\)"),
        (lambda sg: _set_emb(sg, "student_action_emb_MD", sg.student_action_emb_MD[:3]), r"expected shape \(4, 384\)"),
        (lambda sg: sg.teacher_thinking_emb_MD.__setitem__((1, 5), np.nan), "teacher_thinking_emb_MD: contains NaN"),
        (lambda sg: sg.teacher_thinking_emb_MD.__setitem__(1, 2 * sg.teacher_thinking_emb_MD[1]), "a row longer than 1"),
        (lambda sg: sg.teacher_action_emb_MD.__setitem__(0, sg.teacher_thinking_emb_MD[0]), "nonzero row for an empty text"),
        (lambda sg: sg.cross_logprobs_M.pop(), "cross_logprobs_M must have 4 entries"),
        (lambda sg: sg.cross_logprobs_M.__setitem__(0, np.zeros((len(sg.selected_sources_M[0]) + 1, sg.cross_logprobs_M[0].shape[1]), np.float32)),
         r"cross_logprobs_M\[0\]: expected shape"),
        (lambda sg: sg.cross_logprobs_M.__setitem__(1, sg.cross_logprobs_M[1][:, :-1]), r"cross_logprobs_M\[1\]: expected shape"),
        (lambda sg: sg.cross_logprobs_M[_sourced(sg)].__setitem__((..., 0), np.nan), r"cross_logprobs_M\[\d\]: contains NaN"),
        (lambda sg: sg.cross_logprobs_M[_sourced(sg)].__setitem__((..., 0), 0.5), r"cross_logprobs_M\[\d\]: a log-prob is positive"),
    ],
    ids=["s-nan", "s-length", "s-dtype", "s-negative", "s-off-mask", "t-inf", "t-count", "text-length", "emb-partial",
         "emb-width", "emb-rows", "emb-nan", "emb-norm", "emb-empty-text", "cross-count", "cross-K", "cross-n", "cross-nan",
         "cross-positive"],
)
def test_credit_fields_bad_values_rejected(edit, match):
    _broken(lambda sg: None).validate(vocab_size=49_152)  # the unbroken message is valid
    sg = _broken(edit)
    with pytest.raises(MessageError, match=match):
        sg.validate()
    with pytest.raises(WireError, match=match):
        encode(sg)


def test_entropy_above_log_vocab_rejected_and_nan_bytes_refused_on_decode():
    sg = with_credit_fields(make_scored_group(G=2, turns=2, seed=6))
    on = np.flatnonzero(sg.rollout.trajectories[0].loss_mask_S)[0]
    sg.rollout.trajectories[0].sampler_entropy_S[on] = 11.0  # > log(49152) = 10.80
    sg.validate()  # without a vocabulary size there is no upper bound
    with pytest.raises(MessageError, match=r"entropy > log\(vocab size\)"):
        sg.validate(vocab_size=49_152)
    data = encode(with_credit_fields(make_scored_group(G=2, turns=2, seed=6)))

    def nan_entropy(env):
        arr = np.frombuffer(env["body"]["teacher_entropy_S"][0]["data"], "<f4").copy()
        arr[-1] = np.nan
        env["body"]["teacher_entropy_S"][0]["data"] = arr.tobytes()

    with pytest.raises(WireError, match=r"teacher_entropy_S\[0\]: contains NaN"):
        decode(tamper(data, nan_entropy), ScoredGroup, LIMIT)

    def wrong_cross_shape(env):
        env["body"]["cross_logprobs_M"][0]["shape"] = [1, 1]

    with pytest.raises(WireError, match="data bytes for shape"):
        decode(tamper(data, wrong_cross_shape), ScoredGroup, LIMIT)
