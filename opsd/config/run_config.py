"""`RunConfig`: the whole run config, a section per role, and the checks across sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import model_validator

from opsd.config.base import _Section
from opsd.config.credit import PROFILE_TRAINER, CreditSection, _under
from opsd.config.env import EnvSection
from opsd.config.loading import read_yaml
from opsd.config.model import ModelSection
from opsd.config.roles import EmbedderSection, RolloutSection, TeacherSection
from opsd.config.run import (
    EvalSection, ProbesSection, RedisSection, RunSection, SimulateSection, TrackingSection, WeightsSection,
)
from opsd.config.trainer import TrainerSection
from opsd.types import MAX_GROUP_TURNS


# The credit methods a run may name: opsd/credit registers one estimator under each and refuses any other name,
# so this module validates run.method without importing the estimators (which import this module).
CREDIT_METHODS = ("agentopsd", "alignopsd", "ex_opd", "fire_opd", "gc_opd", "grpo", "grpo_opd", "grpo_opsd", "opd",
                  "opsd", "power_opd", "uni_opd")
# The longest wait between two tries of a Redis command a role retries through an outage (the trainer's Backoff;
# opsd.service.retry_redis waits at most 10 s): liveness must not read that wait as a hang (ProbesSection).
REDIS_RETRY_WAIT_MAX_S = 30.0


class RunConfig(_Section):
    run: RunSection = RunSection()
    redis: RedisSection = RedisSection()
    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    teacher: TeacherSection = TeacherSection()
    embedder: EmbedderSection = EmbedderSection()
    credit: CreditSection = CreditSection()
    trainer: TrainerSection = TrainerSection()
    eval: EvalSection = EvalSection()
    simulate: SimulateSection = SimulateSection()
    weights: WeightsSection = WeightsSection()
    probes: ProbesSection = ProbesSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="before")
    @classmethod
    def _profile_trainer(cls, data):
        """The recipes' trainer coefficients under `trainer`'s own keys (a config's explicit keys win): gc_opd's
        entropy_coef 0 (spec 5), then `credit.profile`'s PROFILE_TRAINER."""
        if not isinstance(data, dict):
            return data

        def field(section: str, name: str):
            value = data.get(section)
            return value.get(name) if isinstance(value, dict) else getattr(value, name, None)

        trainer = data.get("trainer", {})
        if isinstance(trainer, TrainerSection):  # its explicitly set fields win, like a dict's keys
            trainer = trainer.model_dump(include=trainer.model_fields_set)
        if not isinstance(trainer, dict):
            return data
        if field("run", "method") == "gc_opd":
            trainer = _under({"entropy_coef": 0.0}, trainer)
        if field("credit", "profile") in PROFILE_TRAINER:
            trainer = _under(PROFILE_TRAINER[field("credit", "profile")], trainer)
        return {**data, "trainer": trainer}

    def teacher_version(self, policy_version: int) -> int:
        """The policy version the teacher scores a group of `policy_version` with (teacher.version); 0 for an
        external teacher (its one frozen version)."""
        mode = self.teacher.version
        if self.teacher.source == "model" or mode == "frozen":
            return 0
        if mode.startswith("lag:"):
            return max(0, policy_version - int(mode[4:]))
        return policy_version

    def _self_teacher_arg(self, kind: str) -> str | None:
        """The argument of teacher.version `<kind>:<arg>` when a self teacher runs with it, else None."""
        mode = self.teacher.version
        if self.needs_teacher and self.teacher.source == "self" and mode.startswith(f"{kind}:"):
            return mode[len(kind) + 1 :]
        return None

    @property
    def teacher_lag(self) -> int:
        """Versions the teacher may look back beyond a group's own (lag:K -> K, else 0): the trainer keeps their files."""
        return int(self._self_teacher_arg("lag") or 0)

    @property
    def teacher_ema(self) -> float | None:
        """The decay D of teacher.version ema:D for a run with a self teacher, else None (no average kept)."""
        decay = self._self_teacher_arg("ema")
        return None if decay is None else float(decay)

    @property
    def teacher_model(self) -> ModelSection:
        """The model the teacher role serves: teacher.model for an external teacher, else the policy's."""
        return self.teacher.model if self.teacher.source == "model" else self.model

    def groups_in_flight(self, role: Literal["rollout", "teacher"]) -> int:
        """How many groups a `role` worker holds at once: its section's max_groups_in_flight, or by default 1
        on transformers (one group at a time, bit-reproducible) and several on vLLM (rollout 16, teacher 8),
        whose async engine batches the requests of every group in flight."""
        value = getattr(self, role).max_groups_in_flight
        if value is not None:
            return value
        backend = (self.teacher_model if role == "teacher" else self.model).backend
        return {"rollout": 16, "teacher": 8}[role] if backend == "vllm" else 1

    @model_validator(mode="after")
    def _teacher_source(self) -> "RunConfig":
        t = self.teacher
        if t.source == "model" and t.model is None:
            raise ValueError("teacher.source: model needs a teacher.model section (at least its name: a packaged model, "
                             "a local HF directory or a run's final_model/ or checkpoint/)")
        if t.source == "self" and t.model is not None:
            raise ValueError("teacher.model is set but teacher.source is self (the live policy): set teacher.source: model "
                             "to score with that model, or drop teacher.model")
        if t.version.startswith("ema:") and self.trainer.lora is not None and self.needs_teacher:
            raise ValueError(f"teacher.version {t.version} averages the whole policy; with trainer.lora the trainer "
                             "publishes adapters only: use live, frozen or lag:K")
        if t.source == "model" and t.version.startswith(("lag:", "ema:")):
            raise ValueError(f"teacher.version {t.version} needs the live policy's versions (teacher.source: self); "
                             "an external teacher is frozen")
        # ema:0.0 (any number of zeros) averages nothing: it is the live policy under another spelling.
        live = t.version == "live" or (t.version.startswith("ema:") and float(t.version[4:]) == 0.0)
        if self.needs_teacher and t.source == "self" and live and self.env.privileged == "none":
            raise ValueError(f"env.privileged none with the live policy as teacher (teacher.version {t.version}): the "
                             "teacher would be the student "
                             "itself and every teacher-student gap 0; set teacher.source: model, or teacher.version "
                             "frozen, lag:K or ema:D, or give the teacher privileged context")
        if t.model is not None and t.model.cache_dir is None and self.model.cache_dir is not None:
            t.model = t.model.model_copy(update={"cache_dir": self.model.cache_dir})
        return self

    @model_validator(mode="after")
    def _quiet_loops_beat(self) -> "RunConfig":
        # The longest a healthy loop is silent outside a guard (ProbesSection): a blocking Redis read or a Redis
        # retry's wait. Twice that leaves room for a loaded machine.
        quiet = max(self.redis.block_ms / 1000, REDIS_RETRY_WAIT_MAX_S)
        if self.probes.beat_s < 2 * quiet:
            raise ValueError(f"probes.beat_s ({self.probes.beat_s:g}) must be at least {2 * quiet:g} s: twice the longest "
                             f"a healthy loop waits without a beat (redis.block_ms, the {REDIS_RETRY_WAIT_MAX_S:g} s Redis "
                             "retry wait), or a busy worker is restarted as hung")
        return self

    @model_validator(mode="after")
    def _wire_limits(self) -> "RunConfig":
        # What a step makes must pass the wire's checks (opsd.types), or the run fails mid-way with a WireError.
        for what, size in (("rollout.group_size", self.rollout.group_size), ("eval.episodes_per_task",
                                                                               self.eval.episodes_per_task)):
            turns = size * self.env.max_turns
            if turns > MAX_GROUP_TURNS:
                raise ValueError(f"{what} x env.max_turns = {turns} turns a group: at most {MAX_GROUP_TURNS} "
                                 f"(the wire's bound on a group's turns)")
        return self

    @model_validator(mode="after")
    def _known_method(self) -> "RunConfig":
        if self.run.method not in CREDIT_METHODS:
            raise ValueError(f"run.method {self.run.method!r} is not a credit method; known: {', '.join(CREDIT_METHODS)}")
        return self

    @model_validator(mode="after")
    def _distillation_temperature(self) -> "RunConfig":
        # The teacher scores at T = 1 and the gap subtracts the sampler's log-probs:
        # both must use one temperature convention (bad-input case 7).
        if self.needs_teacher and self.rollout.temperature != 1.0:
            raise ValueError(
                f"run.method={self.run.method} distills against sampler log-probs taken at the rollout temperature; "
                f"it must be 1.0 (got {self.rollout.temperature}); only method grpo may sample at another temperature"
            )
        return self

    @model_validator(mode="after")
    def _simulated_compute(self) -> "RunConfig":
        teacher = self.teacher.model
        if self.simulate.enabled and teacher is not None and (teacher.name != "tiny-random" or teacher.backend != "hf"):
            raise ValueError(f"simulate.enabled (simulated compute) runs only with a tiny-random hf teacher.model too "
                             f"(got {teacher.name!r} on {teacher.backend!r})")
        if self.simulate.enabled and (self.model.name != "tiny-random" or self.model.backend != "hf"):
            raise ValueError(
                f"simulate.enabled (simulated compute) runs only with model.name: tiny-random on the hf backend "
                f"(got model.name {self.model.name!r}, backend {self.model.backend!r}): it would add sleeps to a real model's compute"
            )
        return self

    @model_validator(mode="after")
    def _teacher_guard(self) -> "RunConfig":
        guard = self.credit.teacher_guard
        if not self.needs_teacher and guard != "report":
            # grpo has no teacher, so no gap to shrink: the setting would be silently without effect
            raise ValueError(f"credit.teacher_guard {guard} acts on a teacher's gap, and run.method "
                             f"{self.run.method} has no teacher: use report")
        weight_default = CreditSection.model_fields["teacher_guard_weight"].default
        # by value, not model_fields_set: a config dumped and read again (opsd run, --resume) sets every field
        if self.credit.teacher_guard_weight != weight_default and guard != "downweight":
            raise ValueError(f"credit.teacher_guard_weight is used only with credit.teacher_guard: downweight "
                             f"(got {guard}): remove it or set the guard to downweight")
        if self.run.method == "alignopsd" and self.credit.teacher_guard != "report":
            # Its corrected teacher mixes matched views in log space (spec 4.2), so a gap scaled after the teacher
            # would no longer be the rectification `opsd credit check` replays from the dumped views.
            raise ValueError(f"credit.teacher_guard {self.credit.teacher_guard} is not available for alignopsd "
                             "(its rectified teacher is nonlinear in the views): use report")
        return self

    @model_validator(mode="after")
    def _teacher_entropies(self) -> "RunConfig":
        if self.run.method == "fire_opd" and self.teacher_model.backend == "vllm":
            raise ValueError("run.method=fire_opd needs the teacher's entropies, which the vllm backend does not report: "
                             "serve the teacher with backend hf")
        return self

    @model_validator(mode="after")
    def _vllm_conventions(self) -> "RunConfig":
        # vLLM reports the sampled token's log-prob after top-p renormalization, and no entropies:
        # refuse what would silently break the sampler = trainer convention (bad-input case 6).
        if self.model.backend != "vllm":
            return self
        if self.rollout.top_p != 1.0:
            raise ValueError(
                f"model.backend=vllm reports nucleus-renormalized log-probs when rollout.top_p < 1 (got "
                f"{self.rollout.top_p}); the trainer recomputes log softmax(z/T) over the whole vocabulary: use top_p 1.0"
            )
        if not 0.01 <= self.rollout.temperature <= 2.0:  # vLLM clamps below 0.01 and refuses above 2
            raise ValueError(f"model.backend=vllm samples at temperatures in [0.01, 2] (got rollout.temperature "
                             f"{self.rollout.temperature})")
        return self

    @property
    def needs_teacher(self) -> bool:
        return self.run.method != "grpo"

    @property
    def cache_root(self) -> Path:
        """Where converted models and generated games are cached (shared by all roles)."""
        return Path(self.model.cache_dir or os.environ.get("OPSD_CACHE") or Path.home() / ".cache" / "opsd")

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        """Read a YAML file (`read_yaml`); raises FileNotFoundError, ValueError (an alias bomb, nesting too deep) or
        pydantic.ValidationError."""
        data = read_yaml(path) or {}
        return cls.model_validate(data)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
