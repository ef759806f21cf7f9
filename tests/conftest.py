"""Shared fixtures: a small model folder created once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's architecture with a short warm-up: enough for real forward passes."""
    return create_default_model(tmp_path_factory.mktemp("model"), TinyModelSpec(warmup_iterations=30))
