"""Riding out the manager's restarts: a call that found the manager (or one of its relay shards)
unreachable is made again with backoff, for a bounded time."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

log = structlog.get_logger()

RETRY_FIRST_SECONDS = 0.25
RETRY_MAX_SECONDS = 4.0


class ManagerOutage:
    """How long the manager has been unreachable: calls are made again with backoff until the
    outage has lasted `limit_seconds`, then its last error stands."""

    def __init__(self, limit_seconds: float) -> None:
        self.limit_seconds = limit_seconds
        self.since: float | None = None
        self.delay = RETRY_FIRST_SECONDS

    async def wait(self, exc: grpc.aio.AioRpcError, call: str) -> None:
        """Sleeps before the next attempt, or raises `exc` when it is not worth another."""
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if exc.code() != grpc.StatusCode.UNAVAILABLE or now - self.since + self.delay > self.limit_seconds:
            raise exc
        log.warning(
            "the manager is unreachable; calling again",
            call=call,
            retry_in_s=self.delay,
            unreachable_s=round(now - self.since, 2),
            error=exc.details(),
        )
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, RETRY_MAX_SECONDS)

    def reset(self) -> None:
        self.since, self.delay = None, RETRY_FIRST_SECONDS
