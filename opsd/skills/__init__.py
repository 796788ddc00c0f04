"""SkillBank: the teacher's privileged text, from plain text files users can edit.

    opsd/skills/<env>/general.txt        skills for every task of the env
    opsd/skills/<env>/<skill_key>.txt    skills for one task type (Task.skill_key)

Selection follows the AlignOPSD/AgentOPSD code: the adapter sets each task's
`skill_key` (ALFWorld: the task type from the game; WebShop: the product
category from keywords in the request; Search: the question type from its data
source; reasoning-gym: the dataset), and the text is the general skills, then
the task type's, then the walkthrough / gold path where the env has one. The
teacher prepends it as "[Privileged Skill Information]\\n" + text + "\\n\\n"
(spec section 0; opsd.chat.ChatFormat.privileged_prefix_ids).

`OPSD_SKILLS_DIR` points the bank at another folder with the same layout.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from opsd.envs.base import Task

SKILLS_DIR = Path(__file__).resolve().parent
_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


def skills_dir() -> Path:
    """The folder skills are read from: $OPSD_SKILLS_DIR, else this package's folder."""
    return Path(os.environ.get("OPSD_SKILLS_DIR") or SKILLS_DIR)


def walkthrough_text(commands: list[str]) -> str:
    """Gold path commands as one line: "Walkthrough: open box > take coin"."""
    return "Walkthrough: " + " > ".join(commands)


# The text goes into every TaskGroup and every teacher prompt: a skill file is a page, not a book.
MAX_SKILL_BYTES = 64 * 1024


def _read(path: Path) -> str:
    if not path.is_file():
        return ""
    size = path.stat().st_size
    if size > MAX_SKILL_BYTES:
        raise ValueError(f"skill file {path} is {size} bytes; at most {MAX_SKILL_BYTES} (it is prepended to every teacher prompt)")
    return path.read_text(encoding="utf-8").strip()


def skill_text(env: str, skill_key: str, root: Path | None = None) -> str:
    """General plus task-type skills of `env` ("" when there are none).

    Raises ValueError for an `env` or `skill_key` that is not a plain file
    name (letters, digits, "_", "-", "."; a task never picks a path), or a
    skill file over MAX_SKILL_BYTES.
    """
    root = root or skills_dir()
    for name in (env, skill_key):
        if name and (not _KEY.match(name) or name in (".", "..")):
            raise ValueError(f"skill names must be plain file names, got {name!r}")
    parts = [_read(root / env / "general.txt")]
    if skill_key and skill_key != "general":
        parts.append(_read(root / env / f"{skill_key}.txt"))
    return "\n\n".join(p for p in parts if p)


def privileged_text(env: str, task: Task, mode: str = "both", root: Path | None = None) -> str:
    """The privileged context of `task`: skills and/or its walkthrough (EnvSection.privileged:
    "skills", "walkthrough" or "both"); "" when the env has neither. ValueError on another mode."""
    if mode not in ("skills", "walkthrough", "both"):
        raise ValueError(f"privileged mode must be skills, walkthrough or both, got {mode!r}")
    parts = []
    if mode in ("skills", "both"):
        parts.append(skill_text(env, task.skill_key, root))
    if mode in ("walkthrough", "both") and task.gold_path:
        parts.append(walkthrough_text(task.gold_path))
    return "\n\n".join(p for p in parts if p)
