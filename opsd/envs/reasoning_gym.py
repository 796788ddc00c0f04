"""reasoning-gym adapter: single-turn verifiable tasks (GC-OPD style).

Each task is one procedurally generated item {question, answer, metadata} of a
reasoning-gym dataset (`EnvSection.reasoning_gym.datasets`). The episode is a
single turn: reset() shows the question, step(answer_text) scores the answer
with the dataset's own verifier (`score_answer`) and ends the episode. The
reward is the verifier's score in [0, 1]; won = a score of exactly 1.

Items and seeds. reasoning-gym builds item `i` of a dataset with seed `s`
from `Random(s + i)`, so nearby seeds share items. Each dataset gets a base
seed (a hash of cfg.seed and the dataset name, below 2**30); the train split
uses it, the eval split uses base + 2**30: the two splits never share an RNG
stream. Identical questions can still come out of different streams (short
arithmetic), so questions are de-duplicated within a split, and the eval split
also drops any question of the train pool: train and eval are disjoint.
Items are taken from indices 0..size-1 (`reasoning_gym.size`), round-robin
across the datasets, until the pool (game_pool / eval_pool) is full.

Task.spec holds the dataset name, seed, size and index *and* the item itself
(question, answer, metadata) after a JSON round trip, so `open_env` on another
machine re-creates the dataset object only for its verifier and never
regenerates items. make_tasks refuses a dataset whose items do not survive the
JSON round trip (not JSON-able, or the reference answer no longer scores 1 on
the round-tripped entry: arc_agi and rearc in reasoning-gym 0.1.25).

Privileged information (decision): for single-turn tasks the most useful
privileged context is the reference solution (GC-OPD conditions the teacher
on it), so `Task.gold_path` is `["answer: <reference answer>"]` and the
SkillBank renders it as the walkthrough ("Walkthrough: answer: -4") after the
skills in opsd/skills/reasoning_gym/. Datasets without a single reference
answer (answer None: their verifier accepts any valid solution) get
gold_path []. The reference answer also stays in Task.spec (privileged: the
student only ever sees the question).

Verifier sandbox (security). Several reasoning-gym verifiers run the model's
answer as Python: eval() (spiral_matrix, string_insertion, binary_matrix,
n_queens, number_sorting) or sympy.parse_expr (countdown, puzzle24,
polynomial_multiplication, *_integration). So step() never calls
`score_answer` in the rollout process: the answer goes, as JSON bytes over a
multiprocessing Pipe, to one persistent verifier process per rollout process
(`_Verifier`; "spawn" start method, so nothing of the parent - torch,
threads, sockets - is inherited; started on the first step, reused). The
worker confines itself before serving (`_confine`): a fresh temporary working
directory, RLIMIT_AS = its size after imports + 2 GiB, RLIMIT_CPU and
RLIMIT_FSIZE = 0, and a PEP 578 audit hook that refuses writes, deletes,
processes, sockets, ctypes and rlimit changes. Each call has a wall-clock
bound (`reasoning_gym.verifier_timeout_s`); on timeout the worker is killed
(and respawned on the next call) and the step scores 0 with
info["verifier_error"] = "timeout". A verifier exception, a worker crash or a
non-finite score (NaN, +-inf) also scores 0 with info["verifier_error"].
This is defence in depth, not a proof: in addition make_tasks and open_env
refuse datasets whose verifier evaluates code (`code_eval_reason`: a scan of
the dataset class's source for eval/exec/compile/__import__/parse_expr/
sympify/parse_latex, plus the list found by that scan on reasoning-gym
0.1.25, `CODE_EVAL_DATASETS`) unless `reasoning_gym.allow_code_eval_verifiers`
is set. The scan is deliberately conservative: codeio (it exec()s dataset
code when generating items, not the answer) is refused too. make_tasks scores the datasets' own reference answers
in-process (generated locally, not model text).

Answers are not flattened: some answers span lines (matrices, grids) and the
verifiers compare text. Invalid actions do not exist here: any text is an
answer (the rollout's parser checks the <answer> format).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from functools import lru_cache
from importlib.metadata import version
from typing import Any, Iterator

import reasoning_gym
from reasoning_gym.factory import DATASETS

from opsd.config import EnvSection
from opsd.envs.base import EnvContext, EnvPrompt, EnvStep, Task, cap

NAME = "reasoning_gym"
ACTION_TAGS = ("answer",)
METRIC = "success"

# The eval split's seeds sit this far above the train split's (base seeds are below it).
EVAL_SEED_OFFSET = 2**30
# Answers longer than this are cut before scoring (no real answer comes close).
MAX_ANSWER_CHARS = 16_384
# Datasets whose verifier (class source) evaluates text as code in reasoning-gym 0.1.25, found by
# `code_eval_reason`'s scan over all 106 datasets; kept so a refactor upstream that hides the call
# from the scan does not silently re-enable them.
CODE_EVAL_DATASETS = frozenset({
    "binary_matrix", "codeio", "countdown", "intermediate_integration", "n_queens", "number_sorting",
    "polynomial_multiplication", "puzzle24", "simple_integration",
    "spiral_matrix", "string_insertion",
})
_CODE_EVAL_RE = re.compile(r"(?<![\w.])(?:eval|exec|compile|__import__)\s*\(|parse_expr|sympify|parse_latex")
# The verifier process: how long it may take to start (import reasoning-gym), its address-space
# headroom over its size after imports, and the CPU seconds after which it retires (is replaced).
WORKER_START_TIMEOUT_S = 120.0
WORKER_AS_HEADROOM = 2 << 30
WORKER_CPU_LIMIT_S = 3600
WORKER_RETIRE_CPU_S = 1800.0

PROMPT = EnvPrompt(
    system={
        "action": (
            "Solve the problem. Reply with only the final answer inside <answer></answer>, "
            "for example <answer>42</answer>."
        ),
        "think": (
            "Solve the problem. First reason step by step inside <think></think>, then give only "
            "the final answer inside <answer></answer>, for example "
            "<think>...</think><answer>42</answer>."
        ),
    },
    # A made-up exchange (not from any dataset) that shows the reply format.
    example=(
        "What is 7 * 6 - 5?",
        [],
        {
            "action": "<answer>37</answer>",
            "think": "<think>7 * 6 = 42, and 42 - 5 = 37.</think><answer>37</answer>",
        },
    ),
    # Shown by the rollout when a reply has no parsable <answer> (the env itself never sees it).
    invalid_feedback="Invalid response. Give only the final answer inside <answer></answer>.",
)


def _base_seed(seed: int, dataset: str) -> int:
    """The train seed of `dataset` under run seed `seed`: a stable hash, in [0, 2**30)."""
    digest = hashlib.sha256(f"reasoning_gym:{seed}:{dataset}".encode()).hexdigest()
    return int(digest[:8], 16) % EVAL_SEED_OFFSET


@lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int) -> Any:
    """reasoning_gym.create_dataset(name, seed=, size=), cached per process (cheap for most
    datasets: items are built on access). ValueError naming the dataset when it cannot be built."""
    if name not in DATASETS:
        raise ValueError(
            f"unknown reasoning-gym dataset {name!r} (reasoning-gym {version('reasoning-gym')}); "
            f"known: {', '.join(sorted(DATASETS))}"
        )
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size)
    except Exception as exc:
        raise ValueError(f"reasoning-gym dataset {name!r} cannot be built from seed and size alone: {exc}") from exc


def _score(ds: Any, answer: str | None, entry: dict[str, Any]) -> float:
    """The verifier's score of `answer` in THIS process, clamped to [0, 1] (NaN, +-inf -> 0).
    Only for the datasets' own reference answers (make_tasks) and inside the verifier process;
    model answers go through `_VERIFIER`. Verifier errors propagate."""
    value = float(ds.score_answer(answer, entry))
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


@lru_cache(maxsize=None)
def code_eval_reason(name: str) -> str | None:
    """Why dataset `name`'s verifier may evaluate text as Python, or None.

    Scans the source of the dataset class and its ProceduralDataset subclasses (all methods, so
    helpers of score_answer count) for eval/exec/compile/__import__ calls and sympy's
    parse_expr/sympify/parse_latex, and checks `CODE_EVAL_DATASETS`. Unknown names give None
    (the caller reports them). Conservative: a match in item generation counts too.
    """
    if name not in DATASETS:
        return None
    from reasoning_gym.dataset import ProceduralDataset

    cls = DATASETS[name][0]
    for klass in cls.__mro__:
        if klass is ProceduralDataset or not (isinstance(klass, type) and issubclass(klass, ProceduralDataset)):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            return f"the source of {klass.__name__} cannot be read to check it"
        match = _CODE_EVAL_RE.search(source)
        if match:
            return f"{klass.__name__} calls {match.group(0).rstrip('(').strip()}"
    return "listed in CODE_EVAL_DATASETS" if name in CODE_EVAL_DATASETS else None


def _check_code_eval(name: str, allow: bool) -> None:
    """ValueError naming `name` and the opt-in option when its verifier evaluates code and not `allow`."""
    why = None if allow else code_eval_reason(name)
    if why:
        raise ValueError(
            f"reasoning-gym dataset {name!r} has a verifier that evaluates the answer as code ({why}); "
            f"set reasoning_gym.allow_code_eval_verifiers: true to use it (answers are still scored in "
            f"the sandboxed verifier process)"
        )


# --------------------------------------------------------------------------- the verifier process


def _audit(event: str, args: tuple) -> None:
    """The verifier process's audit hook (PEP 578): refuse file writes and other side effects."""
    if event == "open":
        mode, flags = (args + (None, None))[1:3]
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & writes):
            raise PermissionError(f"verifier sandbox: write access refused ({args[0]!r})")
    elif event.startswith(_AUDIT_DENY):
        raise PermissionError(f"verifier sandbox: {event} refused")


_AUDIT_DENY = (
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.", "pty.",
    "socket.", "ctypes.", "resource.setrlimit", "resource.prlimit", "os.remove", "os.unlink", "os.rmdir",
    "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate", "os.kill",
    "os.killpg", "os.putenv", "os.unsetenv", "os.chdir", "os.utime", "os.setxattr", "os.removexattr",
    "shutil.", "webbrowser.", "sys.remote_exec",
)


def _confine() -> str:
    """Confine the verifier process (called once at its start, after its imports): a fresh temporary
    working directory, RLIMIT_AS (size now + WORKER_AS_HEADROOM), RLIMIT_CPU, RLIMIT_FSIZE 0 and the
    audit hook. Returns the working directory."""
    import resource
    import signal

    workdir = tempfile.mkdtemp(prefix="opsd-rg-verifier-")
    os.chdir(workdir)
    with open("/proc/self/statm") as f:  # size in pages (Linux); read before the hook refuses nothing here
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-limit write fails with EFBIG instead of killing
    for limit, value in ((resource.RLIMIT_AS, size + WORKER_AS_HEADROOM),
                         (resource.RLIMIT_CPU, WORKER_CPU_LIMIT_S), (resource.RLIMIT_FSIZE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    sys.addaudithook(_audit)
    return workdir


def _verify(request: dict[str, Any]) -> dict[str, Any]:
    """Score one request {dataset, seed, size, entry, answer} with the dataset's verifier (in the
    verifier process). Returns {"score": float (may be non-finite)} or {"error": text}."""
    try:
        ds = _dataset(str(request["dataset"]), int(request["seed"]), int(request["size"]))
        return {"score": float(ds.score_answer(request["answer"], request["entry"]))}
    except BaseException as exc:  # noqa: BLE001 - the answer may raise anything, SystemExit included
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _worker_main(conn: Any) -> None:
    """The verifier process: confine, say ready, then answer JSON requests until the pipe closes.
    Retires (exits after replying, saying so) once it has used WORKER_RETIRE_CPU_S of CPU."""
    workdir = _confine()
    conn.send_bytes(json.dumps({"ready": True, "workdir": workdir}).encode())
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        reply = _verify(request)
        retire = time.process_time() > WORKER_RETIRE_CPU_S
        conn.send_bytes(json.dumps({**reply, "retire": retire}).encode())
        if retire:
            return


class _Verifier:
    """The rollout process's handle on its verifier process: started lazily, reused, replaced after
    a timeout (respawned at once), a crash or its retirement (on the next call). Thread-safe (calls
    are serialized); a forked child drops its parent's handle and starts its own.

    Like any "spawn" user, a program run as a script must guard its entry point with
    `if __name__ == "__main__":` (modules run with `python -m` and pytest need nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False
        self._workdir: str | None = None
        self._pid = os.getpid()

    def _spawn(self) -> None:
        """Start a verifier process without waiting for it (it says ready when confined)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(child,), name="opsd-rg-verifier",
                           daemon=not multiprocessing.current_process().daemon)
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _wait_ready(self) -> None:
        hello = json.loads(self._conn.recv_bytes()) if self._conn.poll(WORKER_START_TIMEOUT_S) else {}
        if not hello.get("ready"):
            raise RuntimeError(f"the reasoning-gym verifier process did not start within {WORKER_START_TIMEOUT_S} s")
        self._ready, self._workdir = True, str(hello["workdir"])

    def stop(self) -> None:
        """Kill the verifier process (if any) and remove its working directory; the next call starts
        a new one."""
        proc, conn, workdir = self._proc, self._conn, self._workdir
        self._proc = self._conn = self._workdir = None
        if conn is not None:
            conn.close()
        if proc is not None and self._pid == os.getpid():
            proc.kill()
            proc.join(5)
        if workdir and os.path.basename(workdir).startswith("opsd-rg-verifier-"):
            shutil.rmtree(workdir, ignore_errors=True)

    def score(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `request` (plain JSON data) to the verifier process and wait at most `timeout_s`.
        Returns {"score": float} or {"error": "timeout" | text}; never raises for a bad answer."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the process and pipe belong to the parent
                self._proc = self._conn = self._workdir = None
                self._pid = os.getpid()
            try:
                if self._proc is None or not self._proc.is_alive():
                    self.stop()
                    self._spawn()
                if not self._ready:  # start-up (imports) is not charged to the answer's timeout
                    self._wait_ready()
                self._conn.send_bytes(json.dumps(request).encode())
                if not self._conn.poll(timeout_s):
                    self.stop()
                    self._spawn()  # the replacement starts now, while the rollout goes on
                    return {"error": "timeout"}
                reply = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError, RuntimeError, ValueError) as exc:
                self.stop()
                return {"error": f"verifier process failed: {type(exc).__name__}: {exc}"[:500]}
            if reply.pop("retire", False):
                self.stop()
            return reply


_VERIFIER = _Verifier()
atexit.register(_VERIFIER.stop)


def _roundtrip(name: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    """The item as it will arrive on another machine (through JSON); ValueError if not JSON-able."""
    entry = {"question": item["question"], "answer": item["answer"], "metadata": item.get("metadata", {})}
    try:
        return json.loads(json.dumps(entry, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reasoning-gym dataset {name!r} is not supported: item {index} is not JSON-able ({exc})"
        ) from exc


def _items(name: str, seed: int, size: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, JSON round-tripped entry) for indices 0..size-1 of dataset `name` with `seed`.

    Raises ValueError when an item is not JSON-able, or its reference answer does not score 1
    on the round-tripped entry (the verifier would then misjudge answers on another machine).
    """
    ds = _dataset(name, seed, size)
    for index in range(size):
        raw = ds[index]
        entry = _roundtrip(name, index, raw)
        if isinstance(entry["answer"], str):
            original, travelled = _score(ds, raw["answer"], raw), _score(ds, entry["answer"], entry)
            if travelled != 1.0:
                why = "after a JSON round trip" if original == 1.0 else "even before a JSON round trip"
                raise ValueError(
                    f"reasoning-gym dataset {name!r} is not supported: the reference answer of item {index} "
                    f"scores {travelled} {why}"
                )
        yield index, entry


def _task(name: str, split: str, seed: int, size: int, index: int, entry: dict[str, Any]) -> Task:
    answer = entry["answer"]
    return Task(
        task_id=f"rg-{name}-{split}-s{seed}-i{index}",
        category=name,
        skill_key=name,
        spec={"dataset": name, "seed": seed, "size": size, "index": index, **entry},
        gold_path=[f"answer: {answer}"] if isinstance(answer, str) else [],
        objective=entry["question"],
    )


def _pool(cfg: EnvSection, split: str, count: int, exclude: set[str]) -> list[Task]:
    names = list(cfg.reasoning_gym.datasets)
    if not names:
        raise ValueError("reasoning_gym.datasets is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"reasoning_gym.datasets lists a dataset twice: {names}")
    size = cfg.reasoning_gym.size
    streams = []
    for name in names:
        _check_code_eval(name, cfg.reasoning_gym.allow_code_eval_verifiers)
        seed = _base_seed(cfg.seed, name) + (EVAL_SEED_OFFSET if split == "eval" else 0)
        streams.append((name, seed, _items(name, seed, size)))
    seen, tasks = set(exclude), []
    while len(tasks) < count and streams:
        for stream in list(streams):
            name, seed, items = stream
            for index, entry in items:  # the next item of this dataset whose question is new
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    tasks.append(_task(name, split, seed, size, index, entry))
                    break
            else:
                streams.remove(stream)  # exhausted
            if len(tasks) == count:
                break
    if len(tasks) < count:
        raise ValueError(
            f"reasoning-gym {split} pool needs {count} distinct questions but datasets {names} give only "
            f"{len(tasks)} from reasoning_gym.size={size} items each; raise reasoning_gym.size"
        )
    return tasks


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str = "train") -> list[Task]:
    """cfg.game_pool ("train") or cfg.eval_pool ("eval") tasks, round-robin across
    cfg.reasoning_gym.datasets; category = skill_key = the dataset name.

    Deterministic for a config. Eval questions never appear in the train pool. Raises
    ValueError on another split, an unknown or unsupported dataset, a dataset whose verifier evaluates
    code (unless reasoning_gym.allow_code_eval_verifiers), or too few distinct items.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if split == "train":
        return _pool(cfg, "train", cfg.game_pool, set())
    train_questions = {t.spec["question"] for t in _pool(cfg, "train", cfg.game_pool, set())}
    return _pool(cfg, "eval", cfg.eval_pool, train_questions)


class ReasoningGymEnv:
    """One single-turn episode: reset() -> the question; step(answer) -> scored, done."""

    def __init__(self, task: Task, max_observation_chars: int, verifier_timeout_s: float = 5.0) -> None:
        spec = task.spec
        try:
            self.dataset = str(spec["dataset"])
            self.seed, self.size = seed, size = int(spec["seed"]), int(spec["size"])
            self.entry = {"question": str(spec["question"]), "answer": spec["answer"],
                          "metadata": dict(spec.get("metadata") or {})}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed reasoning-gym task spec ({type(exc).__name__}: {exc})") from exc
        self._ds = _dataset(self.dataset, seed, size)
        self._max_chars = max_observation_chars
        self._timeout_s = verifier_timeout_s
        self._done = True
        self._started = False

    def reset(self) -> EnvStep:
        """Start (or restart) the episode; the observation is the question (capped)."""
        self._done, self._started = False, True
        answer = self.entry["answer"]
        return EnvStep(
            observation=cap(self.entry["question"], self._max_chars),
            admissible_commands=[],
            won=False,
            lost=False,
            done=False,
            score=0.0,
            policy_commands=[answer] if isinstance(answer, str) else [],
        )

    def step(self, action: str) -> EnvStep:
        """Score `action` (the final answer text) with the dataset's verifier; always ends the episode.

        The verifier runs in the sandboxed verifier process (module docstring), bounded by
        verifier_timeout_s. reward = the verifier's score clamped to [0, 1]; won = reward == 1.
        A verifier exception, a timeout ("timeout"), a crashed verifier process or a non-finite
        score gives reward 0 and info["verifier_error"]. RuntimeError before reset() or after the end.
        """
        if self._done:
            what = "finished" if self._started else "not yet reset"
            raise RuntimeError(f"ReasoningGymEnv.step called on a {what} episode")
        self._done = True
        answer = (action if isinstance(action, str) else str(action)).strip()[:MAX_ANSWER_CHARS]
        info: dict[str, Any] = {"dataset": self.dataset}
        reply = _VERIFIER.score({"dataset": self.dataset, "seed": self.seed, "size": self.size,
                                 "entry": self.entry, "answer": answer}, self._timeout_s)
        value = reply.get("score")
        if isinstance(value, (int, float)) and math.isfinite(value):
            reward = min(1.0, max(0.0, float(value)))
        else:  # a verifier that chokes on odd text, times out or returns NaN/inf: the answer is wrong
            reward, info["verifier_error"] = 0.0, str(reply.get("error") or f"non-finite score {value}")
        won = reward == 1.0
        return EnvStep(
            observation="Correct." if won else "Incorrect.",
            admissible_commands=[],
            won=won,
            lost=not won,
            done=True,
            score=reward,
            reward=reward,
            info=info,
        )

    def close(self) -> None:
        """Nothing to release (the verifier process is shared per process); safe to call twice."""
        self._done = True


def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> ReasoningGymEnv:
    """A ReasoningGymEnv for `task` from its spec alone (the item is in the spec; the dataset object
    is re-created only for its verifier). ValueError on a malformed spec, an unknown dataset, or one
    whose verifier evaluates code unless cfg.reasoning_gym.allow_code_eval_verifiers."""
    _check_code_eval(str(task.spec.get("dataset")), cfg.reasoning_gym.allow_code_eval_verifiers)
    return ReasoningGymEnv(task, cfg.max_observation_chars, cfg.reasoning_gym.verifier_timeout_s)
