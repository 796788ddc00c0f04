"""Credit estimators by name: `@register("name")` on an estimator, `get_estimator(name)` to run it.

The names a config may choose are opsd.config.CREDIT_METHODS (the config
validates run.method without importing the estimators); a name outside it is
refused here, so the two lists cannot drift apart.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from opsd.config import CREDIT_METHODS, CreditSection
from opsd.types import CreditBatch

# (advantages_ML, metrics): metrics are floats, or numpy arrays (per-item distributions, see compute_advantages)
Estimator = Callable[[CreditBatch, CreditSection], "tuple[np.ndarray, dict[str, float | np.ndarray]]"]
_REGISTRY: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator registering an estimator under `name`; ValueError if the name is taken or is not one of
    opsd.config.CREDIT_METHODS (the names a config may choose: add a new method there too)."""
    if name not in CREDIT_METHODS:
        raise ValueError(f"credit estimator {name!r} is not in opsd.config.CREDIT_METHODS")

    def deco(fn: Estimator) -> Estimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"credit estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def registered() -> list[str]:
    """Sorted names of all registered estimators."""
    return sorted(_REGISTRY)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown credit method {name!r}; registered: {', '.join(registered())}") from None
