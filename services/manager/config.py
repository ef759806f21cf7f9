"""Configuration of the manager."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerConfig, StrictModel


class ManagerConfig(StrictModel):
    server: ServerConfig = ServerConfig(port=50151)
    lease_seconds: float = Field(default=10.0, gt=0)
    """An instance that sends no heartbeat for this long is dropped and its requests continue elsewhere."""
    heartbeat_interval_seconds: float = Field(default=2.0, gt=0)
    max_staleness: int = Field(default=1, ge=0)
    """Samples for trainer version p run only on instances serving version >= p - max_staleness
    (0 = synchronous on-policy RL)."""
    dispatch_policy: Literal["balanced", "round_robin"] = "balanced"
    """`balanced` weighs outstanding tokens against each instance's measured throughput and moves
    stragglers off slow instances near the end of a step; `round_robin` is the plain baseline."""
    no_instance_timeout_seconds: float = Field(default=120.0, gt=0)
    """With work waiting and no instance registered for this long, rollout streams fail with a
    clear error instead of hanging."""
    generate_timeout_seconds: float = Field(default=600.0, gt=0)
    """Deadline of one Generate stream."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    journal_path: str = ""
    """A SQLite file (WAL mode) recording accepted batches, every request's tokens so far, the
    groups sent, the published version and the instance registry: a manager restarted on it goes
    on where the killed one stopped. "" keeps everything in memory only."""
    journal_flush_seconds: float = Field(default=0.5, gt=0)
    """How often tokens generated since the last write reach the journal (accepted batches, sent
    groups, registrations and versions are written before their reply). A restarted manager
    regenerates at most this long's tokens; each write rewrites the token arrays of the requests
    that grew, so writing more often costs relay throughput."""
    registration_token: str = ""
    """A shared secret rollout instances must present (`authorization: Bearer <token>`) to register,
    heartbeat and leave; others get UNAUTHENTICATED. "" accepts any caller (mutual TLS, when on,
    already admits only holders of the CA's certificates)."""

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> "ManagerConfig":
        if self.heartbeat_interval_seconds * 2 > self.lease_seconds:
            raise ValueError("heartbeat_interval_seconds must be at most half of lease_seconds")
        return self
