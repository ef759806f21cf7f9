"""Configuration of a rollout instance."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field

from rlmesh.config import ServerConfig, StrictModel


class EngineConfig(StrictModel):
    kind: Literal["torch"] = "torch"
    """Inference backend; the torch engine runs HF-format models on CPU."""
    model_dir: str
    """Local HF-format model folder (config.json, model.safetensors, tokenizer.json)."""
    max_batch_size: int = Field(default=256, ge=1)
    seed: int = 0
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads; tiny models decode faster with one thread per process."""


class TransferConfig(StrictModel):
    mooncake: bool = True
    """Offer a Mooncake transfer-engine endpoint for weight pushes (the gRPC stream is always offered)."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"


class RolloutConfig(StrictModel):
    server: ServerConfig = ServerConfig()
    instance_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    manager_address: str = "127.0.0.1:50151"
    engine: EngineConfig
    transfer: TransferConfig = TransferConfig()
    register_timeout_seconds: float = Field(default=60.0, gt=0)
    """How long to keep trying to reach the manager at start."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
