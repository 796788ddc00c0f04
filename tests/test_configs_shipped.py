"""Every config shipped in configs/ loads as `opsd run` loads it (a benchmark's config that drifted from the
schema would fail only hours into a measurement)."""

from pathlib import Path

import pytest

from opsd.cli import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_the_configs_folder_is_found():
    assert len(CONFIGS) >= 10 and any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.run.steps >= 1 and cfg.env.name
