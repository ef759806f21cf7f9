"""Configuration of the weights service: the settings a job sets (`rlmesh/settings/weights.py`)
and the wiring `rlmesh up` fills in (its socket, the manager's address, backend and compression)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from rlmesh.config import ServerConfig
from rlmesh.settings.weights import WeightsSettings
from rlmesh.transfer.codecs import CompressionMode


class WeightsConfig(WeightsSettings):
    server: ServerConfig = ServerConfig(port=50152, max_message_mb=64)
    manager_address: str = "127.0.0.1:50151"
    backend: Literal["tcp", "mooncake", "grpc"] = "tcp"
    """Data plane for pushes: a plain TCP connection per tensor-parallel rank (TCP links), the
    Mooncake transfer engine (RDMA links; raw bytes only), or a gRPC stream (no data port reachable)."""
    compression: CompressionMode = "none"
    """Default link compression: none, zstd (lossless, byte planes), delta (against the version the
    instance holds: the changed elements when few changed, else XOR + zstd; lossless), int8 / fp8
    (lossy; only to engines serving quantized weights)."""

    def link_mode(self, instance_id: str) -> CompressionMode:
        return self.link_compression.get(instance_id, self.compression)

    @model_validator(mode="after")
    def _mooncake_sends_raw(self) -> "WeightsConfig":
        modes = {self.compression, *self.link_compression.values()}
        if self.backend == "mooncake" and modes != {"none"}:
            raise ValueError("the mooncake backend writes raw bytes into registered memory: link compression needs backend tcp or grpc")
        return self
