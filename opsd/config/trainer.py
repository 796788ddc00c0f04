"""`trainer:` (and `trainer.lora`): the PPO update, its loss settings, checkpoints and data parallelism."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from opsd.config.base import _Section


class LoRASection(_Section):
    """LoRA (opsd/lora.py): the trainer trains low-rank adapters on these modules, workers merge them.

    Each targeted weight W [out, in] becomes W + (alpha / r) * B @ A with A [r, in], B [out, r]
    (peft, B = 0 at start: version 0 is the base model). Only A and B train and are published.
    """

    r: int = Field(16, ge=1, le=4096)  # rank
    alpha: float = Field(32.0, gt=0)  # scale = alpha / r
    # Dropout on the adapter's input while training. 0 by default: with dropout the PPO ratio of
    # the first epoch is no longer 1 (the sampler and pi_old see the undropped model).
    dropout: float = Field(0.0, ge=0, lt=1)
    # Plain module names (the last part of a module path, e.g. q_proj); every nn.Linear of the
    # model with that name is adapted. Default: the attention and MLP projections of Llama-style models.
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )

    @model_validator(mode="after")
    def _plain_names(self) -> "LoRASection":
        bad = [t for t in self.target_modules if not t.isidentifier()]
        if bad:
            raise ValueError(f"lora.target_modules must be plain module names like q_proj, got {bad}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules repeats a name: {self.target_modules}")
        return self


# verl's and TRL's names for what opsd calls otherwise: a config written for them is told the opsd key to write.
FOREIGN_TRAINER_KEYS = {
    "use_kl_loss": "kl_coef (> 0 turns the KL term on)", "kl_loss_coef": "kl_coef", "beta": "kl_coef",
    "kl_loss_type": "kl_estimator (k1, k2, k3 = low_var_kl)", "loss_agg_mode": "loss_agg",
    "loss_type": "loss_agg (TRL grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm, dapo = token-mean)",
    "importance_sampling_level": "importance_level", "entropy_coeff": "entropy_coef",
    "clip_ratio": "clip_ratio_low and clip_ratio_high", "epsilon": "clip_ratio_low", "epsilon_high": "clip_ratio_high",
    "num_iterations": "ppo_epochs", "max_grad_norm": "grad_clip", "learning_rate": "lr",
    "rollout_is": "truncated_is: true and tis_level", "rollout_is_threshold": "tis_cap",
    "vllm_importance_sampling_correction": "truncated_is", "vllm_importance_sampling_mode": "tis_level and tis_mode",
    "vllm_importance_sampling_clip_max": "tis_cap", "vllm_importance_sampling_clip_min": "tis_cap_low",
}
KL_ESTIMATOR_NAMES = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}  # verl's names of the same estimators


class TrainerSection(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    clip_ratio_low: float = Field(0.2, gt=0)
    clip_ratio_high: float = Field(0.2, gt=0)
    # Dual-clip constant c (spec 5): a negative advantage's loss is capped at -A c. null = plain clipped PPO.
    clip_ratio_c: float | None = Field(3.0, gt=1)
    entropy_coef: float = Field(0.001, ge=0)
    # KL to the reference policy (the run's initial policy, frozen; services/trainer/reference.py), added to each
    # loss token as kl_coef * estimator (spec 5: k3, coef 0.01; 0.001 for Search). 0 = off: no reference is held.
    kl_coef: float = Field(0.0, ge=0, le=100)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k3 = verl's low_var_kl (clamped); k1 = log-ratio; k2 = half its square
    # How the per-token loss becomes the mini-batch's loss (opsd.credit.policy_loss.ppo_loss): token-mean (spec 5),
    # seq-mean-token-mean (TRL grpo), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: / (sequences x
    # loss_agg_norm_tokens)). Over the whole mini-batch, never per micro-batch, in every mode.
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    # Dr. GRPO's constant; null = the run's response budget per trajectory: env.max_turns x rollout.max_new_tokens.
    loss_agg_norm_tokens: int | None = Field(None, ge=1)
    # "sequence" = GSPO: one ratio per trajectory, exp(mean over its loss tokens of (log pi - log pi_old)).
    importance_level: Literal["token", "sequence"] = "token"
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(2, ge=1)  # trajectories per forward/backward
    threads: int = Field(0, ge=0)  # torch threads for the trainer (0 = model.threads): it computes alone
    # Truncated importance sampling against the sampler (spec 5): each token's policy-gradient
    # term is weighted by min(exp(clip(old - sampler, -20, 20)), tis_cap).
    truncated_is: bool = False
    tis_cap: float = Field(5.0, gt=0)
    tis_cap_low: float | None = Field(None, ge=0)  # a lower bound too (null = none)
    # token: one weight per token; sequence: exp(sum over the trajectory's loss tokens of (old - sampler)) for all of
    # them. truncate: the weight is clamped to [tis_cap_low, tis_cap]; mask: outside it the weight is 0 (TRL's
    # *_mask modes: at sequence level the whole trajectory drops out of the policy-gradient term).
    tis_level: Literal["token", "sequence"] = "token"
    tis_mode: Literal["truncate", "mask"] = "truncate"
    # Steps between checkpoints (the resume point; the last step always saves). "auto": every step below 1e9
    # parameters, every 10 steps from 1e9 (opsd.footprint.checkpoint_interval: a 7B fp32 + AdamW checkpoint
    # is ~91 GB, written in the background while the next step's groups are awaited).
    checkpoint_every: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # Complete checkpoints kept: the newest in <run_dir>/checkpoint/, older ones as checkpoint-<step:05d>/.
    keep_checkpoints: int = Field(1, ge=1)
    # A finished run's checkpoint/ keeps the optimizer state (AdamW: twice the model, 1.1 GB for SmolLM2 fp32)
    # so it can be resumed with more run.steps; false drops it once the run is DONE (the policy stays, for
    # `opsd eval` and as a teacher or a new run's model) and such a run can no longer be resumed.
    keep_optimizer_state: bool = True
    # Keep the published weights of every Nth policy version in <run_dir>/snapshots/ (version 0 too when it is
    # published: run.max_staleness >= 1), for learning curves (benchmarks/learning.py evaluates them);
    # 0 = keep none. ~540 MB each for SmolLM2 fp32.
    snapshot_every: int = Field(0, ge=0)
    dump_credit: bool = False  # write each step's credit inputs to <run_dir>/credit/ (replay: opsd credit check)
    # LoRA (opsd/lora.py): None = full fine-tuning; set = train and publish adapters only.
    lora: LoRASection | None = None
    metrics_port: int = 0
    # Under torchrun with several ranks (services/trainer/distributed.py): "auto" = FSDP2 (sharded) on CUDA,
    # DDP (replicated) on CPU; "fsdp2" / "ddp" force one. Ignored by a single process.
    data_parallel: Literal["auto", "fsdp2", "ddp"] = "auto"
    # `opsd run` starts the trainer as `torchrun --nproc-per-node N` when N > 1 (one rank per GPU).
    nproc_per_node: int = Field(1, ge=1, le=64)
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    # non-reentrant gradient checkpointing): less activation memory for about one more forward pass of compute.
    # Changes memory and time, not what is trained.
    gradient_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _foreign_keys(cls, data):
        if isinstance(data, dict):
            named = [f"trainer.{k} is not opsd's: write trainer.{FOREIGN_TRAINER_KEYS[k]}" for k in data
                     if k in FOREIGN_TRAINER_KEYS]
            if named:
                raise ValueError("; ".join(named) + " (docs/policy-loss.md)")
        return data

    @field_validator("kl_estimator", mode="before")
    @classmethod
    def _kl_estimator_name(cls, value):
        return KL_ESTIMATOR_NAMES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _loss_settings(self) -> "TrainerSection":
        if self.tis_cap_low is not None and self.tis_cap_low >= self.tis_cap:
            raise ValueError(f"trainer.tis_cap_low ({self.tis_cap_low:g}) must be below trainer.tis_cap ({self.tis_cap:g})")
        # A setting that would change nothing is refused, not ignored: the run would not be the one the config says.
        # importance_level and the dual clip act from the second epoch: the first one's pi_old is its own forward pass,
        # so every ratio is exactly 1 (one optimizer step per epoch over the whole step; no mini-batch split).
        off_policy = self.ppo_epochs > 1
        idle = [k for k, on, default in (
            ("tis_level", self.truncated_is, "token"), ("tis_mode", self.truncated_is, "truncate"),
            ("tis_cap", self.truncated_is, 5.0), ("tis_cap_low", self.truncated_is, None),
            ("kl_estimator", self.kl_coef > 0, "k3"),
            ("loss_agg_norm_tokens", self.loss_agg == "seq-mean-token-sum-norm", None),
            ("importance_level", off_policy, "token"), ("clip_ratio_c", off_policy, 3.0),
        ) if not on and getattr(self, k) != default]
        if idle:
            raise ValueError(f"trainer.{', trainer.'.join(idle)} set without effect: tis_* need truncated_is: true, "
                             "kl_estimator needs kl_coef > 0, loss_agg_norm_tokens needs loss_agg: seq-mean-token-sum-norm, "
                             "importance_level and clip_ratio_c need ppo_epochs > 1 (the first epoch's ratio is exactly 1)")
        return self
