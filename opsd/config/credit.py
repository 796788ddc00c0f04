"""`credit:`: the credit-assignment method's sections and the released launchers' profiles (`credit.profile`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opsd.config.base import _Section


class AlignSection(_Section):
    """AlignOPSD hyper-parameters (spec 4.1-4.5); defaults = alfworld-3b profile."""

    similarity_threshold: float = Field(0.65, ge=-1, lt=1)  # gamma_H (a cosine; (H - gamma)/(1 - gamma) needs < 1)
    top_k: int = Field(2, ge=1)
    source_rollout_cap: int = Field(1, ge=1)
    aggregation_temperature: float = Field(0.10, gt=0)
    aggregation_mode: Literal["probability_mixture", "log_mean"] = "probability_mixture"
    alpha_max: float = Field(0.8, ge=0, le=1)
    action_filter_enabled: bool = True
    action_filter_threshold: float = Field(0.80, ge=-1, le=1)
    webshop_symbolic_checks: bool = False
    profile_temperature: float = Field(0.10, gt=0)
    segmentation_quantile: float = Field(0.80, ge=0, le=1)
    segmentation_threshold_min: float = Field(0.01, ge=0, le=1)  # a JSD in [0, 1]
    segmentation_threshold_max: float = Field(0.10, ge=0, le=1)
    min_segment_turns: int = Field(2, ge=1)
    max_segment_turns: int = Field(8, ge=1)
    credit_temperature: float = Field(0.5, gt=0)  # T
    mixing_coefficient: float = Field(0.5, ge=0, le=1)  # eta
    density_upper_bound: float = Field(4.0, ge=1)  # d_max; the box [0, d_max] must hold the mean density 1
    weighting_mode: Literal["legacy", "bounded"] = "legacy"
    multiplier_band: float = Field(0.2, ge=0, lt=1)
    # Ablations (spec 4.4): A no_rectification (alpha_max = 0), B token_level allocation,
    # C turn_level allocation without spans, D random_spans (seeded by ablation_seed).
    ablation: Literal["none", "no_rectification", "token_level", "turn_level", "random_spans"] = "none"
    ablation_seed: int = 0

    @model_validator(mode="after")
    def _spans(self) -> "AlignSection":
        if self.max_segment_turns < 2 * self.min_segment_turns - 1:
            raise ValueError("alignopsd: max_segment_turns must be >= 2*min_segment_turns - 1")
        if self.segmentation_threshold_min > self.segmentation_threshold_max:
            raise ValueError("alignopsd: segmentation_threshold_min must be <= segmentation_threshold_max")
        return self


class AgentOPSDSection(_Section):
    """AgentOPSD recursive belief revision (spec 2).

    variant "paper" (default): gamma 0.95, B_0 = clip(success rate S/G), A_seq
    from credit.grpo_scope. variant "reference" (released code): gamma 1.0,
    B_0 = mean first-row reward clipped, A_seq from the turn scope.
    """

    variant: Literal["paper", "reference"] = "paper"
    granularity: Literal["turn", "token"] = "turn"
    gamma: float | None = Field(None, gt=0, le=1)  # None: 0.95 (paper) / 1.0 (reference)
    mult_lambda: float = Field(0.5, ge=0, le=1)  # lambda
    mult_band: float = Field(0.2, ge=0, lt=1)  # b
    eps: float = Field(1e-6, gt=0, le=0.1)

    @property
    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return 0.95 if self.variant == "paper" else 1.0


class GCOPDSection(_Section):
    """GC-OPD group-calibrated residual + RACA (spec 3); a trajectory is one response."""

    residual_beta: float = Field(0.10, ge=-100, le=100)  # beta; 0 = vanilla OPD, < 0 the paper's negative-RACA ablation
    credit_mode: Literal["raca", "uniform", "teacher_abs", "relative_teacher_support", "relative_opd_leverage"] = "raca"
    credit_cap: float = Field(5.0, ge=1, le=1e6)  # c_max (>= 1: the neutral credit 1 must fit)
    min_group_std: float = Field(1e-6, ge=0)  # tau_G
    min_token_std: float = Field(1e-6, ge=0)  # tau_T
    adv_clip: float = Field(10.0, ge=0, le=1e6)  # a_max; 0 disables clipping


class UniOPDSection(_Section):
    margin_delta: float = Field(0.4, ge=0, le=100)  # delta (nats)
    max_logprob_diff: float = Field(10.0, gt=0, le=1e6)  # tokens with |current - teacher| >= this get advantage 0


class PowerOPDSection(_Section):
    alpha: float = Field(100.0, ge=1e-3, le=1e4)


class ExOPDSection(_Section):
    lam: float = Field(1.25, ge=-10, le=10)  # target = lam * teacher + (1 - lam) * base
    base: Literal["initial", "old"] = "initial"  # base log-probs: the initial policy's, or pi_old's


class FiReOPDSection(_Section):
    skip_percentile: float = Field(20.0, ge=0, le=100)  # rows below this percentile of mean teacher log-prob are dropped
    entropy_alpha: float = Field(1.0, ge=0)
    entropy_beta: float = Field(1.0, ge=0)


class SDARSection(_Section):
    """SDAR auxiliary loss (ALFWorld-3B profile): coef * token-mean(sigmoid(beta (teacher - sg(student))) (teacher - log pi))."""

    coef: float = Field(0.0, ge=0, le=100)  # 0 = off
    beta: float = Field(5.0, gt=0, le=1e4)


# The released launchers (spec 4.5), applied under a config's own keys by `credit.profile`.
_ALIGN_COMMON = {"aggregation_temperature": 0.10, "profile_temperature": 0.10, "source_rollout_cap": 1}
ALIGNOPSD_PROFILES: dict[str, dict] = {
    "alfworld-3b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1, "sdar": {"coef": 0.01, "beta": 5.0},
        "alignopsd": {"similarity_threshold": 0.65, "top_k": 2, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": True, "webshop_symbolic_checks": False},
    },
    "alfworld-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "search-3b": {
        "grpo_scope": "trajectory", "invalid_action_penalty_coef": 0.01,
        "alignopsd": {"similarity_threshold": 0.70, "top_k": 3, "aggregation_mode": "log_mean", "alpha_max": 0.2,
                      "credit_temperature": 1.0, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "search-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.01,
        "alignopsd": {"similarity_threshold": 0.70, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
    "webshop-3b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 3, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.2, "action_filter_enabled": True, "webshop_symbolic_checks": True},
    },
    "webshop-7b": {
        "grpo_scope": "turn", "invalid_action_penalty_coef": 0.1,
        "alignopsd": {"similarity_threshold": 0.80, "top_k": 2, "aggregation_mode": "probability_mixture", "alpha_max": 0.8,
                      "credit_temperature": 0.5, "action_filter_enabled": False, "webshop_symbolic_checks": False},
    },
}
for _p in ALIGNOPSD_PROFILES.values():
    _p["alignopsd"] = {**_ALIGN_COMMON, **_p["alignopsd"]}
# What the same launchers set in the trainer (spec 5): the k3 KL to the reference, 0.01 (0.001 for Search), and the
# entropy bonus 0.001 of the AlignOPSD/AgentOPSD recipes. Applied under the config's own `trainer` keys.
PROFILE_TRAINER: dict[str, dict] = {
    name: {"kl_coef": 0.001 if name.startswith("search") else 0.01, "kl_estimator": "k3", "entropy_coef": 0.001}
    for name in ALIGNOPSD_PROFILES
}


def _under(preset: dict, own: dict) -> dict:
    """`own` over `preset`, recursively for sub-dicts (a config's explicit keys win)."""
    out = dict(preset)
    for k, v in own.items():
        out[k] = _under(preset[k], v) if isinstance(v, dict) and isinstance(preset.get(k), dict) else v
    return out


class CreditSection(_Section):
    # A named launcher profile (spec 4.5): its values apply under this section's own keys.
    profile: Literal["alfworld-3b", "alfworld-7b", "search-3b", "search-7b", "webshop-3b", "webshop-7b"] | None = None
    grpo_scope: Literal["trajectory", "turn"] = "turn"
    norm_adv_by_std: bool = True
    # A GRPO group of one row (opsd/credit/grpo.py): "zero" = advantage 0 (no sibling to compare), "reference" = the
    # released code's raw reward / (1 + 1e-6). null = the method's default ("zero"; agentopsd's reference variant
    # "reference").
    grpo_singleton: Literal["zero", "reference"] | None = None
    opd_coef: float = Field(1.0, ge=-100, le=100)  # grpo_opd: A = A_grpo + opd_coef * (teacher - student)
    use_invalid_action_penalty: bool = True
    invalid_action_penalty_coef: float = Field(0.1, ge=0)
    # A teacher worse than its student (opsd/credit/guard.py): per step, the share of groups whose teacher scores
    # the winning trajectories below the student is reported ("report"); "downweight" scales those groups'
    # teacher-student gap by teacher_guard_weight before credit, "skip" sets it to 0 (no distillation term).
    teacher_guard: Literal["report", "downweight", "skip"] = "report"
    teacher_guard_weight: float = Field(0.5, ge=0, le=1)
    # Teacher-verifier disagreement per prompt-length bucket (opsd/credit/diagnostics.py): bucket edges in tokens.
    diagnostic_prompt_buckets: list[int] = Field(default_factory=lambda: [1024, 2048, 4096, 8192])
    alignopsd: AlignSection = AlignSection()
    agentopsd: AgentOPSDSection = AgentOPSDSection()
    gc_opd: GCOPDSection = GCOPDSection()
    uni_opd: UniOPDSection = UniOPDSection()
    power_opd: PowerOPDSection = PowerOPDSection()
    ex_opd: ExOPDSection = ExOPDSection()
    fire_opd: FiReOPDSection = FiReOPDSection()
    sdar: SDARSection = SDARSection()

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data):
        if isinstance(data, dict) and isinstance(data.get("profile"), str) and data["profile"] in ALIGNOPSD_PROFILES:
            return _under(ALIGNOPSD_PROFILES[data["profile"]], data)
        return data

    @model_validator(mode="after")
    def _buckets(self) -> "CreditSection":
        b = self.diagnostic_prompt_buckets
        if len(b) > 16 or any(x <= 0 for x in b) or any(hi <= lo for lo, hi in zip(b, b[1:])):
            raise ValueError(f"credit.diagnostic_prompt_buckets must be at most 16 positive token counts in increasing "
                             f"order, got {b}")
        return self
