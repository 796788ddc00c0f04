"""Write the `.env` that docker compose reads: random secrets, readable by the owner only.

    python3 scripts/compose_env.py [--output PATH] [--force]     (`make compose-env`)

Keys: REDIS_PASSWORD, OPSD_API_TOKEN, GRAFANA_ADMIN_PASSWORD (see .env.example for the optional
ones). In an existing file (say a copy of .env.example) only the missing or empty secrets are
filled in; every other line is kept. Secrets already set are kept unless --force: a new
REDIS_PASSWORD locks the roles out of the data in the Redis volume until it is wiped, and a new
Grafana password is ignored by an existing grafana-data volume. The file ends up mode 0600.
Exit status 1 (with the reason) when the output is a directory or a symbolic link.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("REDIS_PASSWORD", "OPSD_API_TOKEN", "GRAFANA_ADMIN_PASSWORD")
TOKEN_BYTES = 32  # token_urlsafe(32): 43 URL-safe characters, fit for a redis:// URL as they are
HEADER = "# Written by scripts/compose_env.py (make compose-env). Secrets: do not commit or share."


def fill(text: str, force: bool = False) -> tuple[str, list[str]]:
    """`text` (a .env file's content) with each missing or empty secret given a fresh random value.

    With `force` every secret gets a new value. Returns the new content and the keys written.
    """
    lines = text.splitlines() or [HEADER]
    written = []
    for key in KEYS:
        at = [i for i, line in enumerate(lines) if line.partition("=")[0].strip() == key]
        if at and lines[at[-1]].partition("=")[2].strip() and not force:
            continue
        value = f"{key}={secrets.token_urlsafe(TOKEN_BYTES)}"
        if at:
            lines[at[-1]] = value  # compose uses the last assignment
        else:
            lines.append(value)
        written.append(key)
    return "\n".join(lines) + "\n", written


def write_env(path: Path, force: bool = False) -> list[str]:
    """Fill `path`'s secrets (see `fill`) and leave it mode 0600; returns the keys written.

    Raises ValueError for a directory or a symbolic link (replacing the link would leave its target
    holding stale secrets).
    """
    if path.is_symlink() or path.is_dir():
        raise ValueError(f"{path} is a {'symbolic link' if path.is_symlink() else 'directory'}; give a regular file")
    content, written = fill(path.read_text() if path.exists() else "", force)
    if path.exists() and not written:
        os.chmod(path, 0o600)
        return []
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # .env.<pid>.tmp: gitignored
    # Created 0600 from the start (no window where other users could read it), then renamed into place.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o600)  # whatever the umask
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=ROOT / ".env", help="where to write (default: the repo's .env)")
    ap.add_argument("--force", action="store_true", help="new values for secrets already set")
    args = ap.parse_args(argv)
    try:
        written = write_env(args.output, args.force)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    kept = [k for k in KEYS if k not in written]
    print(f"{args.output} (mode 0600): " + "; ".join(
        part for part in (f"new {', '.join(written)}" if written else "",
                          f"kept {', '.join(kept)} (--force for new ones)" if kept else "") if part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
