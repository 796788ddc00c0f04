"""Environment adapters: reset/step text games with terminal rewards and privileged info."""

from opsd.envs.textworld import EnvStep, GameSpec, TextWorldEnv, clean_observation, load_game, make_games

__all__ = ["EnvStep", "GameSpec", "TextWorldEnv", "clean_observation", "load_game", "make_games"]
