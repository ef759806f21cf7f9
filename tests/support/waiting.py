"""Waiting for a condition, polled (`wait_until`) or awaited (`wait_for`), and a clock a test moves by hand."""

from __future__ import annotations

import asyncio
import time


class ManualClock:
    """A clock the test moves by hand (`clock.now = ...`), for code that takes a clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(condition, timeout: float, what: str = "the condition", interval: float = 0.05):
    """`condition()`'s first truthy value, polled every `interval` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def wait_for(condition, timeout: float = 20.0, what: str = "the condition", interval: float = 0.05):
    """`wait_until` for a running event loop: `condition()` may return an awaitable."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
