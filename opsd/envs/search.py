"""Search-QA adapter: the Search-R1 protocol over a passage corpus, scored by exact match.

Each turn the student replies with `<search>query</search>` (the env answers
`<information>Doc 1 (Title: ...) ...</information>`, the top
`env.search.top_k` passages) or `<answer>text</answer>` (the episode ends:
reward 1.0 when the answer matches any golden answer after SQuAD-style
normalization, else 0.0). The rollout passes the action with its tag, e.g.
`env.step("<search>capital of Peru</search>")`; anything else is an invalid
action. The turn cap (env.max_turns, 4 in Search-R1) is the rollout's: an
episode that ends without an answer scores 0.

Retrieval: `EnvContext.retriever`, normally `HTTPRetriever` (the embedder's
POST /retrieve) or `LocalRetriever` (the same index code in-process,
opsd/retrieval.py). Questions: JSONL (or Search-R1 parquet, with
pyarrow) rows `{"id", "question", "golden_answers", "data_source"}`; the shipped
set and corpus, and how to use the full ones, are described in
opsd/envs/data/search/README.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import string
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from opsd.config import EnvSection
from opsd.envs.base import EnvContext, EnvPrompt, EnvStep, Retriever, Task, cap
from opsd.retrieval import DATA_DIR, SHIPPED_CORPUS, LazyCorpusIndex, split_title

NAME = "search"
ACTION_TAGS = ("search", "answer")
METRIC = "em"

SHIPPED_QUESTIONS = DATA_DIR / "questions.jsonl"
MAX_QUERY_CHARS = 512  # a longer search query is cut (the embedder's encoder reads ~256 word pieces anyway)
MAX_ANSWER_CHARS = 1000
EVAL_FRACTION_MOD = 3  # without separate eval questions, a row is eval when sha256(id) % 3 == 0

log = logging.getLogger("opsd.envs.search")

# Which skill file (opsd/skills/search/<key>.txt) a data source gets; a row's own "skill" wins,
# and a HotpotQA-style "type": "comparison" row gets "comparison".
SKILL_BY_SOURCE = {
    "nq": "direct_retrieval",
    "triviaqa": "direct_retrieval",
    "single_hop": "direct_retrieval",
    "popqa": "entity_lookup",
    "hotpotqa": "multi_hop",
    "2wikimultihopqa": "multi_hop",
    "musique": "multi_hop",
    "bamboogle": "multi_hop",
    "multi_hop": "multi_hop",
}
SKILL_KEYS = ("entity_lookup", "direct_retrieval", "multi_hop", "comparison")

_SYSTEM = (
    "Answer the given question. {how}Whenever you lack some knowledge, call a search engine with "
    "<search> query </search>; it returns the top results between <information> and </information>. "
    "You may search as many times as you need, one search per reply. When no further knowledge is needed, "
    "give the final answer inside <answer> and </answer>, without explanation, for example <answer> Beijing </answer>. "
    "Each reply holds exactly one <search> or one <answer> block."
)
PROMPT = EnvPrompt(
    system={
        "action": _SYSTEM.format(how=""),
        "think": _SYSTEM.format(how="First reason inside <think> and </think> every time you get new information. "),
    },
    example=(
        "Question: Which river flows through the capital of the country where the composer Ilse Varga was born?",
        [],
        {
            "action": "<search>Ilse Varga composer born</search>",
            "think": "<think>I need Ilse Varga's birthplace first, then that country's capital and its river.</think>"
                     "<search>Ilse Varga composer born</search>",
        },
    ),
    invalid_feedback="Invalid response. Reply with exactly one <search>query</search> or one <answer>answer</answer> block.",
)

# ---------------------------------------------------------------------------
# Exact match


def normalize_answer(s: str) -> str:
    """SQuAD/Search-R1 answer normalization: lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golden_answers: str | Iterable[str]) -> float:
    """1.0 when normalize_answer(prediction) equals that of any golden answer, else 0.0.

    Text that normalizes to "" (only articles / punctuation / spaces, e.g. "the", "?!")
    never matches, on either side: exact_match("the", ["a"]) == 0.0.
    """
    golds = [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)
    pred = normalize_answer(prediction)
    return float(bool(pred) and any(pred == normalize_answer(g) for g in golds))


# ---------------------------------------------------------------------------
# Questions and tasks


def search_r1_row(row: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One Search-R1 / FlashRAG question row -> our row {"id", "question", "golden_answers", "data_source", ...}.

    Accepts Search-R1's parquet rows (question, golden_answers or
    reward_model.ground_truth.target, data_source, extra_info.index) and
    FlashRAG JSONL rows (id, question, golden_answers); numpy arrays become lists.
    Raises ValueError for a row that is not an object, or without a question or
    golden answers (a string or a list of strings/numbers).
    """
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: must be a JSON object, got {type(row).__name__}")

    def as_list(x: Any, field: str) -> list[str]:
        if x is None:
            return []
        if hasattr(x, "tolist"):
            x = x.tolist()
        if isinstance(x, str):
            return [x]
        if not isinstance(x, (list, tuple)) or any(isinstance(a, (dict, list, tuple)) for a in x):
            raise ValueError(f"row {index}: {field} must be a string or a list of strings, got {x!r:.80}")
        return [str(a) for a in x]

    def sub(d: Any, key: str) -> Any:
        return d.get(key) if isinstance(d, dict) else None

    question = str(row.get("question") or "").strip()
    golds = as_list(row.get("golden_answers"), "golden_answers")
    if not golds:
        golds = as_list(sub(sub(row.get("reward_model"), "ground_truth"), "target"), "reward_model.ground_truth.target")
    source = str(row.get("data_source") or "unknown")
    if not question or not golds:
        raise ValueError(f"row {index}: needs a question and golden answers, got {sorted(row)}")
    idx = sub(row.get("extra_info"), "index")
    idx = index if idx is None else idx
    out = {"id": str(row.get("id") or f"{source}-{idx}"), "question": question, "golden_answers": golds,
           "data_source": source}
    for key in ("skill", "type", "support", "gold_queries"):
        if row.get(key) is not None:
            out[key] = row[key].tolist() if hasattr(row[key], "tolist") else row[key]
    return out


def load_questions(path: str | Path) -> list[dict[str, Any]]:
    """Question rows of a JSONL or (with pyarrow installed) parquet file, normalized by `search_r1_row`.

    Raises FileNotFoundError, ImportError (parquet without pyarrow), or
    ValueError naming the bad line / a repeated id / an empty file.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"Search-QA question file {path} not found")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to JSONL "
                              f"(see opsd/envs/data/search/README.md)") from None
        raw = [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    else:
        raw = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    raw.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    rows = []
    for i, (where, r) in enumerate(raw):
        try:
            rows.append(search_r1_row(r, i))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: repeated question ids")
    if not rows:
        raise ValueError(f"{path}: no questions")
    return rows


def skill_for(row: dict[str, Any]) -> str:
    """The row's skill key: its own "skill", "comparison" for a comparison-type row, else by data source
    (SKILL_BY_SOURCE; an unknown source gets "direct_retrieval")."""
    if row.get("skill") in SKILL_KEYS:
        return row["skill"]
    if row.get("type") == "comparison":
        return "comparison"
    return SKILL_BY_SOURCE.get(str(row.get("data_source", "")).lower(), "direct_retrieval")


def is_eval_row(row_id: str) -> bool:
    """The deterministic eval split of a single question file: sha256(id) % 3 == 0 (about a third)."""
    return int(hashlib.sha256(row_id.encode()).hexdigest(), 16) % EVAL_FRACTION_MOD == 0


def _task(row: dict[str, Any]) -> Task:
    answer = f"<answer>{row['golden_answers'][0]}</answer>"
    gold = [f"<search>{q}</search>" for q in row.get("gold_queries") or []] + [answer]
    return Task(
        task_id=f"search-{row['id']}",
        category=row["data_source"],
        spec={"question": row["question"], "golden_answers": list(row["golden_answers"]),
              "data_source": row["data_source"]},
        skill_key=skill_for(row),
        gold_path=gold,
        objective=row["question"],
    )


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str) -> list[Task]:
    """The Search-QA tasks of `split` ("train" | "eval"). Deterministic; needs no retriever.

    With `env.search.eval_questions`, eval rows come from it and train rows from
    `env.search.questions`; otherwise one file (the shipped set by default) is
    split by `is_eval_row`, so train and eval never share a question. Train: the
    train rows shuffled with `cfg.seed`, first `cfg.game_pool`; eval: the eval
    rows in file order, first `cfg.eval_pool`. A pool larger than the rows
    available is cut to them (with a warning). Raises ValueError for another split.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    sc = cfg.search
    if split == "eval" and sc.eval_questions:
        rows = load_questions(sc.eval_questions)
    else:
        rows = load_questions(sc.questions or SHIPPED_QUESTIONS)
        if not (split == "train" and sc.eval_questions):
            rows = [r for r in rows if is_eval_row(r["id"]) == (split == "eval")]
    if split == "train":
        random.Random(cfg.seed).shuffle(rows)
    want = cfg.game_pool if split == "train" else cfg.eval_pool
    if want > len(rows):
        log.warning("Search-QA %s pool: %d tasks asked, %d available", split, want, len(rows))
    return [_task(r) for r in rows[:want]]


# ---------------------------------------------------------------------------
# The environment

_ACTION_RE = re.compile(r"\s*<(search|answer)>(.*?)</\1>\s*", re.IGNORECASE | re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """("search" | "answer", content) of an action that is exactly one tagged block; None otherwise.

    The content is flattened to one line; "" when it is blank.
    """
    m = _ACTION_RE.fullmatch(action or "")
    if m is None or re.search(r"</?(search|answer)>", m.group(2), re.IGNORECASE):
        return None
    return m.group(1).lower(), " ".join(m.group(2).split())


def format_information(passages: list[str], max_passage_chars: int, max_chars: int) -> str:
    """Search-R1's observation: "<information>Doc 1 (Title: T) text\\nDoc 2 ...</information>".

    Each passage is cut to `max_passage_chars`, the whole to `max_chars` (the
    tags always survive when `max_chars` leaves room for them).
    """
    docs = []
    for i, p in enumerate(passages, 1):
        title, text = split_title(p)
        body = " ".join(text.split())
        docs.append(cap(f"Doc {i} (Title: {title}) {body}" if title else f"Doc {i} {body}", max_passage_chars))
    inner = "\n".join(docs) if docs else "No results."
    tags = len("<information></information>")
    if max_chars - tags >= 4:
        return f"<information>{cap(inner, max_chars - tags)}</information>"
    return cap(f"<information>{inner}</information>", max_chars)


class SearchEnv:
    """One Search-QA episode: search steps return passages, the answer step ends it with EM as reward."""

    def __init__(self, task: Task, cfg: EnvSection, retriever: Retriever):
        self.task = task
        self.cfg = cfg
        self.retriever = retriever
        self.question = str(task.spec["question"])
        self.golden_answers = [str(a) for a in task.spec["golden_answers"]]
        self._done = True  # until reset()

    def _step(self, observation: str, **kw: Any) -> EnvStep:
        kw.setdefault("won", False)
        kw.setdefault("done", False)
        return EnvStep(observation=cap(observation, self.cfg.max_observation_chars), admissible_commands=[],
                       lost=kw["done"] and not kw["won"], score=float(kw["won"]), **kw)

    def reset(self) -> EnvStep:
        """Start (or restart) the episode: the observation is "Question: <question>"."""
        self._done = False
        return self._step(f"Question: {self.question}")

    def step(self, action: str) -> EnvStep:
        """Play "<search>query</search>" or "<answer>text</answer>"; anything else is an invalid action.

        Raises RuntimeError before reset() or after the answer; a retriever
        failure (RetrievalError, a RuntimeError) propagates.
        """
        if self._done:
            raise RuntimeError("SearchEnv.step called on a finished (or not yet reset) episode")
        parsed = parse_action(str(action)[: 4 * MAX_ANSWER_CHARS])
        if parsed is None or not parsed[1]:
            return self._step(PROMPT.invalid_feedback, invalid_action=True, info={"reason": "not one tagged block"})
        tag, content = parsed
        if tag == "answer":
            em = exact_match(content[:MAX_ANSWER_CHARS], self.golden_answers)
            self._done = True
            return self._step(f"Your answer: {content[:MAX_ANSWER_CHARS]}", won=em == 1.0, done=True, reward=em,
                              info={"em": em, "prediction": content[:MAX_ANSWER_CHARS]})
        query = content[:MAX_QUERY_CHARS]
        passages = self.retriever.search(query, self.cfg.search.top_k)
        obs = format_information(passages[: self.cfg.search.top_k], self.cfg.search.max_passage_chars,
                                 self.cfg.max_observation_chars)
        return self._step(obs, info={"query": query, "passages": len(passages)})

    def close(self) -> None:
        """Nothing to release (the retriever is shared)."""


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> SearchEnv:
    """The episode env of `task`; raises RuntimeError when `ctx.retriever` is None."""
    if ctx.retriever is None:
        raise RuntimeError("Search-QA needs a retriever (EnvContext.retriever): the embedder's /retrieve "
                           "(HTTPRetriever) or an in-process LocalRetriever")
    return SearchEnv(task, cfg, ctx.retriever)


# ---------------------------------------------------------------------------
# Retrievers


class RetrievalError(RuntimeError):
    """Retrieval failed: the embedder refused the request, serves no corpus, or stayed unreachable."""


class HTTPRetriever:
    """`Retriever` over the embedder's POST /retrieve, with the run's bearer token.

    `locate()` gives the embedder's base URL (None while it has not announced
    one), asked before every attempt. Connection errors, timeouts, a missing
    URL and a 503 with Retry-After (the index is still being built) are retried
    with backoff (0.5 s, doubling, at most 10 s) for up to `retry_s` seconds;
    another HTTP error answer is not (a 503 names the reason: a corpus that
    failed to load; a 404 an embedder without a corpus). `client`: an
    httpx.Client to use instead of one with `timeout_s` (tests pass a FastAPI TestClient).
    """

    def __init__(self, locate: Callable[[], str | None], token: str, timeout_s: float = 30.0,
                 retry_s: float = 30.0, client: Any = None):
        import httpx

        self._httpx = httpx
        self.locate = locate
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.client = client if client is not None else httpx.Client(timeout=timeout_s)
        self.headers = {"Authorization": f"Bearer {token}"}

    def search(self, query: str, k: int) -> list[str]:
        """The contents of the top-`k` passages for `query`, best first. Raises RetrievalError."""
        from opsd.embedding_api import RetrieveResponse

        httpx = self._httpx
        start, delay, err = time.monotonic(), 0.5, None
        while True:
            url = self.locate()
            try:
                if url is None:
                    raise RetrievalError("the embedder has not announced its port")
                r = self.client.post(f"{url.rstrip('/')}/retrieve", json={"query": query, "k": k}, headers=self.headers)
                if r.status_code == 503 and "retry-after" in r.headers:
                    raise RetrievalError(f"the embedder is not ready: {r.text[:200]}")
                break
            except (httpx.TransportError, RetrievalError) as e:
                err = e
            left = self.retry_s - (time.monotonic() - start)
            if left <= 0:
                raise RetrievalError(f"the embedder's /retrieve stayed unreachable or unready for {self.retry_s:.0f}s: {err}") from err
            time.sleep(min(delay, left))
            delay = min(delay * 2, 10.0)
        if r.status_code != 200:
            try:
                body = r.json()
            except ValueError:
                body = None
            detail = body.get("detail") if isinstance(body, dict) else r.text[:200]
            hint = {401: " (the rollout's OPSD_API_TOKEN is not the embedder's)",
                    404: " (this embedder serves no corpus: it must run with env.name 'search' in its config)",
                    }.get(r.status_code, "")
            raise RetrievalError(f"the embedder's /retrieve answered {r.status_code}{hint}: {detail}")
        try:
            out = RetrieveResponse.model_validate(r.json()).check(k)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise RetrievalError(f"the embedder's /retrieve gave a malformed answer: {e}") from e
        return [p.contents for p in out.passages]


class LocalRetriever:
    """`Retriever` in this process: the embedder's own index code (opsd/retrieval.py).

    `encoder`: an encoder name (as embedder.encoder) or an Encoder object.
    With `cache_dir`, the index is cached like the embedder caches it. The
    index is built at the first search.
    """

    def __init__(self, corpus_path: str | Path | None = None, encoder: Any = "all-MiniLM-L6-v2",
                 cache_dir: str | Path | None = None):
        name = encoder if isinstance(encoder, str) else ""
        if isinstance(encoder, str):
            from opsd.encoder import Encoder

            encoder = Encoder(encoder)
        self.index = LazyCorpusIndex(corpus_path or SHIPPED_CORPUS, encoder, name, cache_dir)

    def search(self, query: str, k: int) -> list[str]:
        """The contents of the top-`k` passages for `query`, best first. Raises RuntimeError for a bad corpus."""
        return [p.contents for p, _ in self.index.get().search(query, k)]
