"""The student's prompts for TextWorld: system prompt, first message, one-shot turn, per-turn messages.

Kept short on purpose: SmolLM2-135M has a small context and every prompt
token costs CPU time on each turn. The measured best setup for that model is
an action-only reply, the admissible commands listed, one made-up example
exchange, and the assistant turn prefilled with `<action>` (the prefill
itself is rendered by `opsd.chat.ChatFormat`).
"""

from __future__ import annotations

from opsd.config import EnvSection

# {pick}: how the command is chosen, depending on whether the admissible list is shown.
_SYSTEM = {
    "action": (
        "You are playing a text adventure game. Reach the objective. "
        "Each turn, {pick} and reply with it inside <action></action>, for example <action>open box</action>."
    ),
    "think": (
        "You are playing a text adventure game. Reach the objective. "
        "Each turn, think briefly inside <think></think>, then {pick} and reply with it "
        "inside <action></action>."
    ),
}
_PICK = {True: "choose one of the admissible commands", False: "choose one command"}

# A made-up exchange (not from any generated game) that shows the reply format.
_EXAMPLE_OBSERVATION = "Your objective is to open the box.\n\n-= Kitchen =-\nYou are in a kitchen. You see a closed box."
_EXAMPLE_COMMANDS = ["examine box", "go north", "look", "open box"]
_EXAMPLE_REPLY = {
    "action": "<action>open box</action>",
    "think": "<think>The objective is to open the box, and the box is here.</think><action>open box</action>",
}


def _check_format(prompt_format: str) -> None:
    if prompt_format not in _SYSTEM:
        raise ValueError(f"unknown prompt_format {prompt_format!r}; expected one of {sorted(_SYSTEM)}")


def system_prompt(prompt_format: str, list_admissible: bool = True) -> str:
    """The system message for `prompt_format` ("action" or "think"); ValueError otherwise.
    With `list_admissible` it tells the model to pick from the listed commands."""
    _check_format(prompt_format)
    return _SYSTEM[prompt_format].format(pick=_PICK[bool(list_admissible)])


def _with_commands(text: str, admissible: list[str], list_admissible: bool) -> str:
    if not list_admissible or not admissible:
        return text
    # One command a line: with SmolLM2-135M this gave 83% format-valid turns
    # against 68% for a comma-separated list (8 games x 8 rollouts x 2 turns).
    return text + "\n\nAdmissible commands:\n" + "\n".join(admissible)


def observation_message(observation: str, admissible: list[str], cfg: EnvSection) -> str:
    """The user message of one turn: the (already cleaned) observation, plus the
    admissible commands when `cfg.list_admissible`."""
    return _with_commands(observation, admissible, cfg.list_admissible)


def first_user_message(observation: str, admissible: list[str], cfg: EnvSection) -> str:
    """The first user message: the opening observation (it states the objective)
    and the admissible commands. The reply format is taught by the system prompt
    and the one-shot example, so no extra instructions are repeated here."""
    return observation_message(observation, admissible, cfg)


def invalid_message(admissible: list[str], cfg: EnvSection) -> str:
    """What the student sees after a reply without exactly one valid action:
    `cfg.invalid_feedback`, plus the (unchanged) admissible commands."""
    return observation_message(cfg.invalid_feedback, admissible, cfg)


def one_shot_examples(cfg: EnvSection) -> list[tuple[str, str]]:
    """The example (user, assistant) turns to render before the real game:
    one made-up exchange when `cfg.one_shot`, else none."""
    _check_format(cfg.prompt_format)
    if not cfg.one_shot:
        return []
    user = observation_message(_EXAMPLE_OBSERVATION, _EXAMPLE_COMMANDS, cfg)
    return [(user, _EXAMPLE_REPLY[cfg.prompt_format])]
