"""Content digests of published policy versions (opsd.weights): a version rewritten with other weights is reloaded.

A trainer resumed from an older checkpoint trains the versions after it again and, training not being
bit-deterministic, rewrites their files with other weights under the same numbers. Workers key what they
hold on (version, digest), the digest read from the file's safetensors header.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from opsd.config import LoRASection, ModelSection
from opsd.models.hf import HFBackend
from opsd.weights import (DIGEST_KEY, VersionGate, ema_path, ensure_version, published_digest, tensor_digest,
                          weights_path)
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-digest"))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """What a second, non-deterministic run of the same training step leaves: slightly different weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def test_published_files_record_the_digest_of_their_tensors(tiny_dir, tmp_path):
    from opsd.lora import apply_lora
    from services.trainer.ema import PolicyEMA

    trainer = HFBackend(ModelSection(name=str(tiny_dir)))
    trainer.policy_version = 1
    path = weights_path(tmp_path, 1)
    trainer.save_weights(path)
    digest = published_digest(path)
    assert digest is not None and len(digest) == 64
    # The digest is of the tensors saved (the tied embedding / LM head once), so anyone can check a file.
    assert digest == tensor_digest(_load(path)) == tensor_digest(trainer.model.state_dict())
    trainer.save_weights(path)  # the same weights again: the same digest
    assert published_digest(path) == digest
    _perturb(trainer.model, 0)
    trainer.save_weights(path)
    assert published_digest(path) not in (None, digest)

    ema = PolicyEMA(trainer.model, 0.9)  # the teacher's average (teacher.version ema:D) records one too
    ema.save(ema_path(tmp_path, 1), 1)
    assert published_digest(ema_path(tmp_path, 1)) == tensor_digest(_load(ema_path(tmp_path, 1)))

    apply_lora(trainer.model, LoRASection(r=2, alpha=4.0))  # trainer.lora: the file holds the adapter alone
    trainer.save_weights(weights_path(tmp_path, 2))
    assert published_digest(weights_path(tmp_path, 2)) == tensor_digest(_load(weights_path(tmp_path, 2)))

    # Unknown, never an error: a file without a digest (an older run's), a missing file, a file that is no safetensors.
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "old.safetensors"), metadata={"format": "pt"})
    (tmp_path / "junk.safetensors").write_bytes(b"x")
    assert published_digest(tmp_path / "old.safetensors") is None
    assert published_digest(tmp_path / "missing.safetensors") is None
    assert published_digest(tmp_path / "junk.safetensors") is None


def test_tensor_digest_sees_names_dtypes_shapes_and_values():
    w = torch.arange(6, dtype=torch.float32)
    base = tensor_digest({"w": w})
    assert tensor_digest({"w": w.clone()}) == base
    assert len({base, tensor_digest({"v": w}), tensor_digest({"w": w.to(torch.bfloat16)}),
                tensor_digest({"w": w.reshape(2, 3)}), tensor_digest({"w": w + 1})}) == 5
    assert tensor_digest({"a": w, "b": w}) == tensor_digest({"a": w})  # shared memory (a tie) counts once
    assert tensor_digest({"a": w, "b": w.clone()}) != tensor_digest({"a": w})


def test_a_version_republished_with_other_weights_is_reloaded(tiny_dir, tmp_path):
    """The issue's case, on the real backend: v1 published, loaded, rewritten by a resumed trainer with other
    weights. Before digests the worker kept serving the old v1."""
    trainer = HFBackend(ModelSection(name=str(tiny_dir)))
    worker = HFBackend(ModelSection(name=str(tiny_dir)))
    trainer.policy_version = 1
    _perturb(trainer.model, 1)
    trainer.save_weights(weights_path(tmp_path, 1))
    assert ensure_version(worker, tmp_path, 1) is True
    assert ensure_version(worker, tmp_path, 1) is False  # same version, same content: no reload
    first = {n: p.detach().clone() for n, p in worker.model.named_parameters()}

    trainer.save_weights(weights_path(tmp_path, 1))  # a resumed trainer rewrites v1 with the same weights
    assert ensure_version(worker, tmp_path, 1) is False

    _perturb(trainer.model, 2)  # ... or, training again non-deterministically, with other weights
    trainer.save_weights(weights_path(tmp_path, 1))
    assert ensure_version(worker, tmp_path, 1) is True and worker.policy_version == 1
    assert worker.policy_digest == published_digest(weights_path(tmp_path, 1))
    for n, p in worker.model.named_parameters():
        assert torch.equal(p, dict(trainer.model.named_parameters())[n]) and not torch.equal(p, first[n])
    assert ensure_version(worker, tmp_path, 1) is False


def test_the_digest_held_is_the_one_verified_while_loading(tiny_dir, tmp_path):
    """A file that records no digest (an older run's, or written by hand) was held as "unknown", so the trainer's
    rewrite of that version with other weights was never loaded: the worker served the old ones. What a worker
    holds is now named by the digest computed from the bytes it loaded (issue 37)."""
    from safetensors.torch import save_model

    trainer = HFBackend(ModelSection(name=str(tiny_dir)))
    worker = HFBackend(ModelSection(name=str(tiny_dir)))
    _perturb(trainer.model, 3)
    path = weights_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    save_model(trainer.model, str(path), metadata={"format": "pt"})  # safetensors' own writer: no digest recorded
    assert published_digest(path) is None
    assert ensure_version(worker, tmp_path, 1) is True
    assert worker.policy_digest == tensor_digest(_load(path)) == tensor_digest(trainer.model.state_dict())
    assert ensure_version(worker, tmp_path, 1) is False  # the file still records none: unknown, kept

    _perturb(trainer.model, 4)  # a resumed trainer rewrites v1 with other weights, recording their digest
    trainer.policy_version = 1
    trainer.save_weights(path)
    assert ensure_version(worker, tmp_path, 1) is True and worker.policy_digest == published_digest(path)
    for n, p in worker.model.named_parameters():
        assert torch.equal(p, dict(trainer.model.named_parameters())[n])


def test_a_version_rewritten_under_the_digest_it_recorded_is_refused_never_mixed(tiny_dir, tmp_path):
    """v1 rewritten with other tensors whose header still records the first digest (no trainer writes that:
    a corrupted or forged file). Whoever loads it refuses it and keeps its weights; a worker holding v1 is not
    told (the held check reads the header only) and serves exactly the weights that digest names."""
    from opsd.weights_io import WeightsError

    trainer = HFBackend(ModelSection(name=str(tiny_dir)))
    worker = HFBackend(ModelSection(name=str(tiny_dir)))
    fresh = HFBackend(ModelSection(name=str(tiny_dir)))
    path = weights_path(tmp_path, 1)
    _perturb(trainer.model, 5)
    trainer.policy_version = 1
    trainer.save_weights(path)
    held = published_digest(path)
    assert ensure_version(worker, tmp_path, 1) is True
    first = {n: p.detach().clone() for n, p in worker.model.named_parameters()}

    _perturb(trainer.model, 6)
    trainer.save_weights(path)
    data = bytearray(path.read_bytes())
    at = data.index(published_digest(path).encode())
    data[at:at + 64] = held.encode()  # the header claims the first version's digest again
    path.write_bytes(bytes(data))
    assert published_digest(path) == held

    initial = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    with pytest.raises(WeightsError, match=f"content digest [0-9a-f]{{64}} differs from the recorded {held}"):
        ensure_version(fresh, tmp_path, 1)
    assert fresh.policy_version == 0 and getattr(fresh, "policy_digest", None) is None
    assert all(torch.equal(p, initial[n]) for n, p in fresh.model.named_parameters())

    assert ensure_version(worker, tmp_path, 1) is False
    assert worker.policy_digest == held == tensor_digest(worker.model.state_dict())
    assert all(torch.equal(p, first[n]) for n, p in worker.model.named_parameters())


class _Engine:
    """The members ensure_version and VersionGate use: policy_version and load_weights (numpy files)."""

    def __init__(self):
        self.policy_version, self.loads = 0, []

    def load_weights(self, path, version):
        from safetensors.numpy import load_file

        self.w = load_file(str(path))["w"]  # FileNotFoundError when missing
        self.loads.append(version)
        self.policy_version = version


def _publish(run_dir, version: int, value: float, digest: str | None, path_of=weights_path) -> None:
    from safetensors.numpy import save_file

    path = path_of(run_dir, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full(2, value, np.float32)}, str(path), metadata={DIGEST_KEY: digest} if digest else None)


def test_unknown_digests_and_pruned_files_never_cause_a_reload(tmp_path):
    eng = _Engine()
    _publish(tmp_path, 0, 0.0, "d0")  # version 0 from the model cache: its published file is the same model
    assert ensure_version(eng, tmp_path, 0) is False and eng.loads == []
    _publish(tmp_path, 1, 1.0, None)  # an older run's file: no digest
    assert ensure_version(eng, tmp_path, 1) is True
    _publish(tmp_path, 1, 1.5, None)
    assert ensure_version(eng, tmp_path, 1) is False and eng.loads == [1]
    _publish(tmp_path, 2, 2.0, "d2")
    assert ensure_version(eng, tmp_path, 2) is True and eng.policy_digest == "d2"
    _publish(tmp_path, 2, 2.0, None)  # rewritten without a digest: unknown, keep it
    assert ensure_version(eng, tmp_path, 2) is False
    weights_path(tmp_path, 2).unlink()  # pruned while held: serve what is held, as before
    assert ensure_version(eng, tmp_path, 2) is False and eng.loads == [1, 2]
    # The teacher's moving average (path_of=ema_path) is checked the same way.
    _publish(tmp_path, 3, 3.0, "e1", ema_path)
    assert ensure_version(eng, tmp_path, 3, ema_path) is True
    _publish(tmp_path, 3, 3.5, "e2", ema_path)
    assert ensure_version(eng, tmp_path, 3, ema_path) is True and eng.w[0] == 3.5 and eng.loads == [1, 2, 3, 3]


def test_version_gate_drains_then_reloads_a_republished_version(tmp_path):
    """Groups in flight: a group of the version held, whose file was rewritten, waits until the groups running on
    the old weights finish, then runs on the reloaded ones; no group mixes the two."""
    _publish(tmp_path, 1, 1.0, "a")
    eng = _Engine()
    gate = VersionGate(eng, tmp_path)
    with gate.serving(1):
        assert eng.loads == [1] and eng.w[0] == 1.0
    hold, started, seen = threading.Event(), threading.Event(), []

    def first():
        with gate.serving(1):
            started.set()
            hold.wait(10)
            seen.append(("first", float(eng.w[0])))

    def second():
        with gate.serving(1):
            seen.append(("second", float(eng.w[0])))

    t1 = threading.Thread(target=first)
    t1.start()
    assert started.wait(10)
    _publish(tmp_path, 1, 1.25, "b")  # the trainer, resumed, rewrites v1
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join(0.3)
    assert t2.is_alive() and seen == []  # waits for the group on the old weights
    hold.set()
    t1.join(10)
    t2.join(10)
    assert seen == [("first", 1.0), ("second", 1.25)] and eng.loads == [1, 1] and eng.policy_digest == "b"
    with gate.serving(1):  # the same digest again: no load
        pass
    assert eng.loads == [1, 1]
