"""Configuration of the weights service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlmesh.config import ServerConfig, StrictModel


class WeightsConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=50152, max_message_mb=64)
    manager_address: str = "127.0.0.1:50151"
    backend: Literal["mooncake", "grpc"] = "mooncake"
    """Data plane for pushes: the Mooncake transfer engine, or a plain gRPC stream."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    poll_interval_seconds: float = Field(default=0.5, gt=0)
    """How often the instance list is read from the manager to find instances behind the latest version."""
    push_timeout_seconds: float = Field(default=120.0, gt=0)
    retry_backoff_seconds: float = Field(default=1.0, ge=0)
    """Wait after a failed push before the same instance is tried again (doubles per failure, max 30 s)."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    max_version_gb: float = Field(default=64.0, gt=0)
    """Largest weight version accepted; a bigger manifest is refused before anything is allocated."""
