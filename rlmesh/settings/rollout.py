"""A rollout instance's settings a job sets (`[rollout]`); `services/rollout/config.py` adds the
wiring (its socket and id, the manager's address, the model folder, and the engine's kind, device,
dtype, batch, stream interval, tensor-parallel size and update mode the mesh section picks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlmesh.config import ServerSettings, StrictModel


class VllmConfig(StrictModel):
    kv_cache_gib: int = Field(default=1, ge=1)
    """KV-cache memory on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype vLLM serves the model in."""
    max_model_len: int = Field(default=0, ge=0)
    """0: the model's own limit."""


class EngineSettings(StrictModel):
    seed: int = 0
    """Seed of the engine's sampling."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads (per tensor-parallel rank); tiny models decode faster with one thread per process."""
    update_pause_limit_seconds: float = Field(default=30.0, gt=0)
    """In pause mode, the longest a push may hold generation: a push that neither commits nor fails
    by then (its sender died or gave up) lets generation resume on the served version; a late
    commit holds it again while it switches."""
    vllm: VllmConfig = VllmConfig()


class TransferSettings(StrictModel):
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """The Mooncake transfer engine's protocol, when its endpoint is offered."""
    tcp: bool = True
    """Offer a plain TCP receiver per tensor-parallel rank for weight pushes (framed buckets)."""
    background_priority: bool = True
    """Receive, check and copy weights on idle-class threads, which run only when generation
    leaves a CPU free: a push slows down under load instead of slowing generation."""
    catch_up_delay_seconds: float = Field(default=1.0, ge=0)
    """On a delta link, how long after serving a version each rank waits before copying it into
    its standby buffer (the next delta's base); the next version's push starts the copy at once."""


class RolloutSettings(StrictModel):
    """The engine's and the weight receiver's settings, and the instance's deadlines."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    engine: EngineSettings = EngineSettings()
    transfer: TransferSettings = TransferSettings()
    preemptible: bool = False
    """Runs on a spot / preemptible machine: the manager may offload work to it and expects it to vanish."""
    drain_timeout_seconds: float = Field(default=10.0, gt=0)
    """On SIGTERM or a preemption notice, how long to wait for running requests to be handed back."""
    register_timeout_seconds: float = Field(default=60.0, gt=0)
    """How long to keep trying to reach the manager at start."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    """Deadline of the instance's calls to the manager."""
