"""The embedder service with the real encoder: /embed, /correspond, FAISS = numpy, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from opsd.config import AlignSection, EmbedderSection
from opsd.embedding_api import EMBEDDING_FIELDS, CorrespondResponse
from opsd.encoder import Encoder
from services.embedder.app import build_app, cosine_matrix_faiss


@pytest.fixture(scope="module")
def encoder():
    return Encoder("all-MiniLM-L6-v2")


TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def client(encoder):
    app = build_app(EmbedderSection(max_texts=64, max_text_chars=500), encoder, TOKEN)
    return TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"})


def test_embed_unit_vectors_and_zero_for_empty(client):
    r = client.post("/embed", json={"texts": ["open the box", "", "   ", "go   north 🙂"]})
    assert r.status_code == 200
    vecs = np.asarray(r.json()["vectors"], dtype=np.float32)
    assert vecs.shape == (4, 384)
    assert np.allclose(np.linalg.norm(vecs[[0, 3]], axis=1), 1.0, atol=1e-5)
    assert not vecs[1].any() and not vecs[2].any()  # empty thinking -> zero vector, cosine 0 (case 19)


def test_faiss_similarity_equals_numpy_and_drops_missing_ids(encoder):
    a = encoder.embed(["take the key", "open the chest", ""])
    b = encoder.embed(["take key", "unlock chest with key"])
    H = cosine_matrix_faiss(a, b)  # k = len(b) < rows of a: no -1 ids may leak in (case 18)
    assert np.allclose(H, a @ b.T, atol=1e-6)
    assert not H[2].any() and np.isfinite(H).all()


def test_correspond_matches_siblings_only(client):
    turns = [
        {"rollout_id": "r00", "turn_id": 0, "student_text": "take the key", "teacher_text": "take the key",
         "student_valid": True, "teacher_valid": True},
        {"rollout_id": "r00", "turn_id": 1, "student_text": "open the chest", "teacher_text": "open the chest",
         "student_valid": True, "teacher_valid": True},
        {"rollout_id": "r01", "turn_id": 0, "student_text": "take key", "teacher_text": "take the key",
         "student_valid": True, "teacher_valid": True},
        {"rollout_id": "r01", "turn_id": 1, "student_text": "", "teacher_text": "open chest",
         "student_valid": False, "teacher_valid": True},
    ]
    align = AlignSection(similarity_threshold=0.5, top_k=2, action_filter_enabled=False).model_dump()
    r = client.post("/correspond", json={"task_id": "g0", "turns": turns, "align": align})
    assert r.status_code == 200, r.text
    out = r.json()
    elig = np.asarray(out["eligible"])
    # Same rollout is never eligible; an invalid student thinking has no sources.
    assert not elig[0, 1] and not elig[1, 0] and not elig[:, 3].any()
    assert elig[0, 2] and elig[2, 0]
    assert out["selected_sources"][3] == []
    for t, src in enumerate(out["selected_sources"]):
        assert all(turns[s]["rollout_id"] != turns[t]["rollout_id"] for s in src)
        if src:
            assert abs(sum(out["source_weights"][t]) - 1.0) < 1e-5
            assert 0.0 < out["alpha"][t] <= 0.8 + 1e-6  # the cap, sent as a float32 (0.800000011920929)
    # "take the key" (teacher, r00 t0) vs "take key" (student, r01 t0) is the best match for target 2.
    assert out["selected_sources"][2][0] == 0


def test_bad_requests_are_rejected_clearly(client):
    r = client.post("/embed", json={"texts": ["x"] * 65})
    assert r.status_code == 413 and "65 texts exceed the limit of 64" in r.json()["detail"]
    r = client.post("/embed", json={"texts": ["x" * 501]})
    assert r.status_code == 413 and "exceed 500 characters" in r.json()["detail"]
    r = client.post("/embed", json={"texts": "not a list"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "texts"]
    r = client.post("/embed", json={"texts": ["a"], "extra": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "extra_forbidden"
    r = client.post("/correspond", json={"task_id": "g", "turns": []})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "turns"]
    r = client.post("/embed", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


def test_the_app_is_never_built_without_a_token(encoder):
    with pytest.raises(ValueError, match="non-empty API token"):
        build_app(EmbedderSection(), encoder, "")


def test_correspond_returns_the_compared_embeddings_on_request(client, encoder):
    turns = [
        {"rollout_id": "r00", "turn_id": 0, "student_text": "take the key", "teacher_text": "take the key",
         "student_valid": True, "teacher_valid": True, "student_action": "take key", "teacher_action": "take key"},
        {"rollout_id": "r01", "turn_id": 0, "student_text": "take key", "teacher_text": "open chest",
         "student_valid": True, "teacher_valid": True, "student_action": "take key", "teacher_action": ""},
        {"rollout_id": "r01", "turn_id": 1, "student_text": "", "teacher_text": "open chest",
         "student_valid": False, "teacher_valid": True, "student_action": "", "teacher_action": "open chest"},
    ]
    align = AlignSection(similarity_threshold=0.5, top_k=2, action_filter_enabled=False).model_dump()
    plain = client.post("/correspond", json={"task_id": "g0", "turns": turns, "align": align}).json()
    assert all(plain[k] is None for k in EMBEDDING_FIELDS)  # off by default: the response stays small
    r = client.post("/correspond", json={"task_id": "g0", "turns": turns, "align": align, "return_embeddings": True})
    assert r.status_code == 200, r.text
    out = CorrespondResponse.model_validate(r.json()).check(3)
    st, tt, sa, ta = (np.asarray(getattr(out, k), dtype=np.float32) for k in EMBEDDING_FIELDS)
    assert st.shape == tt.shape == sa.shape == ta.shape == (3, 384)
    # The encoder's vectors (a text's padding inside its batch moves the last float32 bits: 1e-6);
    # the invalid student thinking is an exact zero row.
    np.testing.assert_allclose(tt, encoder.embed([t["teacher_text"] for t in turns]), atol=1e-6)
    np.testing.assert_allclose(st[:2], encoder.embed(["take the key", "take key"]), atol=1e-6)
    assert not st[2].any() and not ta[1].any() and not sa[2].any()
    np.testing.assert_allclose(sa, encoder.embed([t["student_action"] for t in turns]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.similarity), np.clip(tt @ st.T, -1, 1), atol=1e-6)
    # The rest of the answer does not change when the embeddings are asked for.
    assert {k: v for k, v in r.json().items() if k not in EMBEDDING_FIELDS} == {k: v for k, v in plain.items() if k not in EMBEDDING_FIELDS}


def test_correspond_response_check_rejects_bad_embeddings():
    base = {"similarity": [[0.0, 0.5], [0.5, 0.0]], "eligible": [[False, True], [True, False]],
            "selected_sources": [[1], [0]], "source_weights": [[1.0], [1.0]], "rho": [0.1, 0.1], "alpha": [0.1, 0.1]}
    good = {k: [[1.0, 0.0], [0.0, 0.0]] for k in EMBEDDING_FIELDS}
    CorrespondResponse.model_validate({**base, **good}).check(2)
    bad = [
        ({**good, "teacher_action_emb": None}, "all four or none"),
        ({**good, "student_action_emb": [[1.0, 0.0]]}, "must be 2x2"),
        ({**good, "student_action_emb": [[1.0, 0.0], [0.0]]}, "must be 2x2"),
        ({**good, "teacher_thinking_emb": [[math.nan, 0.0], [0.0, 0.0]]}, "must be finite"),
        ({**good, "student_thinking_emb": [[2.0, 0.0], [0.0, 0.0]]}, "longer than 1"),
        ({k: [[], []] for k in EMBEDDING_FIELDS}, "width 0"),
    ]
    for emb, match in bad:
        with pytest.raises(ValueError, match=match):
            CorrespondResponse.model_validate({**base, **emb}).check(2)


def test_the_embedders_own_answers_pass_the_teachers_check(client):
    texts = ["take the key", "open the chest", "go north", "take key", "unlock chest", "go south", "look", "eat apple"]
    turns = [{"rollout_id": f"r{m % 4}", "turn_id": m // 4, "student_text": t, "teacher_text": texts[-1 - m],
              "student_valid": True, "teacher_valid": True} for m, t in enumerate(texts)]
    for temperature in (1e-3, 0.1, 10.0):  # one-hot, peaked and flat softmax weights
        align = AlignSection(similarity_threshold=-1.0, top_k=8, source_rollout_cap=2, aggregation_temperature=temperature,
                             alpha_max=1.0, action_filter_enabled=False).model_dump()
        r = client.post("/correspond", json={"task_id": "g0", "turns": turns, "align": align})
        assert r.status_code == 200, r.text
        out = CorrespondResponse.model_validate(r.json()).check(len(turns))
        assert all(len(s) == 6 for s in out.selected_sources)  # 3 sibling rollouts x cap 2: the sum check ran


def test_correspond_response_check_rejects_answers_the_embedder_cannot_give():
    # Turns 0, 1 in rollout r0 and turn 2 in r1: 0 and 1 may only use 2, and 2 uses 0 and 1.
    elig = [[False, False, True], [False, False, True], [True, True, False]]
    base = {"similarity": [[0.0, 0.1, 0.9], [0.1, 0.0, 0.8], [0.9, 0.8, 0.0]], "eligible": elig,
            "selected_sources": [[2], [2], [0, 1]], "source_weights": [[1.0], [1.0], [0.6, 0.4]],
            "rho": [0.5, 0.4, 0.45], "alpha": [0.4, 0.32, 0.36]}
    CorrespondResponse.model_validate(base).check(3)
    CorrespondResponse.model_validate({**base, "rho": [0.0, 1.0, 0.0], "alpha": [1.0, 0.0, 0.0]}).check(3)
    bad = [
        ({"alpha": [1.5, 0.3, 0.3]}, "alpha must lie in"),
        ({"alpha": [-0.5, 0.3, 0.3]}, "alpha must lie in"),
        ({"rho": [99.0, 0.3, 0.3]}, "rho must lie in"),
        ({"rho": [math.nan, 0.3, 0.3]}, "rho must lie in"),
        ({"selected_sources": [[2], [2], [0, 0]], "source_weights": [[1.0], [1.0], [0.5, 0.5]]}, "twice"),
        ({"selected_sources": [[0], [2], [0, 1]]}, "not eligible"),  # turn 0 its own source
        ({"selected_sources": [[1], [2], [0, 1]]}, "not eligible"),  # a turn of its own rollout
        ({"source_weights": [[1e300], [1.0], [0.6, 0.4]]}, "finite"),  # finite in float64, inf in float32
        ({"source_weights": [[0.0], [1.0], [0.6, 0.4]]}, "do not sum to 1"),
        ({"source_weights": [[1.0], [1.0], [0.6, 0.6]]}, "do not sum to 1"),
        ({"similarity": [[0.0, 0.1, 2.0], [0.1, 0.0, 0.8], [0.9, 0.8, 0.0]]}, "cosines in"),
        ({"similarity": [[0.0, 0.1, 1e300], [0.1, 0.0, 0.8], [0.9, 0.8, 0.0]]}, "cosines in"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            CorrespondResponse.model_validate({**base, **change}).check(3)


def test_loading_the_encoder_draws_no_progress_bar_into_a_file(capfd):
    """stderr captured (not a terminal), as the embedder's log file is: transformers' "Loading weights" tqdm
    bar, on by default in a fresh process, stays off (a newcomer found it in logs/embedder.log, issue 24)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process: another test may have turned the bars off
    try:
        Encoder("all-MiniLM-L6-v2")
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s]" not in err, err
