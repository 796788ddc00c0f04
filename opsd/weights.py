"""Policy versions: the trainer publishes, rollout and teacher load.

Version v lives at `<run_dir>/weights/policy-v<v>.safetensors` (written to a
temp file, then renamed, so a reader never sees half a file). Version 0 is the
initial model from the model cache and has no file. The latest published
version is also stored under the Redis key `<prefix>:policy_version`.
"""

from __future__ import annotations

from pathlib import Path


def weights_path(run_dir: Path, version: int) -> Path:
    """Where policy version `version` (>= 1) is stored."""
    if version < 1:
        raise ValueError(f"policy version {version} has no weights file (version 0 is the initial model)")
    return Path(run_dir) / "weights" / f"policy-v{version:05d}.safetensors"


def ensure_version(backend, run_dir: Path, version: int) -> bool:
    """Load policy `version` into `backend` unless it already holds it; returns True if it loaded.

    Raises FileNotFoundError when the trainer has not published that version,
    and ValueError for version 0 after another version was loaded (the
    initial weights are only held from start-up; a job for version 0 after
    v >= 1 is stale and must not mix versions).
    """
    if backend.policy_version == version:
        return False
    if version == 0:
        raise ValueError(f"stale job: policy version 0 requested while holding {backend.policy_version}")
    path = weights_path(run_dir, version)
    if not path.exists():
        raise FileNotFoundError(f"policy version {version} not published: {path} is missing")
    backend.load_weights(path, version)
    return True
