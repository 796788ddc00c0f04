"""Write the `.env` that docker compose reads: fresh random secrets, readable by the owner only.

    python scripts/compose_env.py [--output PATH] [--force]     (`make compose-env`)

Keys: REDIS_PASSWORD, OPSD_API_TOKEN, GRAFANA_ADMIN_PASSWORD (see .env.example for the optional
ones). An existing file is kept unless --force: regenerating REDIS_PASSWORD would lock the roles out
of the Redis volume's data until it is wiped, and a new Grafana password is ignored by an existing
grafana-data volume. Exit status 1 when the file exists.
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


def render() -> str:
    lines = ["# Written by scripts/compose_env.py (make compose-env). Secrets: do not commit or share."]
    lines += [f"{key}={secrets.token_urlsafe(TOKEN_BYTES)}" for key in KEYS]
    return "\n".join(lines) + "\n"


def write_env(path: Path, force: bool = False) -> bool:
    """Write fresh secrets to `path` with mode 0600; False (nothing written) if it exists and not `force`."""
    if path.exists() and not force:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    # Created 0600 from the start (no window where other users could read it), then renamed into place.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render())
    os.chmod(tmp, 0o600)  # in case the umask is unusual
    tmp.replace(path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=ROOT / ".env", help="where to write (default: the repo's .env)")
    ap.add_argument("--force", action="store_true", help="replace an existing file (new secrets)")
    args = ap.parse_args(argv)
    if not write_env(args.output, args.force):
        print(f"{args.output} exists; keeping it (--force writes new secrets)", file=sys.stderr)
        return 1
    print(f"wrote {args.output} (mode 0600): {', '.join(KEYS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
