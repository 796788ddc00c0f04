"""TextWorld adapter: deterministic generation, cache, walkthrough wins, cleaning, caps."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from opsd.config import EnvSection
from opsd.envs.textworld import GameSpec, TextWorldEnv, clean_observation, load_game, make_games

CFG = EnvSection(game_pool=2, seed=1234, world_size=1, nb_objects=3, quest_length=1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def specs(cache) -> list[GameSpec]:
    return make_games(CFG, cache)


def _game_structure(spec: GameSpec) -> dict:
    # The .z8 embeds a compile date (Inform serial number); the game's json is the structure.
    data = json.loads(Path(spec.path).with_suffix(".json").read_text())
    data.get("metadata", {}).pop("uuid", None)
    return data


def test_generation_is_deterministic_and_cached(specs, cache, tmp_path):
    assert [s.seed for s in specs] == [1234, 1235]
    assert len({s.task_id for s in specs}) == 2
    for s in specs:
        p = Path(s.path)
        assert p.is_file() and p.with_suffix(".json").is_file()
        assert p.parent.parent == cache / "textworld" and p.name == f"game_{s.seed}.z8"
        assert s.walkthrough and s.objective
        assert json.loads(json.dumps(s.to_dict())) == s.to_dict()  # JSON-able
        assert GameSpec.from_dict(s.to_dict()) == s
    # A second call reuses the cache (same files, untouched).
    mtimes = [Path(s.path).stat().st_mtime_ns for s in specs]
    again = make_games(CFG, cache)
    assert again == specs and [Path(s.path).stat().st_mtime_ns for s in again] == mtimes
    # A fresh cache regenerates the very same games.
    fresh = make_games(CFG.model_copy(update={"game_pool": 1}), tmp_path)
    assert fresh[0].walkthrough == specs[0].walkthrough and fresh[0].task_id == specs[0].task_id
    assert _game_structure(fresh[0]) == _game_structure(specs[0])
    # Other options land in another cache folder.
    other = CFG.model_copy(update={"nb_objects": 4})
    from opsd.envs.textworld import _options_dict, game_path

    assert game_path(cache, _options_dict(other), 1234).parent != Path(specs[0].path).parent


def _gen_worker(args):
    cache, seed = args
    cfg = CFG.model_copy(update={"game_pool": 1, "seed": seed})
    return make_games(cfg, Path(cache))[0].to_dict()


def test_concurrent_generation_is_safe(tmp_path):
    # Two processes race for the same game: both get the same complete spec.
    with mp.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_gen_worker, [(str(tmp_path), 1300), (str(tmp_path), 1300)])
    assert a == b
    folder = Path(a["path"]).parent
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) == ["game_1300.json", "game_1300.z8"]


def test_load_game_regenerates_missing_file(specs, tmp_path):
    spec = load_game(specs[0].to_dict(), tmp_path)
    assert Path(spec.path).is_file() and spec.path != specs[0].path
    assert spec.walkthrough == specs[0].walkthrough and spec.task_id == specs[0].task_id


def test_walkthrough_wins(specs):
    for s in specs:
        with TextWorldEnv(s) as env:
            first = env.reset()
            assert not first.done and first.reward == 0.0
            assert " ".join(s.objective.split()) in first.observation  # the opening states the objective
            assert env.walkthrough() == s.privileged_info() == "Walkthrough: " + " > ".join(s.walkthrough)
            assert first.policy_commands == s.walkthrough
            for cmd in s.walkthrough:
                assert cmd in first.admissible_commands or len(s.walkthrough) > 1
                step = env.step(cmd)
            assert step.won and step.done and not step.lost and step.reward == 1.0
            with pytest.raises(RuntimeError):
                env.step("look")


def test_unknown_command_does_not_crash(specs):
    env = TextWorldEnv(specs[0])
    try:
        env.reset()
        for cmd in ["xyzzy plugh", "", "look\ninventory", "🙂 dance " * 50]:
            step = env.step(cmd)
            assert not step.done and step.reward == 0.0 and step.admissible_commands
            assert "\ufffd" not in step.observation
    finally:
        env.close()
    env.close()  # closing twice is harmless


def test_observation_clean_and_cap(specs):
    with TextWorldEnv(specs[0], max_observation_chars=40) as env:
        obs = env.reset().observation
    assert len(obs) <= 40 and obs.endswith("...")
    with TextWorldEnv(specs[0]) as env:
        full = env.reset().observation
    assert "$$" not in full and "___" not in full  # banner gone
    assert "\n\n\n" not in full and "  " not in full and full == full.strip()
    assert not full.rstrip().endswith("=-") and ">" not in full  # no status line / prompt

    raw = "\n\n  ____  \n | $$ \\$$\n\nHello   world.\n\n\n\nYou see 🙂.\n>     -= Attic =-0/1"
    assert clean_observation(raw, 100) == "Hello world.\n\nYou see 🙂."
    assert clean_observation(raw, 16) == "Hello world...."  # cut at 13 chars, trailing newline dropped, "..." added


def test_control_characters_and_meta_commands_never_reach_the_interpreter(specs, tmp_path, monkeypatch):
    """A NUL crashed (segfault) or hung Jericho; "save"/"restore" wrote and read files in the working
    directory. Both are stopped before the interpreter: the first is stripped, the second refused."""
    monkeypatch.chdir(tmp_path)
    with TextWorldEnv(specs[0]) as env:
        env.reset()
        step = env.step("look\x00 around")
        assert not step.won and step.observation
        remaining = step.policy_commands
        assert remaining == list(specs[0].walkthrough)  # looking changed nothing
        for meta in ("save", "restore", "SAVE game", "script", "quit", "restart", "\x00"):
            step = env.step(meta)
            assert step.invalid_action and not step.done and "not available" in step.observation, meta
            assert step.policy_commands == remaining, meta  # a refusal keeps the state, so the hint too
        assert list(tmp_path.iterdir()) == [], "a command wrote a file into the working directory"
        for cmd in specs[0].walkthrough:  # the game still plays to a win afterwards
            step = env.step(cmd)
        assert step.won


def test_a_task_spec_never_chooses_where_games_are_written(tmp_path):
    from opsd.envs import EnvContext, Task
    from opsd.envs import textworld as tw

    target = tmp_path / "outside" / ".." / "escaped" / "game_1.z8"
    spec = {"task_id": "t", "seed": 1, "path": str(target), "walkthrough": [],
            "options": tw._options_dict(EnvSection(game_pool=1))}
    with tw.open_env(Task("t", "1-step", spec), EnvSection(), EnvContext(cache_dir=tmp_path / "cache")) as env:
        assert env.reset().observation
    assert not (tmp_path / "escaped").exists() and any((tmp_path / "cache").rglob("game_1.z8"))
