"""opsd: train LLM agents with RL and on-policy self-distillation."""

import os

# Several role processes share few cores: OpenMP threads that spin while idle
# made generation up to 25x slower here. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
