"""Configuration of a rollout instance: the settings a job sets (`rlmesh/settings/rollout.py`) and
the wiring `rlmesh up` fills in (its socket and id, the manager's address, the model's folder and dtype)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerConfig
from rlmesh.models.tp_layout import ModelShape
from rlmesh.settings.rollout import EngineSettings, RolloutSettings, TransferSettings, VllmConfig

__all__ = ["EngineConfig", "RolloutConfig", "TransferConfig", "VllmConfig"]


class EngineConfig(EngineSettings):
    model_dir: str = ""
    """Local HF-format model folder (config.json, model.safetensors, tokenizer.json); optional for
    the synthetic engine, which then has no parameters to check weight pushes against."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Torch engine: the dtype of its weights and KV cache, which pushed versions must carry too
    (the trainer's weights_dtype); `auto`: the model folder's."""

    @model_validator(mode="after")
    def _model_for_real_engines(self) -> EngineConfig:
        if self.kind != "synthetic" and not self.model_dir:
            raise ValueError(f"engine.model_dir is required for the {self.kind} engine")
        if self.tensor_parallel_size > 1 and (Path(self.model_dir) / "config.json").is_file():
            from transformers import AutoConfig

            from rlmesh.models.families import check_model_dir

            # An architecture without layout rules is named as such, not as a split that fails.
            check_model_dir(self.model_dir)
            try:
                ModelShape.from_hf_config(AutoConfig.from_pretrained(self.model_dir)).check_tp(
                    self.tensor_parallel_size
                )
            except ValueError as exc:
                raise ValueError(f"engine.tensor_parallel_size: {exc}") from exc
        return self


class TransferConfig(TransferSettings):
    mooncake: bool = True
    """Offer a Mooncake transfer-engine endpoint per tensor-parallel rank for weight pushes (the gRPC
    stream is always offered)."""


class RolloutConfig(RolloutSettings):
    server: ServerConfig = ServerConfig()
    instance_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    manager_address: str = "127.0.0.1:50151"
    engine: EngineConfig
    transfer: TransferConfig = TransferConfig()
