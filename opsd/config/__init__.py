"""One typed run config with a section per role, loaded from YAML (configs/*.yaml).

Unknown keys are errors (a typo must not silently fall back to a default), and
so are NaN and infinite floats (YAML `.nan`/`.inf`, JSON `NaN`/`Infinity`): no
hyper-parameter has a meaningful non-finite value, and one would surface as
NaN advantages or weights mid-run. A boolean where a number belongs is refused too
(`kl_coef: true` would be 1.0; `stop_token_ids: [true]` would be [1]), and so is a YAML mapping that repeats a key (a
second `trainer:` block would silently replace the first).
"""

from __future__ import annotations

# The sections live in submodules by topic (base.py: what every section shares); every public name is
# imported here, so `from opsd.config import X` is the one import path.
from opsd.config.credit import (
    ALIGNOPSD_PROFILES, PROFILE_TRAINER, AgentOPSDSection, AlignSection, CreditSection, ExOPDSection, FiReOPDSection,
    GCOPDSection, PowerOPDSection, SDARSection, UniOPDSection,
)
from opsd.config.env import (
    ENV_NAMES, EVIDENCE_CHARS_PER_TOKEN, AlfWorldSection, EnvSection, EvidenceSection, ReasoningGymSection,
    ScienceWorldSection, SearchSection, TWXSection, WebShopSection, evidence_observation_chars,
)
from opsd.config.hashing import (
    ADDED_FIELDS, ADDED_MODEL_FIELDS, RESUMABLE_FIELDS, UNHASHED_SECTIONS, config_hash, hashed_config,
)
from opsd.config.loading import MAX_CONFIG_VALUES, read_yaml
from opsd.config.model import ModelSection, Revision, VLLMSection
from opsd.config.roles import EmbedderSection, RolloutSection, TeacherSection
from opsd.config.run import (
    EvalSection, MlflowSection, ProbesSection, RedisSection, RunSection, SimulateSection, TensorBoardSection,
    TrackingSection, WandbSection, WeightsSection, base_url,
)
from opsd.config.run_config import CREDIT_METHODS, REDIS_RETRY_WAIT_MAX_S, RunConfig
from opsd.config.trainer import FOREIGN_TRAINER_KEYS, KL_ESTIMATOR_NAMES, LoRASection, TrainerSection
