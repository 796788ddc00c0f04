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
import stat
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


def _read(root: Path, path: Path) -> str:
    """The text of skill file `path` under `root`, "" when there is none. Only a regular file whose real path
    (of the file actually opened) lies inside the real `root` is read (never a symlink, a
    device, a FIFO or /proc: their content, e.g. the environment's secrets, would travel in every TaskGroup),
    and at most MAX_SKILL_BYTES of it. ValueError otherwise. Hard links are allowed: installers (uv, conda)
    hard-link package files from their caches."""
    refused = f"skill file {path} is not a regular file inside the skills folder {root}: refused"
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # before opening: opening a device may do something
            raise ValueError(refused)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return ""
    except OSError as e:  # ELOOP: the file became a symlink
        raise ValueError(f"{refused} ({e.strerror})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        # The file opened, not the name: a parent folder swapped for a symlink after the open cannot fool it.
        opened = Path(os.readlink(f"/proc/self/fd/{fd}")) if os.path.exists(f"/proc/self/fd/{fd}") else Path(path).resolve()
        if not stat.S_ISREG(st.st_mode) or not opened.is_relative_to(root.resolve()):
            raise ValueError(refused)
        data = f.read(MAX_SKILL_BYTES + 1)  # the size of what is read, not what stat says (/proc reads as 0)
    if len(data) > MAX_SKILL_BYTES:
        raise ValueError(f"skill file {path} is over {MAX_SKILL_BYTES} bytes; at most {MAX_SKILL_BYTES} "
                         f"(it is prepended to every teacher prompt)")
    return data.decode("utf-8").strip()


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
    parts = [_read(root, root / env / "general.txt")]
    if skill_key and skill_key != "general":
        parts.append(_read(root, root / env / f"{skill_key}.txt"))
    return "\n\n".join(p for p in parts if p)


PRIVILEGED_MODES = ("skills", "walkthrough", "both", "remaining", "skills+remaining", "none")
PER_TURN_MODES = ("remaining", "skills+remaining")  # the hint changes with the state: one teacher view per turn


def privileged_text(env: str, task: Task, mode: str = "both", root: Path | None = None) -> str:
    """The task-level privileged context of `task` (EnvSection.privileged): skills and/or its whole
    walkthrough ("skills", "walkthrough", "both"); for the per-turn modes only the task-level part
    ("remaining": "", "skills+remaining": the skills), the remaining walkthrough being added per turn
    by `turn_privileged_text`; "none": "" (the teacher sees the student's prompt alone, without even the
    privileged header). "" when the env has neither. ValueError on another mode."""
    if mode not in PRIVILEGED_MODES:
        raise ValueError(f"privileged mode must be one of {', '.join(PRIVILEGED_MODES)}, got {mode!r}")
    parts = []
    if mode in ("skills", "both", "skills+remaining"):
        parts.append(skill_text(env, task.skill_key, root))
    if mode in ("walkthrough", "both") and task.gold_path:
        parts.append(walkthrough_text(task.gold_path))
    return "\n\n".join(p for p in parts if p)


def turn_privileged_text(task_text: str, hint: list[str], mode: str) -> str:
    """The privileged text of one turn: the task-level text, plus (per-turn modes) the remaining
    walkthrough from the state the turn acted in (`TurnRecord.hint`; nothing when the env did not
    know it). Why per turn: SmolLM2 scored the correct command +0.31 nats higher with the remaining
    walkthrough prepended vs +0.29 with the whole one (platform notes, 58 TextWorld states)."""
    if mode not in PER_TURN_MODES or not hint:
        return task_text
    return "\n\n".join(p for p in (task_text, walkthrough_text(hint)) if p)
