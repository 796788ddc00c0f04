"""The student's prompts: system prompt, first message, one-shot turn, per-turn messages.

The words per environment live with its adapter (`PROMPT`, an
`opsd.envs.base.EnvPrompt`); this module puts them together the same way
for every env: a system message, an optional made-up one-shot exchange,
then the observation of each turn as a user message with the admissible
commands listed one a line (with SmolLM2-135M this gave 83% format-valid
turns against 68% for a comma-separated list, 8 games x 8 rollouts x 2 turns).
"""

from __future__ import annotations

from opsd.config import EnvSection
from opsd.envs import EnvPrompt, get_adapter

PROMPT_FORMATS = ("action", "think")
_PICK = {True: "choose one of the admissible commands", False: "choose one command"}


def _check_format(prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt_format {prompt_format!r}; expected one of {sorted(PROMPT_FORMATS)}")


def env_prompt(env: str) -> EnvPrompt:
    """The EnvPrompt of env `env` (its adapter's PROMPT); ValueError for an unknown env."""
    return get_adapter(env).PROMPT


def system_prompt(prompt_format: str, list_admissible: bool = True, env: str = "textworld") -> str:
    """The system message of `env` for `prompt_format` ("action" or "think"); ValueError otherwise.
    With `list_admissible` it tells the model to pick from the listed commands."""
    _check_format(prompt_format)
    return env_prompt(env).system[prompt_format].replace("{pick}", _PICK[bool(list_admissible)])


def _with_commands(text: str, admissible: list[str], list_admissible: bool, max_chars: int) -> str:
    if not list_admissible or not admissible:
        return text
    # The list obeys the observation cap too (a web page can offer hundreds of links): whole
    # commands up to `max_chars` characters, then how many were left out.
    lines: list[str] = []
    used = 0
    for c in admissible:
        if used + len(c) + 1 > max_chars:
            lines.append(f"... ({len(admissible) - len(lines)} more)")
            break
        lines.append(c)
        used += len(c) + 1
    return text + "\n\nAdmissible commands:\n" + "\n".join(lines)


def observation_message(observation: str, admissible: list[str], cfg: EnvSection) -> str:
    """The user message of one turn: the (already cleaned and capped) observation, plus the
    admissible commands when `cfg.list_admissible` (at most `cfg.max_observation_chars` characters of them)."""
    return _with_commands(observation, admissible, cfg.list_admissible, cfg.max_observation_chars)


def first_user_message(observation: str, admissible: list[str], cfg: EnvSection) -> str:
    """The first user message: the opening observation (it states the task)
    and the admissible commands. The reply format is taught by the system prompt
    and the one-shot example, so no extra instructions are repeated here."""
    return observation_message(observation, admissible, cfg)


def invalid_message(admissible: list[str], cfg: EnvSection) -> str:
    """What the student sees after a reply without exactly one valid action: `cfg.invalid_feedback`
    when the config sets it, else the env's own (its PROMPT's, e.g. Search names its tags), plus
    the (unchanged) admissible commands."""
    feedback = cfg.invalid_feedback
    if feedback == EnvSection.model_fields["invalid_feedback"].default:
        feedback = env_prompt(cfg.name).invalid_feedback or feedback
    return observation_message(feedback, admissible, cfg)


def one_shot_examples(cfg: EnvSection) -> list[tuple[str, str]]:
    """The example (user, assistant) turns to render before the real task: the env's
    made-up exchange when `cfg.one_shot` and the env has one, else none."""
    _check_format(cfg.prompt_format)
    example = env_prompt(cfg.name).example
    if not cfg.one_shot or example is None:
        return []
    observation, commands, replies = example
    return [(observation_message(observation, commands, cfg), replies[cfg.prompt_format])]
