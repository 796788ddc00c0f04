"""`env:` and its per-environment sections (`env.twx`, `env.alfworld`, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opsd.config.base import _Section
from opsd.types import MAX_GROUP_TURNS


ENV_NAMES = ("textworld", "twx", "scienceworld", "alfworld", "search", "webshop", "reasoning_gym", "evidence")


class TWXSection(_Section):
    """TextWorld-Express (opsd/envs/twx.py): games drawn round-robin from `games`."""

    games: list[Literal["coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder"]] = Field(
        ["coin"], min_length=1
    )
    # TWX's own parameter string ("" = the game's defaults), or one per game {game: string}. A shared
    # string's keys that a game does not know are dropped for that game (mapreader: maxDistanceApart < numLocations).
    game_params: str | dict[str, str] = "numLocations=1,includeDoors=0"
    # Deadline (s) for each call into the JVM (reset/step: ms); past it the JVM is killed and the episode errors.
    step_timeout_s: float = Field(60.0, gt=0)


class ScienceWorldSection(_Section):
    """ScienceWorld (opsd/envs/scienceworld.py): tasks round-robin from `tasks`, each on its train
    variations (pool: game_pool) or its dev variations (eval_pool)."""

    tasks: list[str] = Field(["find-living-thing"], min_length=1)  # ScienceWorld task names
    simplifications: str = "easy"  # comma-separated: easy, teleportAction, openDoors, openContainers, ...
    # Deadline (s) for each call into the JVM (load up to ~5 s, step 0.1-3 s); past it the JVM is killed.
    step_timeout_s: float = Field(60.0, gt=0)


class AlfWorldSection(_Section):
    """ALFWorld (opsd/envs/alfworld.py) on the `alfworld` package's engine."""

    # A directory holding the real ALFWorld game files (json_2.1.1/...: game.tw-pddl + traj_data.json);
    # None = tasks built offline from the PDDL domain, grammar and layouts the package ships.
    data_dir: str | None = None
    eval_split: Literal["valid_seen", "valid_unseen"] = "valid_seen"  # data_dir's folder the eval split plays
    # Categories to play (reported per category): subset of pick, look, clean, heat, cool, pick2.
    task_types: list[Literal["pick", "look", "clean", "heat", "cool", "pick2"]] = Field(
        ["pick", "look", "clean", "heat", "cool", "pick2"], min_length=1)


class SearchSection(_Section):
    """Search-QA (opsd/envs/search.py), Search-R1 protocol; retrieval by the embedder over `corpus`."""

    corpus: str | None = None  # JSONL {"id", "contents"}; None = the small corpus shipped in opsd/envs/data/search/
    questions: str | None = None  # JSONL {"id", "question", "golden_answers", "data_source"}; None = the shipped set
    # Eval questions in their own file (e.g. Search-R1's test split); None = a deterministic third of `questions`
    eval_questions: str | None = None
    top_k: int = Field(3, ge=1, le=50)
    max_passage_chars: int = Field(600, ge=16)


class WebShopSection(_Section):
    """WebShop (opsd/envs/webshop.py): a client for a running WebShop server (its text env over HTTP).

    Setup and the goal-index conventions: opsd/envs/WEBSHOP.md. Goals 0-499 are
    WebShop's test goals; train from 500+ (WebShop's own baseline: 500-1499 dev, 1500+ train).
    """

    url: str = "http://127.0.0.1:3000"  # the WebShop Flask app (python -m web_agent_site.app serves port 3000)
    goals: list[int] = list(range(500, 600))  # goal (session fixed_<i>) indices to train on; the first game_pool
    eval_goals: list[int] = list(range(0, 100))  # the first eval_pool are evaluated; must not meet `goals`
    timeout_s: float = Field(30.0, gt=0)  # deadline of one HTTP request (redirects and body included)
    max_page_bytes: int = Field(4_000_000, gt=0)  # a larger page body is a server failure (WebShopError)

    @model_validator(mode="after")
    def _check(self) -> "WebShopSection":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"env.webshop.url must be an http(s) URL, got {self.url!r}")
        if any(g < 0 for g in [*self.goals, *self.eval_goals]):
            raise ValueError("env.webshop goal indices must be >= 0")
        return self


class ReasoningGymSection(_Section):
    """Single-turn verifiable tasks from reasoning-gym (opsd/envs/reasoning_gym.py)."""

    datasets: list[str] = Field(["basic_arithmetic"], min_length=1)  # reasoning_gym.factory.DATASETS names
    # Items generated per dataset and split (indices 0..size-1); the pools draw from them round-robin.
    size: int = Field(64, ge=1, le=1_000_000)
    # Wall-clock bound on one answer's scoring in the sandboxed verifier process; a timeout scores 0.
    verifier_timeout_s: float = Field(5.0, gt=0, le=600)
    # Datasets whose verifier evaluates the answer as code (eval / sympy parse_expr: spiral_matrix,
    # countdown, ...) are refused unless this is set (they still run in the sandboxed verifier process).
    allow_code_eval_verifiers: bool = False


# Characters per SmolLM2 token of the evidence env's generated text, per kind (measured with SmolLM2's tokenizer:
# tests/test_env_evidence.py checks the documents' token counts against their targets).
EVIDENCE_CHARS_PER_TOKEN = {"tables": 2.05, "retrieval": 3.05}


def evidence_observation_chars(tokens: int) -> int:
    """An upper bound on an evidence observation's characters for a target of `tokens`: the document stops
    within a table or passage of its target, plus the question twice."""
    return int(tokens * max(EVIDENCE_CHARS_PER_TOKEN.values())) + 2000


class EvidenceSection(_Section):
    """Long-context evidence aggregation generated from seeds (opsd/envs/evidence.py)."""

    kinds: list[Literal["tables", "retrieval"]] = Field(["tables", "retrieval"], min_length=1)
    # Target document lengths in tokens; each is a category (length bucket). SmolLM2's context is 8192.
    prompt_tokens: list[int] = Field([1024, 2048, 4096], min_length=1)

    @model_validator(mode="after")
    def _lengths(self) -> "EvidenceSection":
        if len(set(self.kinds)) != len(self.kinds) or len(set(self.prompt_tokens)) != len(self.prompt_tokens):
            raise ValueError("evidence.kinds and evidence.prompt_tokens must not repeat a value")
        if not all(64 <= n <= 131072 for n in self.prompt_tokens):
            raise ValueError(f"evidence.prompt_tokens must be in [64, 131072], got {self.prompt_tokens}")
        return self


class EnvSection(_Section):
    name: Literal[ENV_NAMES] = "textworld"  # type: ignore[valid-type]
    num_games: int = Field(2, ge=1, le=4096)  # distinct games (task groups) per step
    game_pool: int = Field(8, ge=1, le=1_000_000)  # tasks in the training pool (textworld: seeds seed..seed+game_pool-1)
    eval_pool: int = Field(16, ge=1, le=1_000_000)  # tasks `opsd eval` plays (the env's validation split where it has one)
    seed: int = 1234
    world_size: int = Field(1, ge=1)  # textworld: rooms
    nb_objects: int = Field(3, ge=1)  # textworld
    quest_length: int = Field(1, ge=1)  # textworld
    max_turns: int = Field(4, ge=1, le=MAX_GROUP_TURNS)
    prompt_format: Literal["action", "think"] = "action"
    list_admissible: bool = True
    one_shot: bool = True
    invalid_feedback: str = (
        "Invalid response. Reply with exactly one command inside <action></action>."
    )
    max_observation_chars: int = Field(2000, ge=16)
    # What the teacher's privileged context holds (spec section 0): the SkillBank's skills
    # (opsd/skills/<env>/), the environment's walkthrough / gold path where it has one, or both;
    # "remaining": per turn, the gold path left from the state the turn acted in (the env's
    # policy_commands; one teacher view per turn), "skills+remaining": the skills plus that; "none": no
    # privileged context, the teacher sees the student's exact prompt (plain OPD with an external teacher).
    privileged: Literal["skills", "walkthrough", "both", "remaining", "skills+remaining", "none"] = "both"
    twx: TWXSection = TWXSection()
    scienceworld: ScienceWorldSection = ScienceWorldSection()
    alfworld: AlfWorldSection = AlfWorldSection()
    search: SearchSection = SearchSection()
    webshop: WebShopSection = WebShopSection()
    reasoning_gym: ReasoningGymSection = ReasoningGymSection()
    evidence: EvidenceSection = EvidenceSection()

    @model_validator(mode="after")
    def _evidence_fits_the_observation(self) -> "EnvSection":
        if self.name == "evidence":  # a cut document would lose evidence, not just text
            need = evidence_observation_chars(max(self.evidence.prompt_tokens))
            if self.max_observation_chars < need:
                raise ValueError(f"env.max_observation_chars {self.max_observation_chars} would cut the evidence "
                                 f"documents of evidence.prompt_tokens up to {max(self.evidence.prompt_tokens)}; "
                                 f"set it to at least {need}")
        return self

    @model_validator(mode="after")
    def _per_turn_hint_needs_a_gold_path(self) -> "EnvSection":
        if self.privileged in ("remaining", "skills+remaining") and self.name in ("search", "webshop"):
            # These envs report no policy_commands: the teacher would see no hint, and no error would say so.
            raise ValueError(f"env.privileged {self.privileged!r} needs an env that reports its remaining gold path "
                             f"(textworld, twx, scienceworld, alfworld, reasoning_gym), not {self.name!r}")
        return self
