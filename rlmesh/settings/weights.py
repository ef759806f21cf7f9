"""The weights service's settings a job sets (`[weights]`); `services/weights/config.py` adds the
wiring (its socket, the manager's address, and the backend and compression the mesh picks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlmesh.config import ServerSettings, StrictModel
from rlmesh.transfer.codecs import CompressionMode


class WeightsSettings(StrictModel):
    """How weight versions are pushed to rollout instances."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """The Mooncake transfer engine's protocol (backend mooncake)."""
    link_compression: dict[str, CompressionMode] = {}
    """Per-instance override of the mesh's compression, by instance id (`rollout-0`, ...)."""
    delta_full_every: int = Field(default=8, ge=1)
    """On delta links, at least every this many pushes is a full version (bounds a delta chain)."""
    poll_interval_seconds: float = Field(default=0.5, gt=0)
    """How often the instance list is read from the manager to find instances behind the latest version."""
    push_timeout_seconds: float = Field(default=120.0, gt=0)
    """Deadline of one push to one instance."""
    retry_backoff_seconds: float = Field(default=1.0, ge=0)
    """Wait after a failed push before the same instance is tried again (doubles per failure, max 30 s)."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    """Deadline of the service's other calls (to the manager, and a push's control calls)."""
    background_priority: bool = True
    """Run at the lowest CPU priority (nice 19 for the whole process, idle-class sending threads):
    on a host shared with training or generation, moving weights takes only the CPU they leave."""
    max_version_gb: float = Field(default=64.0, gt=0)
    """Largest weight version accepted; a bigger manifest is refused before anything is allocated."""
