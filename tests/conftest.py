"""Shared fixtures: a composed config (Hydra compose API, no CLI) pointed at a temporary cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose_config(overrides: list[str], tmp_path: Path):
    """Compose conf/config.yaml with overrides; paths point into tmp_path (no Hydra run dir needed)."""
    from hydra import compose, initialize_config_dir  # imported here: GPU-only runs need no Hydra
    from hydra.core.global_hydra import GlobalHydra

    from tracekit.cli import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"paths.root_dir={tmp_path}",
                f"paths.cache_dir={tmp_path}/cache",
                f"paths.run_dir={tmp_path}/run",
                "logger=none",
                *overrides,
            ],
        )
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture
def make_cfg(tmp_path):
    def _make(*overrides: str):
        return compose_config(list(overrides), tmp_path)

    return _make


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models are latency-bound: torch's thread pool only adds overhead (and thrashes on 2 busy cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
