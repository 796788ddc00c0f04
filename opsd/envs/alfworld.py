"""ALFWorld adapter: the `alfworld` package's text engine (TextWorld's PDDL backend + fast-downward).

Two task sources:

* Generated (default, offline). The alfworld wheel ships the PDDL domain
  (alfred.pddl), the text grammar (alfred.twl2) and the ALFRED scene layouts
  (gen/layouts/FloorPlan<N>-objects.json / -openable.json: the object types of
  a scene and its receptacles with their interaction poses; a receptacle type
  listed without a pose gets one instance at a made-up spot), but not the game
  files. `make_tasks` writes the PDDL problems itself from those layouts: the
  scene's receptacles at their poses, the task's objects plus distractors
  placed where ALFRED allows them (constants.VAL_RECEPTACLE_OBJECTS), the goal
  from the package's goal library (gen/goal_library.py) and the task line from
  its templates. The game file is the same JSON ALFWorld uses
  (`game.tw-pddl` = {pddl_domain, grammar, pddl_problem, solvable, walkthrough}).
  Train tasks use ALFRED's train scenes, eval tasks its test scenes (disjoint).
  The gold path is built with the problem (tests play it on the engine and win).
  With `ctx.cache_dir`, the games are also written to
  <cache_dir>/alfworld/<generator key>/<split>/<task_id>.tw-pddl.
* Real ALFWorld data (`cfg.alfworld.data_dir`): the game files of
  `alfworld-download` at <data_dir>/json_2.1.1/{train,valid_seen,valid_unseen}/
  <task-type>-<...>/<trial>/game.tw-pddl (+ traj_data.json); split "train"
  plays train/, "eval" plays `cfg.alfworld.eval_split`.

Categories (Task.category = Task.skill_key): pick, look, clean, heat, cool, pick2.
Reward = won (terminal, binary); ALFWorld's episode limit is 50 turns
(EnvSection.max_turns, enforced by the rollout). An action that is not among
the engine's admissible commands gets ALFWorld's "Nothing happens." and
invalid_action=True.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opsd.config import EnvSection
from opsd.envs.base import ClosingEnv, EnvContext, EnvPrompt, EnvStep, Task, cap
from opsd.envs.textworld import one_at_a_time  # ALFWorld runs on the textworld package

NAME = "alfworld"
ACTION_TAGS = ("action",)
METRIC = "success"

# Bump when the generation recipe changes: the task ids and cache folder change with it.
GENERATOR_VERSION = 1
MAX_ACTION_CHARS = 200

# Category <-> ALFWorld task type (the prefix of a real game's task folder).
TASK_TYPES = {
    "pick": "pick_and_place_simple",
    "look": "look_at_obj_in_light",
    "clean": "pick_clean_then_place_in_recep",
    "heat": "pick_heat_then_place_in_recep",
    "cool": "pick_cool_then_place_in_recep",
    "pick2": "pick_two_obj_and_place",
}
CATEGORY_OF = {v: k for k, v in TASK_TYPES.items()}
# The appliance a category needs (receptacle type), and the action that uses it.
_APPLIANCE = {"clean": ("SinkBasin", "clean"), "heat": ("Microwave", "heat"), "cool": ("Fridge", "cool")}
_PROPERTY = {"clean": "Cleanable", "heat": "Heatable", "cool": "Coolable"}
# Surfaces a desk lamp stands on in look tasks.
_LAMP_SURFACES = ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable", "TVStand", "CounterTop")

PROMPT = EnvPrompt(
    system={
        "action": (
            "You are an expert agent operating in the ALFRED Embodied Environment, a household you act in "
            "through text commands. The first observation ends with your task (\"Your task is to: ...\"); "
            "each later message is what the environment says after your command. At each step, {pick} "
            "that brings you closer to completing the task. Reply with only that command inside "
            "<action> </action> tags, e.g. <action>go to countertop 1</action>."
        ),
        "think": (
            "You are an expert agent operating in the ALFRED Embodied Environment, a household you act in "
            "through text commands. The first observation ends with your task (\"Your task is to: ...\"); "
            "each later message is what the environment says after your command. At each step, you should "
            "first reason step-by-step about the current situation; this reasoning MUST be enclosed within "
            "<think> </think> tags. Then {pick} that brings you closer to completing the task and present it "
            "within <action> </action> tags, e.g. <think>...</think><action>go to countertop 1</action>."
        ),
    },
    example=(
        "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, "
        "a drawer 1, a garbagecan 1, and a sinkbasin 1.\n\nYour task is to: put a clean spoon in drawer.",
        ["go to cabinet 1", "go to countertop 1", "go to drawer 1", "go to garbagecan 1", "go to sinkbasin 1",
         "help", "inventory", "look"],
        {
            "action": "<action>go to countertop 1</action>",
            "think": (
                "<think>I need a spoon first. Utensils usually lie on the countertop, so I will look there, "
                "then clean it at the sinkbasin and put it in the drawer.</think>"
                "<action>go to countertop 1</action>"
            ),
        },
    ),
)


# ---------------------------------------------------------------------------
# The package's logic files and scene layouts


@lru_cache(maxsize=1)
def _alfworld() -> SimpleNamespace:
    """The alfworld package pieces the adapter uses (imported on first use)."""
    try:
        import alfworld
        import alfworld.gen.constants as constants
        import alfworld.gen.goal_library as goal_library
        from alfworld.agents.utils.misc import Demangler
        from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH
    except ImportError as e:  # pragma: no cover - the env extra is installed
        raise ImportError("the ALFWorld env needs the `alfworld` package (pip install alfworld==0.4.2)") from e
    layouts = Path(alfworld.__file__).resolve().parent / "gen" / "layouts"
    return SimpleNamespace(
        version=getattr(alfworld, "__version__", "?"),
        C=constants,
        goals=goal_library.gdict,
        Demangler=Demangler,
        domain=Path(ALFRED_PDDL_PATH).read_text(),
        grammar=Path(ALFRED_TWL2_PATH).read_text(),
        layouts=layouts,
    )


@lru_cache(maxsize=None)
def _scene(num: int) -> tuple[dict[str, tuple[float, ...]], tuple[str, ...]] | None:
    """(receptacle id -> pose [x, z, rotation, horizon], object types) of FloorPlan<num>; None if not shipped."""
    lay = _alfworld().layouts
    recs, objs = lay / f"FloorPlan{num}-openable.json", lay / f"FloorPlan{num}-objects.json"
    if not (recs.is_file() and objs.is_file()):
        return None
    C = _alfworld().C
    receptacles = {k: tuple(v) for k, v in json.loads(recs.read_text()).items()}
    objtypes = set(json.loads(objs.read_text()))
    # Receptacle types the scene has (objects.json) but no pose for (often the garbage can, toilet,
    # towel holders): one instance each, at a made-up spot beside the room's centre.
    have = {_rtype(r) for r in receptacles}
    xs, zs = [p[0] for p in receptacles.values()], [p[1] for p in receptacles.values()]
    cx, cz = sum(xs) / len(xs), sum(zs) / len(zs)
    extra = sorted((objtypes & set(C.VAL_RECEPTACLE_OBJECTS)) - C.MOVABLE_RECEPTACLES_SET - have)
    for k, t in enumerate(extra, 1):
        x, z = cx + 0.5 * k, cz - 0.25 * k
        coords = "%+06.2f|+00.00|%+06.2f" % (x, z)
        rid = {"SinkBasin": f"Sink|{coords}|SinkBasin", "BathtubBasin": f"Bathtub|{coords}|BathtubBasin"}.get(
            t, f"{t}|{coords}")
        receptacles[rid] = (x, z, 0, 30)
    return dict(sorted(receptacles.items())), tuple(sorted(objtypes))


def _rtype(rid: str) -> str:
    parts = rid.split("|")  # "Sink|x|y|z|SinkBasin" is a SinkBasin
    return parts[4] if len(parts) > 4 else parts[0]


def _loc(pose: tuple[float, ...]) -> str:
    # ALFRED's grid: 0.25 m steps, rotation in quarter turns, camera horizon in degrees.
    return "loc|%d|%d|%d|%d" % (round(pose[0] / 0.25), round(pose[1] / 0.25), int(pose[2]) // 90 % 4, int(pose[3]))


def _pddl_name(s: str) -> str:
    """ALFRED ids -> PDDL names (the package's PlannedGameState.fix_pddl_str_chars rules)."""
    for a, b in (("-", "_minus_"), ("#", "-"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        s = s.replace(a, b)
    return s


def _pickupable_types() -> set[str]:
    A = _alfworld()
    held = set().union(*A.C.VAL_RECEPTACLE_OBJECTS.values())
    return {t for t in held if t in A.C.OBJECTS and not t.endswith("Sliced") and t != "Box"}


# ---------------------------------------------------------------------------
# Building one game


def _eligible(category: str, num: int) -> list[tuple[str, str]]:
    """(object type, target receptacle type) pairs a task of `category` can use in scene `num`."""
    A, sc = _alfworld(), _scene(num)
    if sc is None:
        return []
    recs, objtypes = sc
    rtypes = sorted({_rtype(r) for r in recs})
    if category in _APPLIANCE and _APPLIANCE[category][0] not in rtypes:
        return []
    if category == "look" and ("DeskLamp" not in objtypes or not any(t in _LAMP_SURFACES for t in rtypes)):
        return []
    pairs = []
    for ot in sorted(set(objtypes) & _pickupable_types()):
        if category in _PROPERTY and ot not in A.C.VAL_ACTION_OBJECTS[_PROPERTY[category]]:
            continue
        homes = [rt for rt in rtypes if ot in A.C.VAL_RECEPTACLE_OBJECTS.get(rt, ())]
        if category == "look":
            if homes:
                pairs.append((ot, "DeskLamp"))
            continue
        for rt in homes:
            start = [h for h in homes if h != rt and h != _APPLIANCE.get(category, ("",))[0]]
            if start and rt != _APPLIANCE.get(category, ("",))[0]:
                pairs.append((ot, rt))
    return pairs


def _scenes(split: str) -> list[int]:
    C = _alfworld().C
    return sorted(C.TRAIN_SCENE_NUMBERS if split == "train" else C.TEST_SCENE_NUMBERS)


def _build(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str], str]:
    """Game data (the tw-pddl JSON), gold path and task description of a generated task spec.

    spec: {"scene": int, "category": str, "seed": str}. Deterministic: the same
    spec gives the same game on any machine with the same alfworld release.
    """
    A = _alfworld()
    num, category = _parse_spec(spec)
    rng = random.Random(f"alfworld-v{GENERATOR_VERSION}-{spec['seed']}")
    sc = _scene(num)
    pairs = _eligible(category, num)
    if sc is None or not pairs:
        raise ValueError(f"scene FloorPlan{num} cannot host an ALFWorld {category!r} task")
    recs, objtypes = sc
    ot, rt = rng.choice(pairs)
    by_type: dict[str, list[str]] = {}
    for r in recs:
        by_type.setdefault(_rtype(r), []).append(r)
    placed, targets, lamp = _place_objects(rng, category, recs, objtypes, ot, rt)
    task_type = TASK_TYPES[category]
    goal = A.goals[task_type]["pddl"].format(obj=ot, recep=rt, toggle="DeskLamp", mrecep="")
    problem = _pddl_name(_pddl_problem(spec["seed"], recs, by_type, placed)) + "\n" + _pddl_name(goal)
    desc = rng.choice(A.goals[task_type]["templates"]).format(
        obj=ot.lower(), recep=rt.lower(), toggle="desklamp", mrecep="")
    path = _gold_path(rng, category, recs, by_type, placed, targets, rt, lamp)
    grammar = A.grammar.replace("UNKNOWN GOAL", desc)
    game = {"pddl_domain": A.domain, "grammar": grammar, "pddl_problem": problem, "solvable": True, "walkthrough": path}
    return game, path, desc


def _parse_spec(spec: dict[str, Any]) -> tuple[int, str]:
    """(scene number, category) of a generated task spec; ValueError for a malformed one or an unknown category."""
    try:
        num, category, _ = int(spec["scene"]), str(spec["category"]), str(spec["seed"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed generated ALFWorld task spec {spec!r}: {e}") from e
    if category not in TASK_TYPES:
        raise ValueError(f"unknown ALFWorld category {category!r}; known: {list(TASK_TYPES)}")
    return num, category


def _place_objects(rng: random.Random, category: str, recs: dict[str, tuple], objtypes: tuple[str, ...], ot: str,
                   rt: str) -> tuple[list[tuple[str, str]], list[str], tuple[str, str] | None]:
    """Objects put into the scene's receptacles: ((object id, receptacle id) of each, the target objects of type
    `ot` (none already in a `rt` or the category's appliance), (the desk lamp, its receptacle) for look), plus
    distractors of other pickupable types."""
    C = _alfworld().C
    appliance = _APPLIANCE.get(category, ("", ""))[0]
    taken: set[str] = set()
    placed: list[tuple[str, str]] = []  # (object id, receptacle id)

    def place(otype: str, homes: list[str]) -> str:
        r = rng.choice(homes)
        base = [float(v) for v in r.split("|")[1:4]]
        xyz = [base[0] + rng.uniform(-0.3, 0.3), base[1] + 0.05, base[2] + rng.uniform(-0.3, 0.3)]
        oid = f"{otype}|" + "|".join("%+06.2f" % v for v in xyz)
        while oid in taken:
            xyz[1] += 0.01
            oid = f"{otype}|" + "|".join("%+06.2f" % v for v in xyz)
        taken.add(oid)
        placed.append((oid, r))
        return oid

    def homes_of(otype: str, exclude: tuple[str, ...] = ()) -> list[str]:
        return [r for r in recs if otype in C.VAL_RECEPTACLE_OBJECTS.get(_rtype(r), ()) and _rtype(r) not in exclude]

    lamp = None
    if category == "look":
        lamp_home = rng.choice([r for r in recs if _rtype(r) in _LAMP_SURFACES])
        lamp = (place("DeskLamp", [lamp_home]), lamp_home)
    n_target = rng.choice((2, 3)) if category == "pick2" else rng.choice((1, 1, 2))
    targets = [place(ot, homes_of(ot, (rt, appliance))) for _ in range(n_target)]
    others = sorted((set(objtypes) & _pickupable_types()) - {ot})
    for dt in rng.sample(others, min(len(others), rng.randint(6, 12))):
        homes = homes_of(dt)
        for _ in range(rng.choice((1, 1, 2))):
            if homes:
                place(dt, homes)
    return placed, targets, lamp


def _pddl_problem(seed: str, recs: dict[str, tuple], by_type: dict[str, list[str]],
                  placed: list[tuple[str, str]]) -> str:
    """The PDDL problem (objects and initial state, ALFRED ids), in the layout of ALFWorld's initial_state.pddl."""
    C = _alfworld().C
    otypes = sorted((set(C.OBJECTS) - C.RECEPTACLES) | C.MOVABLE_RECEPTACLES_SET)
    rtypes = sorted(C.RECEPTACLES - C.MOVABLE_RECEPTACLES_SET)
    rec_locs = {r: _loc(p) for r, p in recs.items()}
    xs, zs = [p[0] for p in recs.values()], [p[1] for p in recs.values()]
    cx, cz = sum(xs) / len(xs), sum(zs) / len(zs)
    start = _loc((cx, cz, 0, 30))
    while start in rec_locs.values():
        cx += 0.25
        start = _loc((cx, cz, 0, 30))
    objects = ["agent1 # agent"] + [f"{t}Type # otype" for t in otypes] + [f"{t}Type # rtype" for t in rtypes]
    objects += [f"{o} # object" for o, _ in sorted(placed)] + [f"{r} # receptacle" for r in recs]
    objects += [f"{loc} # location" for loc in sorted(set(rec_locs.values()) | {start})]
    init = [f"(atLocation agent1 {start})"]
    for r in recs:
        init.append(f"(receptacleType {r} {_rtype(r)}Type)")
        init.append(f"(receptacleAtLocation {r} {rec_locs[r]})")
        if _rtype(r) in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {r})")
    for o, r in sorted(placed):
        t = o.split("|")[0]
        init += [f"(objectType {o} {t}Type)", f"(inReceptacle {o} {r})", f"(objectAtLocation {o} {rec_locs[r]})"]
        if t in _pickupable_types():
            init.append(f"(pickupable {o})")
        for pred, prop in (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                           ("toggleable", "Toggleable")):
            if t in C.VAL_ACTION_OBJECTS[prop]:
                init.append(f"({pred} {o})")
    present = {o.split("|")[0] for o, _ in placed}
    for rtype_ in sorted(by_type):
        init += [f"(canContain {rtype_}Type {t}Type)" for t in sorted(C.VAL_RECEPTACLE_OBJECTS.get(rtype_, ()))
                 if t in present]
    return "\n".join(
        [f"(define (problem plan_{seed})", "(:domain alfred)", "(:objects"]
        + ["        " + x for x in objects] + ["        )", "(:init"] + ["        " + x for x in init] + ["        )"]
    )


def _gold_path(rng: random.Random, category: str, recs: dict[str, tuple], by_type: dict[str, list[str]],
               placed: list[tuple[str, str]], targets: list[str], rt: str, lamp: tuple[str, str] | None) -> list[str]:
    """The walkthrough that solves the task: its commands, with the names the engine shows."""
    A = _alfworld()
    C = A.C
    appliance = _APPLIANCE.get(category, ("", ""))[0]
    lamp_id, lamp_home = lamp if lamp is not None else (None, None)
    # Names as the engine shows them: fast-downward lowercases, the package's Demangler numbers.
    ids = {_pddl_name(x).lower() for x, _ in placed} | {_pddl_name(r).lower() for r in recs}
    dm = A.Demangler(game_infos={i: SimpleNamespace(id=i) for i in ids})

    def name(x: str) -> str:
        return dm.demangle_alfred_name(_pddl_name(x).lower())

    path: list[str] = []
    state = {"at": None, "opened": set()}

    def goto(r: str) -> None:
        if state["at"] != r:
            path.append(f"go to {name(r)}")
            state["at"] = r
        if _rtype(r) in C.OPENABLE_CLASS_SET and r not in state["opened"]:
            path.append(f"open {name(r)}")
            state["opened"].add(r)

    home = dict(placed)
    dest = rng.choice(by_type[rt]) if rt in by_type else None
    for o in targets[: 2 if category == "pick2" else 1]:
        goto(home[o])
        path.append(f"take {name(o)} from {name(home[o])}")
        if category in _APPLIANCE:
            app = rng.choice(by_type[appliance])
            path.append(f"go to {name(app)}")
            state["at"] = app
            path.append(f"{_APPLIANCE[category][1]} {name(o)} with {name(app)}")
        if category == "look":
            if state["at"] != lamp_home:
                path.append(f"go to {name(lamp_home)}")
            path.append(f"use {name(lamp_id)}")
        else:
            goto(dest)
            path.append(f"move {name(o)} to {name(dest)}")
    return path


# ---------------------------------------------------------------------------
# Task lists


def _categories(cfg: EnvSection) -> list[str]:
    cats = list(dict.fromkeys(cfg.alfworld.task_types))
    bad = [c for c in cats if c not in TASK_TYPES]
    if bad or not cats:
        raise ValueError(f"alfworld.task_types must be a non-empty subset of {list(TASK_TYPES)}, got {cats}")
    return cats


def generator_key() -> str:
    """The folder name of this generator's games (changes with the recipe and the alfworld release)."""
    return f"gen-v{GENERATOR_VERSION}-alfworld{_alfworld().version}"


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _generated_tasks(cfg: EnvSection, ctx: EnvContext, split: str) -> list[Task]:
    n = cfg.game_pool if split == "train" else cfg.eval_pool
    cats = _categories(cfg)
    by_cat = {c: [s for s in _scenes(split) if _eligible(c, s)] for c in cats}
    empty = [c for c, s in by_cat.items() if not s]
    if empty:
        raise RuntimeError(f"no shipped ALFRED {split} scene can host ALFWorld task types {empty}")
    tasks: list[Task] = []
    for i in range(n):
        cat = cats[i % len(cats)]
        seed = f"{cfg.seed}-{split}-{i}"
        scene = random.Random(seed).choice(by_cat[cat])
        spec = {"source": "generated", "scene": scene, "category": cat, "seed": seed, "split": split}
        game, path, desc = _build(spec)
        task_id = f"alfworld-{split}-{cat}-{i}-FloorPlan{scene}"
        if ctx.cache_dir is not None:
            f = Path(ctx.cache_dir) / "alfworld" / generator_key() / split / f"{task_id}.tw-pddl"
            if not f.is_file():
                _write_atomic(f, game)
        tasks.append(Task(task_id=task_id, category=cat, spec=spec, skill_key=cat, gold_path=path, objective=desc))
    return tasks


_TASK_LINE = re.compile(r'Your task is to: ([^"\n]*?)\.?"')


def _data_root(cfg: EnvSection) -> Path:
    root = Path(os.path.expanduser(str(cfg.alfworld.data_dir)))
    if (root / "json_2.1.1").is_dir():
        root = root / "json_2.1.1"
    if not root.is_dir():
        raise FileNotFoundError(f"alfworld.data_dir {cfg.alfworld.data_dir!r} is not a directory")
    return root


def _data_tasks(cfg: EnvSection, split: str) -> list[Task]:
    root = _data_root(cfg)
    sub = "train" if split == "train" else cfg.alfworld.eval_split
    cats = set(_categories(cfg))
    found = []
    for game_file in sorted((root / sub).glob("*/*/game.tw-pddl")):
        task_dir = game_file.parent.parent.name
        cat = CATEGORY_OF.get(task_dir.split("-", 1)[0])
        if cat not in cats or "movable" in task_dir or "Sliced" in task_dir:
            continue
        found.append((game_file, cat))
    if not found:
        raise FileNotFoundError(f"no ALFWorld game files (*/*/game.tw-pddl) for {sorted(cats)} under {root / sub}")
    random.Random(f"{cfg.seed}-{sub}").shuffle(found)
    n = cfg.game_pool if split == "train" else cfg.eval_pool
    tasks = []
    for game_file, cat in found:
        if len(tasks) == n:
            break
        data = _read_game(game_file)
        if data.get("solvable") is False:
            continue
        rel = game_file.relative_to(root).as_posix()
        m = _TASK_LINE.search(str(data.get("grammar", "")))
        tasks.append(Task(
            task_id=f"alfworld:{rel.rsplit('/', 1)[0]}", category=cat, skill_key=cat,
            spec={"source": "data", "game": rel}, gold_path=[str(a) for a in data.get("walkthrough") or []],
            objective=m.group(1) if m else "",
        ))
    if len(tasks) < n:
        pool = "game_pool" if split == "train" else "eval_pool"
        raise ValueError(f"{pool}={n} but {root / sub} holds only {len(tasks)} solvable ALFWorld games of "
                         f"{sorted(cats)}; lower {pool} or add game files")
    return tasks


def _read_game(game_file: Path) -> dict:
    # One game.tw-pddl (a JSON object); ValueError naming the file when it is not one.
    try:
        data = json.loads(game_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"ALFWorld game file {game_file} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(data), "null")
        raise ValueError(f"ALFWorld game file {game_file} holds {kind}, not a JSON object")
    return data


def make_tasks(cfg: EnvSection, ctx: EnvContext, split: str) -> list[Task]:
    """The ALFWorld task pool of `split` ("train": cfg.game_pool tasks, "eval": cfg.eval_pool).

    Without `cfg.alfworld.data_dir`: tasks generated from the shipped layouts,
    categories round-robin over `cfg.alfworld.task_types`, train tasks in ALFRED
    train scenes and eval tasks in its test scenes; deterministic in cfg.seed.
    With it: that many real game files of train/ or `eval_split`/, a
    deterministic shuffle (cfg.seed) of those whose category is selected.
    Raises ValueError (bad split / task types; with data_dir: a broken game file,
    naming it, or fewer solvable games than the pool asks), FileNotFoundError (data dir).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if cfg.alfworld.data_dir:
        return _data_tasks(cfg, split)
    return _generated_tasks(cfg, ctx, split)


# ---------------------------------------------------------------------------
# The environment


def _clean(text: str) -> str:
    """Drop the welcome banner, keep the room and the task line; collapse blank lines."""
    text = text.replace("-= Welcome to TextWorld, ALFRED! =-", "")
    lines = [" ".join(line.split()) for line in text.replace("\r", "").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _normalize(action: str) -> str:
    flat = " ".join(str(action).split())[:MAX_ACTION_CHARS]
    return flat.lower().rstrip(".").strip()


# Engines (PddlEnv) released by closed envs, reused by the next ones. Each PddlEnv holds a private
# copy of fast-downward's 34 MB library that cannot be unloaded safely, so a process keeps at most
# as many as it ever ran at once.
_FREE_ENGINES: list[Any] = []
_FREE_LOCK = threading.Lock()


def _engine() -> Any:
    with _FREE_LOCK:
        if _FREE_ENGINES:
            return _FREE_ENGINES.pop()
    import textworld
    from textworld.envs import PddlEnv

    return PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True))


class AlfWorldEnv(ClosingEnv):
    """One ALFWorld game on the real engine (PddlEnv + AlfredDemangler). Call close() when done."""

    def __init__(self, task: Task, game: dict[str, Any] | str, max_observation_chars: int = 2000) -> None:
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

        self.task = task
        self.max_chars = max_observation_chars
        self._pddl = _engine()
        self._env = AlfredDemangler(self._pddl, shuffle=False)
        try:
            self._env.load(game)
        except Exception:
            self.close()
            raise
        self._admissible: list[str] = []
        self._done = True  # until reset()
        self._moves: list[str] = []

    def _step(self, state: Any, invalid: bool = False) -> EnvStep:
        won = bool(state.get("won"))
        self._done = won
        self._admissible = list(state.get("admissible_commands") or [])
        gold = self.task.gold_path
        on_path = self._moves == gold[: len(self._moves)]
        return EnvStep(
            observation=cap(_clean(state.feedback or ""), self.max_chars),
            admissible_commands=list(self._admissible),
            won=won, lost=False, done=won, score=1.0 if won else 0.0,
            policy_commands=list(gold[len(self._moves):]) if on_path and not won else [],
            invalid_action=invalid,
            info={"category": self.task.category},
        )

    @one_at_a_time
    def reset(self) -> EnvStep:
        """Start (or restart) the game: the room description and "Your task is to: ..."."""
        if self._env is None:
            raise RuntimeError("AlfWorldEnv is closed")
        self._moves = []
        return self._step(self._env.reset())

    @one_at_a_time
    def step(self, action: str) -> EnvStep:
        """Play one command (any text; matched to the admissible commands after lower-casing and
        collapsing whitespace). Raises RuntimeError after the end or before reset()."""
        if self._done or self._env is None:
            raise RuntimeError("AlfWorldEnv.step called on a finished (or not yet reset) episode")
        cmd = _normalize(action)
        invalid = cmd not in self._admissible
        state, _, _ = self._env.step(cmd)  # not admissible: the engine answers "Nothing happens."
        self._moves.append(cmd)
        return self._step(state, invalid)

    def close(self) -> None:
        """Hand the engine back for reuse by the next env of this process; safe to call twice."""
        self._env = None
        pddl, self._pddl = getattr(self, "_pddl", None), None
        if pddl is not None:
            with _FREE_LOCK:
                _FREE_ENGINES.append(pddl)


@one_at_a_time
def open_env(task: Task, cfg: EnvSection, ctx: EnvContext) -> AlfWorldEnv:
    """An env for `task` on this machine: a generated task is rebuilt from its spec (cache not needed);
    a data task is read from this machine's `cfg.alfworld.data_dir`. FileNotFoundError / ValueError
    for a task this machine cannot open."""
    source = task.spec.get("source")
    if source == "data":
        if not cfg.alfworld.data_dir:
            raise ValueError(f"task {task.task_id} comes from ALFWorld data files but alfworld.data_dir is unset")
        rel = str(task.spec["game"])
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"bad ALFWorld game path {rel!r}")
        game: dict[str, Any] | str = str(_data_root(cfg) / rel)
        if not Path(game).is_file():
            raise FileNotFoundError(f"ALFWorld game file not found: {game}")
    elif source == "generated":
        game, _, _ = _build(task.spec)
    else:
        raise ValueError(f"task {task.task_id} has no ALFWorld source (spec.source={source!r})")
    return AlfWorldEnv(task, game, cfg.max_observation_chars)


def write_game(task: Task, path: Path) -> Path:
    """Write a generated task's game file (ALFWorld's game.tw-pddl JSON) to `path`; returns it."""
    if task.spec.get("source") != "generated":
        raise ValueError("only generated tasks can be written")
    game, _, _ = _build(task.spec)
    _write_atomic(Path(path), game)
    return Path(path)
