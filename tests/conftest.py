"""Shared fixtures (a small model folder created once per session) and the suite's Hypothesis
settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
from services.trainer.distributed import RankInfo

torch.set_num_threads(1)

# No per-example deadline: on a busy 2-core machine one slow example (a GC pause, a tokenizer
# built) is timing, not a failed property.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's architecture with a short warm-up: enough for real forward passes."""
    return create_default_model(tmp_path_factory.mktemp("model"), TinyModelSpec(warmup_iterations=30))


@pytest.fixture(scope="module")
def rank():
    """A one-rank process group, as the trainer forms without torchrun."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield RankInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), control=None)
    if owned:
        dist.destroy_process_group()
