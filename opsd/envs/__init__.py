"""Environment adapters, registered by name (EnvSection.name). The interface: `opsd/envs/base.py`.

Adapters are imported on first use: each pulls in its own package (textworld,
textworld_express, scienceworld, alfworld, reasoning_gym), and a role only
needs the one it plays.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from opsd.envs.base import ClosingEnv, Env, EnvContext, EnvPrompt, EnvStep, Retriever, Task, cap
from opsd.types import TaskGroup

ADAPTERS = {
    "textworld": "opsd.envs.textworld",
    "twx": "opsd.envs.twx",
    "scienceworld": "opsd.envs.scienceworld",
    "alfworld": "opsd.envs.alfworld",
    "search": "opsd.envs.search",
    "webshop": "opsd.envs.webshop",
    "reasoning_gym": "opsd.envs.reasoning_gym",
    "evidence": "opsd.envs.evidence",
}


def get_adapter(name: str) -> ModuleType:
    """The adapter module of env `name` (see opsd/envs/base.py for what it exposes).

    Raises ValueError for an unknown name, ImportError (naming the package)
    when the env's package is not installed.
    """
    if name not in ADAPTERS:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(ADAPTERS)}")
    return importlib.import_module(ADAPTERS[name])


def task_group(cfg, task: Task, *, group_id: str, step: int, policy_version: int, group_size: int) -> TaskGroup:
    """The TaskGroup that asks the rollout role to play `task` `group_size` times with policy `policy_version`.

    cfg: the RunConfig (env name, max_turns, privileged mode). The privileged
    info is the SkillBank's text for the task (`opsd.skills.privileged_text`).
    """
    from opsd.skills import privileged_text  # opsd.skills imports opsd.envs.base

    return TaskGroup(
        group_id=group_id,
        task_id=task.task_id,
        step=step,
        policy_version=policy_version,
        group_size=group_size,
        env=cfg.env.name,
        game=task.to_dict(),
        privileged_info=privileged_text(cfg.env.name, task, cfg.env.privileged),
        max_turns=cfg.env.max_turns,
        category=task.category,
    )


def local_context(cfg) -> EnvContext:
    """An EnvContext for playing `cfg.env` inside this process (`opsd eval`, tests): the cache, and for
    Search an in-process retriever over the configured corpus (no embedder service needed)."""
    retriever = None
    if cfg.env.name == "search":
        from opsd.envs.search import LocalRetriever
        from opsd.retrieval import corpus_for_config

        retriever = LocalRetriever(corpus_for_config(cfg), cfg.embedder.encoder, cache_dir=cfg.cache_root)
    return EnvContext(cache_dir=cfg.cache_root, retriever=retriever)


__all__ = ["ADAPTERS", "ClosingEnv", "Env", "EnvContext", "EnvPrompt", "EnvStep", "Retriever", "Task", "cap", "get_adapter", "local_context", "task_group"]
