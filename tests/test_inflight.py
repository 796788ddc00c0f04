"""Many groups in flight (services/rollout/inflight.py, opsd.weights.VersionGate) on real TextWorld and SmolLM2.

Each episode samples through the shared HFEngine with one seed per turn, so
every turn must be exactly what `HFBackend.generate([that turn's prompt],
seed=request_seed(...))` gives (ids equal, log-probs within float32 rounding),
whatever the other episodes and groups did meanwhile.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from opsd.chat import ChatFormat
from opsd.config import EnvSection, RolloutSection
from opsd.envs import EnvContext
from opsd.envs.textworld import make_games
from opsd.models.hf_engine import HFEngine
from opsd.types import TaskGroup
from opsd.weights import VersionGate
from services.rollout.inflight import play_group, request_seed

ENV = EnvSection(game_pool=2, seed=1234, max_turns=3)
ROLLOUT = RolloutSection(group_size=2, max_new_tokens=8, temperature=1.0)
TOL = 1e-4  # nats: float32 rounding of other batch shapes and of a cached prefix


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    return make_games(ENV, tmp_path_factory.mktemp("games"))


@pytest.fixture(scope="module")
def engine(policy_backend):
    eng = HFEngine(policy_backend, max_batch=16, kv_cache_bytes=512 << 20)
    yield eng
    eng.close()


def _task(game, gid: str) -> TaskGroup:
    return TaskGroup(group_id=gid, task_id=game.task_id, step=0, policy_version=0, group_size=ROLLOUT.group_size,
                     env="textworld", game=game.to_dict(), privileged_info=game.privileged_info(),
                     max_turns=ENV.max_turns)


def test_groups_in_flight_sample_each_turn_as_it_would_alone(policy_backend, engine, games, tmp_path):
    chat = ChatFormat(policy_backend.tokenizer, "action")
    ctx = EnvContext(cache_dir=tmp_path)
    tasks = [_task(games[i % 2], f"g{i}") for i in range(3)]
    seeds = [11, 12, 13]  # three groups x two episodes in flight at once
    hits0 = engine.stats().prefix_hits
    with ThreadPoolExecutor(max_workers=3) as pool:  # three groups at once, as three job threads would hold them
        results = list(pool.map(lambda ts: play_group(ts[0], engine, policy_backend, chat, ENV, ROLLOUT, 2048, ts[1], ctx),
                                zip(tasks, seeds)))
    assert engine.in_flight() == 0 and engine.stats().kv_cache_usage == 0.0  # every episode released its KV
    turns_after_the_first = 0
    for (group, stats), seed in zip(results, seeds):
        group.validate(policy_backend.vocab_size)
        assert [t.rollout_id for t in group.trajectories] == ["r00", "r01"]
        assert stats.turns == sum(len(t.turns) for t in group.trajectories) == stats.generate_calls
        for i, traj in enumerate(group.trajectories):
            ids = traj.token_ids_S.tolist()
            assert traj.ending in ("won", "lost", "done", "max_turns", "truncated")
            for turn in traj.turns:
                prompt = ids[: turn.response_start]
                want = policy_backend.generate([prompt], ROLLOUT.max_new_tokens, ROLLOUT.temperature,
                                               seed=request_seed(seed, i, turn.turn_id))[0]
                assert ids[turn.response_start : turn.response_end] == want.token_ids
                np.testing.assert_allclose(traj.sampler_logprobs_S[turn.response_start : turn.response_end],
                                           want.logprobs, atol=TOL, rtol=0)
                assert traj.loss_mask_S[turn.response_start : turn.response_end].all()
                assert not traj.loss_mask_S[: turn.response_start][-1]
                turns_after_the_first += turn.turn_id > 0
    # Every turn after an episode's first resumed from its kept KV.
    assert turns_after_the_first > 0 and engine.stats().prefix_hits > hits0


def test_an_env_that_never_starts_fails_its_group_and_stops_the_siblings(policy_backend, engine, games, tmp_path,
                                                                        monkeypatch):
    import services.rollout.episodes as episodes
    from opsd.envs import get_adapter

    adapter = get_adapter("textworld")
    real_open, opened = adapter.open_env, []

    def second_never_starts(task, cfg, ctx):
        opened.append(1)
        if len(opened) >= 2:
            raise ConnectionError("env server down")
        return real_open(task, cfg, ctx)

    monkeypatch.setattr(episodes, "START_BACKOFF_S", 0.0)
    monkeypatch.setattr(adapter, "open_env", second_never_starts)
    chat = ChatFormat(policy_backend.tokenizer, "action")
    with pytest.raises(RuntimeError, match="failed to start"):
        play_group(_task(games[0], "g-bad"), engine, policy_backend, chat, ENV, ROLLOUT, 2048, 1,
                   EnvContext(cache_dir=tmp_path))
    assert engine.in_flight() == 0 and engine.stats().kv_cache_usage == 0.0


class _FakeEngine:
    def __init__(self):
        self.policy_version, self.loads = 0, []

    def load_weights(self, path, version):
        if not path.is_file():
            raise FileNotFoundError(path)
        self.loads.append(version)
        self.policy_version = version


def test_version_gate_serves_the_lowest_version_first_and_never_mixes(tmp_path):
    (tmp_path / "weights").mkdir()
    for v in (1, 2):
        (tmp_path / "weights" / f"policy-v{v:05d}.safetensors").write_bytes(b"x")
    eng = _FakeEngine()
    switches = []
    gate = VersionGate(eng, tmp_path, on_switch=lambda d, s: switches.append((d, s)))
    log, lock = [], threading.Lock()

    def group(version: int, hold: threading.Event | None = None):
        with gate.serving(version):
            with lock:
                log.append(("start", version, eng.policy_version))
            if hold is not None:
                hold.wait(60)  # a hang guard: released once the next group has started
            with lock:
                log.append(("end", version, eng.policy_version))

    release = threading.Event()
    first = threading.Thread(target=group, args=(0, release))
    first.start()
    while gate.running != 1:
        time.sleep(0.001)
    later = [threading.Thread(target=group, args=(v,)) for v in (2, 1, 0)]
    for t in later:
        t.start()
    # v0 may join the running v0 group only if no lower version waits: it does (nothing lower than 0).
    deadline = time.monotonic() + 60  # a hang guard: a loaded machine may start the threads late
    while sum(1 for e in log if e[0] == "start") < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    for t in [first, *later]:
        t.join(60)
    assert all(v == held for _, v, held in log), log  # every group ran on its own version
    starts = [v for kind, v, _ in log if kind == "start"]
    assert starts == [0, 0, 1, 2]  # lowest first; v1 and v2 each loaded after the drain
    assert eng.loads == [1, 2] and len(switches) == 2 and switches[0][0] > 0  # the switch to v1 waited for v0's drain
    # A missing version fails that group alone; the engine keeps what it held.
    with pytest.raises(FileNotFoundError):
        with gate.serving(5):
            pass
    assert eng.policy_version == 2 and gate.running == 0


def test_groups_in_flight_default_to_one_on_transformers_and_several_on_vllm():
    from opsd.config import RunConfig

    hf = RunConfig()
    assert (hf.groups_in_flight("rollout"), hf.groups_in_flight("teacher")) == (1, 1)  # lockstep, bit-reproducible
    vllm = RunConfig.model_validate({"model": {"backend": "vllm"}})
    assert (vllm.groups_in_flight("rollout"), vllm.groups_in_flight("teacher")) == (16, 8)
    set_ = RunConfig.model_validate({"model": {"backend": "vllm"}, "rollout": {"max_groups_in_flight": 2},
                                     "teacher": {"max_groups_in_flight": 1}})
    assert (set_.groups_in_flight("rollout"), set_.groups_in_flight("teacher")) == (2, 1)
    with pytest.raises(ValueError):
        RunConfig.model_validate({"rollout": {"max_groups_in_flight": 0}})
