"""Configuration of a rollout instance: the settings a job sets (`rlmesh/settings/rollout.py`) and
the wiring `rlmesh up` fills in from the mesh section."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerConfig
from rlmesh.models.tp_layout import ModelShape
from rlmesh.settings.rollout import EngineSettings, RolloutSettings, TransferSettings, VllmConfig
from services.rollout.synthetic_engine import SyntheticConfig

__all__ = ["EngineConfig", "RolloutConfig", "TransferConfig", "VllmConfig"]


class EngineConfig(EngineSettings):
    kind: Literal["torch", "vllm", "synthetic"] = "torch"
    """Inference backend: torch (HF models on CPU, the default), vllm (its async engine; needs the
    vLLM virtualenv) or synthetic (benchmarks only: timed tokens, no model)."""
    model_dir: str = ""
    """Local HF-format model folder (config.json, model.safetensors, tokenizer.json); optional for
    the synthetic engine, which then has no parameters to check weight pushes against."""
    max_batch_size: int = Field(default=256, ge=1)
    stream_interval: int = Field(default=1, ge=1)
    """Torch engine: tokens per chunk streamed back (a request's last chunk may be shorter), as
    vLLM's stream_interval. Fewer, larger messages cost the manager and this process less CPU per
    token; a request whose instance dies regenerates up to stream_interval - 1 unsent tokens. The
    synthetic engine has its own (`synthetic.stream_interval`)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Torch engine: where the weights, the KV cache and sampling live. `cuda`: one GPU (the current
    CUDA device; tensor_parallel_size 1); pushes land in pinned host memory and are copied to the
    GPU bucket by bucket into the standby copy, which is switched to between two decode steps."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Torch engine: the dtype of its weights and KV cache, which pushed versions must carry too
    (the trainer's weights_dtype); `auto`: the model folder's."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Processes the torch engine splits the model over (heads, MLP and vocabulary; gloo on this
    machine); rank 0 is the service process, the others are workers it starts."""
    update_mode: Literal["continue", "pause", "abort-continue"] = "continue"
    """What requests in flight do when a new weight version arrives: `continue` decoding while it
    loads and on it after the switch, their KV cache kept; `pause`: no decode step from the start of
    the push until its commit, then on with the KV cache kept; `abort-continue`: at the switch their
    KV cache is recomputed under the new version from their tokens so far. Every token records its
    version in every mode."""
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _model_for_real_engines(self) -> "EngineConfig":
        if self.kind != "synthetic" and not self.model_dir:
            raise ValueError(f"engine.model_dir is required for the {self.kind} engine")
        if self.device == "cuda" and self.kind != "torch":
            raise ValueError(f"engine.device applies to the torch engine, not {self.kind}")
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            raise ValueError("engine.device cuda runs one rank per instance: tensor_parallel_size must be 1")
        if self.tensor_parallel_size > 1:
            if self.kind != "torch":
                raise ValueError(f"engine.tensor_parallel_size: only the torch engine runs tensor-parallel, not {self.kind}")
            if (Path(self.model_dir) / "config.json").is_file():
                from transformers import AutoConfig

                from rlmesh.models.families import check_model_dir

                # An architecture without layout rules is named as such, not as a split that fails.
                check_model_dir(self.model_dir)
                try:
                    ModelShape.from_hf_config(AutoConfig.from_pretrained(self.model_dir)).check_tp(self.tensor_parallel_size)
                except ValueError as exc:
                    raise ValueError(f"engine.tensor_parallel_size: {exc}") from exc
        return self


class TransferConfig(TransferSettings):
    mooncake: bool = True
    """Offer a Mooncake transfer-engine endpoint per tensor-parallel rank for weight pushes (the gRPC stream is always offered)."""


class RolloutConfig(RolloutSettings):
    server: ServerConfig = ServerConfig()
    instance_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    manager_address: str = "127.0.0.1:50151"
    engine: EngineConfig
    transfer: TransferConfig = TransferConfig()
    registration_token: str = ""
    """Sent with every call to the manager as `authorization: Bearer <token>`: the manager's registration_token."""
