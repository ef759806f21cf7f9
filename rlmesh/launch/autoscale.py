"""The autoscaler: it follows the manager's recommended number of rollout instances with hysteresis
(a recommendation must hold for a while, then a cooldown) within bounds, and asks a scale target
for the count: `rlmesh up`'s supervisor, or a Kubernetes workload (kubernetes_scale.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog

from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.supervisor import Supervisor
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel

log = structlog.get_logger()

POLL_SECONDS = 2.0


@dataclass(slots=True)
class Autoscaler:
    """Moves the instance count one at a time toward the recommendation, within [minimum, maximum].

    A change happens only when every recommendation seen for `patience_seconds` pointed the same
    way (more, or fewer, instances than now), and at least `cooldown_seconds` after the last
    change: a recommendation that flaps, or one made before a new instance had time to matter,
    changes nothing."""

    minimum: int
    maximum: int
    patience_seconds: float = 30.0
    cooldown_seconds: float = 60.0
    _direction: int = 0
    _since: float = 0.0
    _last_change: float = field(default=float("-inf"))

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"rollout instances need 1 <= minimum <= maximum, got {self.minimum}:{self.maximum}")

    def observe(self, now: float, recommended: int, current: int) -> int | None:
        """The new instance count, or None to keep `current`. `recommended` 0 means no estimate yet."""
        wanted = min(max(recommended, self.minimum), self.maximum) if recommended > 0 else current
        direction = (wanted > current) - (wanted < current)
        if direction != self._direction:
            self._direction, self._since = direction, now
            return None
        if (
            direction == 0
            or now - self._since < self.patience_seconds
            or now - self._last_change < self.cooldown_seconds
        ):
            return None
        self._last_change = now
        self._since = now
        return current + direction


class TargetUnavailable(Exception):
    """The target could not be read or changed this time (a timeout, a server error): the next poll tries again."""


class ScaleTarget(Protocol):
    """What the autoscaler scales."""

    async def current(self) -> int:
        """The instance count asked for now."""
        ...

    async def scale_to(self, count: int, why: str) -> None: ...


@dataclass(frozen=True, slots=True)
class LocalInstances:
    """`rlmesh up`'s rollout processes, kept at the count by its supervisor."""

    supervisor: Supervisor

    async def current(self) -> int:
        return self.supervisor.target_instances

    async def scale_to(self, count: int, why: str) -> None:
        self.supervisor.scale_to(count, why)


async def follow_recommendations(
    scaler: Autoscaler,
    target: ScaleTarget,
    recommendation: Callable[[], Awaitable[int | None]],
    clock: Callable[[], float] = time.monotonic,
    poll_seconds: float = POLL_SECONDS,
) -> None:
    """Every poll_seconds, until cancelled: the manager's recommendation (None: it did not answer)
    through the rule, and a change to the target."""
    while True:
        recommended = await recommendation()
        if recommended is not None:
            try:
                new = scaler.observe(clock(), recommended, await target.current())
                if new is not None:
                    await target.scale_to(new, f"autoscale: the manager recommends {recommended}")
            except TargetUnavailable as exc:
                log.warning("the scale target did not answer; next poll", error=str(exc))
        await asyncio.sleep(poll_seconds)


def manager_recommendation(channel: grpc.aio.Channel) -> Callable[[], Awaitable[int | None]]:
    """The rollout instance count `GetStatus.stage_balance` recommends (None: the manager did not answer)."""
    manager = manager_pb2_grpc.ManagerServiceStub(channel)

    async def recommendation() -> int | None:
        try:
            status = await manager.GetStatus(manager_pb2.GetStatusRequest(), **call_options(2.0))
        except grpc.aio.AioRpcError:
            return None
        return status.stage_balance.recommended_rollout_instances

    return recommendation


async def autoscale(plan: LaunchPlan, supervisor: Supervisor) -> None:
    """Follows the manager's recommendation with `rlmesh up`'s instances, until cancelled."""
    mesh = plan.mesh
    scaler = Autoscaler(
        mesh.rollout_instances, mesh.instance_cap, mesh.autoscale_patience_seconds, mesh.autoscale_cooldown_seconds
    )
    async with open_channel(plan.manager_address) as channel:
        await follow_recommendations(scaler, LocalInstances(supervisor), manager_recommendation(channel))
