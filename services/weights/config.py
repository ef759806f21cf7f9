"""Configuration of the weights service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerConfig, StrictModel
from rlmesh.transfer.codecs import CompressionMode


class WeightsConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=50152, max_message_mb=64)
    manager_address: str = "127.0.0.1:50151"
    backend: Literal["tcp", "mooncake", "grpc"] = "tcp"
    """Data plane for pushes: a plain TCP connection per tensor-parallel rank (TCP links), the
    Mooncake transfer engine (RDMA links; raw bytes only), or a gRPC stream (no data port reachable)."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    compression: CompressionMode = "none"
    """Default link compression: none, zstd (lossless, byte planes), delta (against the version the
    instance holds: the changed elements when few changed, else XOR + zstd; lossless), int8 / fp8
    (lossy; only to engines serving quantized weights)."""
    link_compression: dict[str, CompressionMode] = {}
    """Per-instance override of `compression`, by instance id."""
    delta_full_every: int = Field(default=8, ge=1)
    """On delta links, at least every this many pushes is a full version (bounds a delta chain)."""
    poll_interval_seconds: float = Field(default=0.5, gt=0)
    """How often the instance list is read from the manager to find instances behind the latest version."""
    push_timeout_seconds: float = Field(default=120.0, gt=0)
    retry_backoff_seconds: float = Field(default=1.0, ge=0)
    """Wait after a failed push before the same instance is tried again (doubles per failure, max 30 s)."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    background_priority: bool = True
    """Run at the lowest CPU priority (nice 19 for the whole process, idle-class sending threads):
    on a host shared with training or generation, moving weights takes only the CPU they leave."""
    max_version_gb: float = Field(default=64.0, gt=0)
    """Largest weight version accepted; a bigger manifest is refused before anything is allocated."""

    def link_mode(self, instance_id: str) -> CompressionMode:
        return self.link_compression.get(instance_id, self.compression)

    @model_validator(mode="after")
    def _mooncake_sends_raw(self) -> "WeightsConfig":
        modes = {self.compression, *self.link_compression.values()}
        if self.backend == "mooncake" and modes != {"none"}:
            raise ValueError("the mooncake backend writes raw bytes into registered memory: link compression needs backend tcp or grpc")
        return self
