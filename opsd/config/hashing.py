"""A run's identity: the config hash a checkpoint is resumed under, without what may change on resume."""

from __future__ import annotations

import hashlib
import json


# What may change when a run resumes (or between the roles of one run); everything else is the run's identity.
RESUMABLE_FIELDS = (
    ("run", "steps"), ("run", "output_dir"), ("run", "step_timeout_s"), ("run", "max_restarts"),
    ("redis", "url"), ("redis", "block_ms"), ("redis", "reclaim_idle_ms"), ("redis", "max_deliveries"),
    ("redis", "max_stream_lag"), ("teacher", "embedder_timeout_s"), ("teacher", "embedder_deadline_s"),
    ("trainer", "dump_credit"), ("trainer", "data_parallel"), ("trainer", "nproc_per_node"), ("trainer", "snapshot_every"),
    ("trainer", "keep_optimizer_state"), ("credit", "diagnostic_prompt_buckets"),  # what is reported, not what is trained
    ("trainer", "gradient_checkpointing"),  # memory, not what is trained
    ("trainer", "checkpoint_every"), ("trainer", "keep_checkpoints"),  # resume points, not what is trained
    ("run", "report_to"),  # where the run is reported
)
# Fields added after runs already existed: at their defaults they are left out of the hash, so a
# checkpoint written before they existed still resumes.
ADDED_FIELDS = (
    ("model", "device"), ("model", "vllm"), ("trainer", "lora"), ("env", "eval_pool"), ("env", "privileged"),
    ("env", "twx"), ("env", "scienceworld"), ("env", "alfworld"), ("env", "search"), ("env", "webshop"),
    ("env", "reasoning_gym"), ("embedder", "device"), ("env", "evidence"), ("embedder", "trust_remote_code"),
    ("trainer", "kl_coef"), ("trainer", "kl_estimator"), ("trainer", "loss_agg"), ("trainer", "loss_agg_norm_tokens"),
    ("trainer", "importance_level"), ("trainer", "tis_cap_low"), ("trainer", "tis_level"), ("trainer", "tis_mode"),
    ("credit", "grpo_singleton"),
)
# ModelSection fields added after runs already existed, in `model:` and an external teacher's `teacher.model:`
# alike: at their defaults they are left out of the hash.
ADDED_MODEL_FIELDS = ("revision", "trust_remote_code", "stop_token_ids", "chat_template", "chat_template_kwargs")
# Sections that never change what a run trains (dropped from the hash whole).
UNHASHED_SECTIONS = ("eval", "simulate", "weights", "probes", "tracking")


def hashed_config(cfg) -> dict:
    """The resolved config (a RunConfig) as JSON data, without RESUMABLE_FIELDS, ADDED_FIELDS and ADDED_MODEL_FIELDS at
    their defaults and any section's metrics_port."""
    data = cfg.model_dump(mode="json")
    for section in UNHASHED_SECTIONS:
        data.pop(section, None)
    for section, name in RESUMABLE_FIELDS:
        data[section].pop(name, None)
    defaults = type(cfg)().model_dump(mode="json")
    for section, name in ADDED_FIELDS:
        if data[section].get(name) == defaults[section][name]:
            data[section].pop(name, None)
    for model in (data["model"], data["teacher"].get("model")):
        for name in ADDED_MODEL_FIELDS:
            if model is not None and model.get(name) == defaults["model"][name]:
                model.pop(name, None)
    for section in data.values():
        if isinstance(section, dict):
            section.pop("metrics_port", None)
    return data


def config_hash(hashed: dict) -> str:
    """sha256 (hex) of a `hashed_config(cfg)` serialized with sorted keys: equal for configs a run may resume under."""
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()
