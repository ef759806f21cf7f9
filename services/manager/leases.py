"""The manager's watch beside its servicer: instances whose lease expired dropped, quarantines over,
sessions past their deadline reaped, throughput figures kept current and stragglers moved."""

from __future__ import annotations

import asyncio
import time

import structlog

from services.manager.dispatcher import Changes, Dispatcher
from services.manager.domain.state import ManagerState

log = structlog.get_logger()


async def watch_leases(state: ManagerState, dispatcher: Dispatcher, changes: Changes, period: float = 0.25) -> None:
    """Drops instances whose lease expired, keeps throughput figures current, moves stragglers,
    and wakes rollout streams so they notice when no instance is left."""
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        try:
            state.measure(now)
            dispatcher.migrate()
            reaped = state.sessions.reap(now)
            if reaped:
                log.warning(
                    "sessions reaped at a deadline",
                    sessions=len(reaped),
                    first=reaped[0][0].session_id,
                    detail=reaped[0][0].detail,
                )
                dispatcher.cancel([dropped for _, dropped in reaped if dropped is not None])
                changes.notify()
            for instance in state.release_quarantines(now):
                log.info("quarantine over; the instance gets work again", instance_id=instance.instance_id)
                dispatcher.dispatch()
            if state.starved_seconds(now):
                changes.notify()
            for instance, requeued in state.expire(now):
                log.warning("lease expired; instance dropped", instance_id=instance.instance_id, requeued=len(requeued))
                dispatcher.cancel(requeued)
                dispatcher.close_streams(instance.instance_id)
                await dispatcher.forget_address(instance.address)
                dispatcher.dispatch()
                changes.notify()
        except Exception:
            # This loop is what notices dead instances: it must outlive any single failure.
            log.exception("lease check failed")
