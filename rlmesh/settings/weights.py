"""The weights service's settings a job sets (`[weights]`): its data plane, compression, pace and
deadlines. `services/weights/config.py` adds the wiring (its socket, the manager's address)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerSettings, StrictModel

CompressionMode = Literal["none", "zstd", "delta", "int8", "fp8"]
"""How a link's weight payload buckets are encoded (`rlmesh/transfer/codecs.py`)."""


class WeightsSettings(StrictModel):
    """How weight versions are pushed to rollout instances."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    backend: Literal["tcp", "mooncake", "grpc"] = "tcp"
    """Data plane for pushes: a plain TCP connection per tensor-parallel rank (TCP links), the
    Mooncake transfer engine (RDMA links; raw bytes only), or a gRPC stream (no data port reachable)."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """The Mooncake transfer engine's protocol (backend mooncake)."""
    compression: CompressionMode = "none"
    """Default link compression: none, zstd (lossless, byte planes), delta (against the version the
    instance holds: the changed elements when few changed, else XOR + zstd; lossless), int8 / fp8
    (lossy; only to engines serving quantized weights). Needs backend tcp or grpc."""
    link_compression: dict[str, CompressionMode] = {}
    """Per-instance override of compression, by instance id (`rollout-0`, ...)."""
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

    @model_validator(mode="after")
    def _mooncake_sends_raw(self) -> WeightsSettings:
        modes = {self.compression, *self.link_compression.values()}
        if self.backend == "mooncake" and modes != {"none"}:
            raise ValueError(
                "the mooncake backend writes raw bytes into registered memory: "
                "link compression needs backend tcp or grpc"
            )
        return self
