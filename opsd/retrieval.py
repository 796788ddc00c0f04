"""Dense retrieval over a passage corpus (Search-QA): one index-building code for the embedder and in-process use.

The embedder's POST /retrieve (services/embedder/app.py) and
`opsd.envs.search.LocalRetriever` both use `CorpusIndex` (so it lives in opsd/, shared by the two): the corpus is
embedded with the frozen encoder (L2-normalized float32 rows) into a FAISS
inner-product index (cosine), so both give the same passages for a query.

Corpus format: Search-R1's wiki-18 JSONL, one passage a line,
`{"id": str, "contents": "\\"Title\\"\\ntext"}` (the first line of `contents`
is the title, quoted or not); `{"id", "title", "text"}` rows are accepted too.

Index cache: with a cache dir, the FAISS index is written to
`<cache_dir>/retrieval/<corpus sha256[:16]>-<encoder>-<dim>.faiss` (FAISS's own
format, never pickle) and read back next time; the passages themselves are
always read from the corpus file. Build one ahead of time (a large corpus
takes long to embed) with

    python -m opsd.retrieval --corpus wiki-18.jsonl --cache-dir ~/.cache/opsd [--encoder all-MiniLM-L6-v2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

# The shipped test corpus (opsd/envs/data/search/): the search env's default, and the index CLI's.
DATA_DIR = Path(__file__).resolve().parent / "envs" / "data" / "search"
SHIPPED_CORPUS = DATA_DIR / "corpus.jsonl"

log = logging.getLogger("opsd.retrieval")

EMBED_BATCH = 256  # passages per Encoder.embed call while building an index
PROGRESS_EVERY_S = 30.0  # while building an index, log passages embedded / total this often


@dataclass(frozen=True)
class Passage:
    """One corpus passage: `contents` as stored (title line first, wiki-18 style), `title` parsed from it."""

    id: str
    title: str | None
    contents: str

    @property
    def text(self) -> str:
        """`contents` without its title line."""
        if self.title is None:
            return self.contents
        return self.contents.split("\n", 1)[1] if "\n" in self.contents else ""


def split_title(contents: str) -> tuple[str | None, str]:
    """A wiki-18 passage '"Title"\\ntext' -> (Title, text); (None, contents) without a title line."""
    if "\n" not in contents:
        return None, contents.strip()
    first, rest = contents.split("\n", 1)
    first = first.strip()
    title = first[1:-1] if len(first) >= 2 and first[0] == first[-1] == '"' else first
    return title or None, rest.strip()


def parse_passage(row: dict, where: str) -> Passage:
    """A corpus row -> Passage. Raises ValueError (naming `where`) for a row without an id or text."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a passage must be a JSON object, got {type(row).__name__}")
    pid = row.get("id")
    if pid is None or str(pid) == "":
        raise ValueError(f"{where}: passage without an 'id'")
    if "contents" in row:
        contents = row["contents"]
    elif "text" in row:
        contents = f'"{row["title"]}"\n{row["text"]}' if row.get("title") else row["text"]
    else:
        raise ValueError(f"{where}: passage {pid!r} has neither 'contents' nor 'text'")
    if not isinstance(contents, str) or not contents.strip():
        raise ValueError(f"{where}: passage {pid!r} has empty or non-string contents")
    return Passage(str(pid), split_title(contents)[0], contents)


def load_corpus(path: str | Path) -> list[Passage]:
    """Read a JSONL corpus (see the module docstring). Raises FileNotFoundError, or ValueError naming the bad line,
    an empty corpus, or a repeated id."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} not found")
    out: list[Passage] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            p = parse_passage(row, f"{path}:{n}")
            if p.id in seen:
                raise ValueError(f"{path}:{n}: passage id {p.id!r} repeated")
            seen.add(p.id)
            out.append(p)
    if not out:
        raise ValueError(f"corpus {path} holds no passages")
    return out


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_path(cache_dir: Path, corpus: Path, encoder_name: str, dim: int) -> Path:
    enc = re.sub(r"[^A-Za-z0-9._-]+", "_", encoder_name.strip("/"))[-64:]
    return Path(cache_dir) / "retrieval" / f"{file_sha256(corpus)[:16]}-{enc}-{dim}.faiss"


class CorpusIndex:
    """A corpus and its FAISS inner-product index over encoder vectors.

    `encoder`: anything with `.dim` and `.embed(list[str]) -> float32 [N, dim]`
    L2-normalized rows (opsd.encoder.Encoder). Thread-safe searches.
    """

    def __init__(self, passages: list[Passage], index: faiss.Index, encoder):
        if index.ntotal != len(passages):
            raise ValueError(f"index holds {index.ntotal} vectors for {len(passages)} passages (a stale cache file?)")
        self.passages = passages
        self.index = index
        self.encoder = encoder

    @classmethod
    def build(cls, corpus: str | Path, encoder, encoder_name: str = "", cache_dir: str | Path | None = None) -> "CorpusIndex":
        """Load `corpus`, embed it (or read its cached index) and index it.

        Raises what `load_corpus` raises. A cache file that cannot be read or does
        not match the corpus is rebuilt; one that cannot be written is only logged.
        """
        corpus = Path(corpus)
        passages = load_corpus(corpus)
        cached = _cache_path(Path(cache_dir), corpus, encoder_name, encoder.dim) if cache_dir and encoder_name else None
        if cached is not None and cached.is_file():
            try:
                index = faiss.read_index(str(cached))
                if index.ntotal == len(passages) and index.d == encoder.dim:
                    log.info("retrieval index for %s read from %s", corpus, cached)
                    return cls(passages, index, encoder)
                log.warning("cached index %s does not match %s: rebuilding", cached, corpus)
            except RuntimeError as e:  # FAISS raises RuntimeError for a corrupt file
                log.warning("cached index %s unreadable (%s): rebuilding", cached, e)
        index = faiss.IndexFlatIP(encoder.dim)
        total = len(passages)
        log.info("embedding %d passages of %s in batches of %d (on %s)", total, corpus, EMBED_BATCH,
                 getattr(encoder, "device", "?"))
        start = last = time.monotonic()
        for lo in range(0, total, EMBED_BATCH):
            vecs = encoder.embed([p.contents for p in passages[lo : lo + EMBED_BATCH]])
            index.add(np.ascontiguousarray(vecs, dtype=np.float32))
            done, now = min(lo + EMBED_BATCH, total), time.monotonic()
            if done < total and now - last >= PROGRESS_EVERY_S:  # a wiki-scale build takes hours: show it moving
                last = now
                rate = done / max(now - start, 1e-9)
                log.info("retrieval index: %d / %d passages embedded (%.1f%%, %.0f/s, about %.0f min left)",
                         done, total, 100.0 * done / total, rate, (total - done) / rate / 60)
        log.info("retrieval index built: %d passages of %s in %.0f s", total, corpus, time.monotonic() - start)
        if cached is not None:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".faiss", dir=cached.parent)
                os.close(fd)
                faiss.write_index(index, tmp)
                os.replace(tmp, cached)  # readers never see half a file
            except (OSError, RuntimeError) as e:
                log.warning("could not cache the retrieval index at %s (%s)", cached, e)
        return cls(passages, index, encoder)

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """The top-`k` passages for `query`, best first, with their cosine scores.

        Fewer than `k` when the corpus is smaller (FAISS's -1 ids are dropped,
        bad-input case 18). Raises ValueError for k < 1.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = np.ascontiguousarray(self.encoder.embed([query]), dtype=np.float32)
        scores, ids = self.index.search(q, min(k, len(self.passages)))
        return [(self.passages[int(i)], float(np.clip(s, -1.0, 1.0)))
                for i, s in zip(ids[0], scores[0]) if i >= 0 and np.isfinite(s)]


class IndexBuilding(RuntimeError):
    """The index is not ready yet (a large corpus takes minutes to hours to embed): ask again later."""


class LazyCorpusIndex:
    """A `CorpusIndex` built on first use (the embedder starts serving at once).

    `get()` builds it once under a lock; a failure is remembered and raised again
    (as RuntimeError naming the corpus) until the process restarts.
    """

    def __init__(self, corpus: str | Path, encoder, encoder_name: str = "", cache_dir: str | Path | None = None):
        self.corpus = Path(corpus)
        self._args = (encoder, encoder_name, cache_dir)
        self._index: CorpusIndex | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def get(self, wait: bool = True) -> CorpusIndex:
        """The index; raises RuntimeError when the corpus could not be loaded, and IndexBuilding
        when `wait` is False and another thread is still building it."""
        if not self._lock.acquire(blocking=wait):
            raise IndexBuilding(f"the retrieval index of {self.corpus} is still being built")
        try:
            if self._index is None and self._error is None:
                try:
                    self._index = CorpusIndex.build(self.corpus, *self._args)
                except (OSError, ValueError) as e:
                    self._error = f"the retrieval corpus {self.corpus} could not be loaded: {e}"
                    log.error("%s", self._error)
            if self._error is not None:
                raise RuntimeError(self._error)
            return self._index
        finally:
            self._lock.release()

    def build_in_background(self) -> threading.Thread:
        """Start building the index in a daemon thread (so the first /retrieve need not wait); a failure is
        logged and answered by /retrieve as a 503."""
        def run() -> None:
            try:
                self.get()
            except RuntimeError:
                pass  # logged by get(); /retrieve reports it

        t = threading.Thread(target=run, name="retrieval-index", daemon=True)
        t.start()
        return t


def corpus_for_config(cfg) -> Path | None:
    """The corpus an embedder serves under a full opsd Config: `env.search.corpus` (or the shipped one)
    when `env.name == "search"`, else None (no /retrieve)."""
    if cfg.env.name != "search":
        return None
    return Path(cfg.env.search.corpus).expanduser() if cfg.env.search.corpus else SHIPPED_CORPUS


def main() -> None:
    """CLI: build (and cache) the retrieval index of a corpus ahead of a run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=str(SHIPPED_CORPUS))
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--encoder", default="all-MiniLM-L6-v2")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from opsd.encoder import Encoder

    idx = CorpusIndex.build(args.corpus, Encoder(args.encoder), args.encoder, args.cache_dir)
    print(f"{len(idx.passages)} passages indexed; cache: {_cache_path(Path(args.cache_dir), Path(args.corpus), args.encoder, idx.encoder.dim)}")


if __name__ == "__main__":
    main()
