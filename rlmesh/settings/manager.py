"""The manager's settings a job sets (`[manager]`, and η as `algorithm.max_staleness`) and its relay
shards' (`[relay]`); `services/manager/config.py` and `services/manager/relay/config.py` add the
wiring (sockets, journals, the weights service's address)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerSettings, StrictModel


class StalenessSetting(StrictModel):
    """η, the bound the manager's capacity rule holds rollout to; a job sets it with the algorithm."""

    max_staleness: int = Field(default=1, ge=0, le=8)
    """η: trainer versions a rollout may lag behind (0 = synchronous on-policy). The capacity rule
    lets a step's samples generate only while the trainer is within η versions of that step, and
    samples for trainer version p run only on instances serving version >= p - η."""


class ManagerSettings(StrictModel):
    """Leases, dispatch and the journal's pace."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    lease_seconds: float = Field(default=10.0, gt=0)
    """An instance that sends no heartbeat for this long is dropped and its requests continue elsewhere."""
    heartbeat_interval_seconds: float = Field(default=2.0, gt=0)
    """How often a rollout instance is asked to heartbeat; at most half of lease_seconds."""
    dispatch_policy: Literal["balanced", "round_robin"] = "balanced"
    """`balanced` weighs outstanding tokens against each instance's measured throughput and moves
    stragglers off slow instances near the end of a step; `round_robin` is the plain baseline."""
    queue_ahead: int = Field(default=0, ge=0, le=1024)
    """Requests each instance is given beyond its max batch: they wait in its engine's queue and
    start the moment a sequence ends, instead of after the manager heard of the end (a relay
    shard's report window, then a dispatch pass). Stragglers still move only to free decode slots.
    0: an instance gets at most its max batch."""
    no_instance_timeout_seconds: float = Field(default=120.0, gt=0)
    """With work waiting and no instance registered for this long, rollout streams fail with a
    clear error instead of hanging."""
    generate_timeout_seconds: float = Field(default=600.0, gt=0)
    """Deadline of one Generate stream."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    """Deadline of the manager's calls to rollout instances and the weights service."""
    gateway_turn_timeout_seconds: float = Field(default=3600.0, gt=0)
    """Deadline of the OpenAI gateway's call for one turn (the turn may wait for the staleness bound
    while the trainer trains); a harness's own HTTP timeout ends its request sooner."""
    store_wait_seconds: float = Field(default=5.0, gt=0)
    """How long PublishVersion waits for the weights service to finish storing a version all of
    whose ranks arrived; past it the trainer is told UNAVAILABLE and calls again."""
    journal_flush_seconds: float = Field(default=0.5, gt=0)
    """How often tokens generated since the last write reach the journal (accepted batches, sent
    groups, registrations and versions are written before their reply). A restarted manager
    regenerates at most this long's tokens; each write rewrites the token arrays of the requests
    that grew, so writing more often costs relay throughput."""

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> ManagerSettings:
        if self.heartbeat_interval_seconds * 2 > self.lease_seconds:
            raise ValueError("heartbeat_interval_seconds must be at most half of lease_seconds")
        return self


class RelaySettings(StrictModel):
    """How a relay shard (`mesh.relay_shards`) runs instance streams and reports to the manager's ledger."""

    server: ServerSettings = ServerSettings()
    """The shard's gRPC server limits and log level (its socket is the mesh's)."""
    generate_timeout_seconds: float = Field(default=600.0, gt=0)
    """Deadline of one GenerateMany stream to an instance (the manager's setting of that name)."""
    progress_seconds: float = Field(default=1.0, gt=0)
    """How often the token counts of running requests reach the manager: its balance and tail rules
    read them. Finished and ended attempts are reported within the report window."""
    report_window_seconds: float = Field(default=0.05, ge=0, le=5)
    """How long a report of finished requests waits for more to travel with it: the manager makes a
    dispatch pass per report, so a wider window costs it less per request, and a freed slot waits
    longer for its next request unless `manager.queue_ahead` has one waiting in the engine already
    (docs/scale.md)."""
