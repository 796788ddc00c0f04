"""A model laid out in a Hugging Face cache exactly as huggingface_hub leaves a download, without a network.

``<hf_home>/hub/models--<org>--<name>/``: ``blobs/<etag>`` (each file's bytes once: the git blob sha1 of a
small file, the sha256 of an LFS one, such as weights), ``snapshots/<commit>/<file>`` (relative symlinks to
the blobs) and ``refs/<branch or tag>`` (the commit, no newline: a tag is stored as a ref like a branch,
huggingface_hub's file_download._cache_commit_hash_for_specific_revision).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")  # stored in git LFS on the Hub: their etag is the content's sha256


def _etag(data: bytes, name: str) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def cache_model(hf_home: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...] = (),
                files: tuple[str, ...] | None = None) -> Path:
    """Add the top-level files of `src` (or only `files`) as snapshot `commit` of model `repo_id` to the cache
    under `hf_home`, and point each of `refs` ("main", "v1.0") at it. Returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or (files is not None and f.name not in files):
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / _etag(data, f.name)
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
