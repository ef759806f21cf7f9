"""The sessions OpenSessions opens, fanned out to whoever watches them (the manager's gateway process),
each watcher with a bounded queue: one that falls behind misses openings rather than holding memory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger()

Opened = TypeVar("Opened")

WATCHER_QUEUE = 256
"""OpenSessions calls a watcher may be behind before it misses some."""


class SessionFeed(Generic[Opened]):
    def __init__(self, queue_size: int = WATCHER_QUEUE) -> None:
        self.queue_size = queue_size
        self._watchers: set[asyncio.Queue[Opened]] = set()

    def __len__(self) -> int:
        return len(self._watchers)

    @contextmanager
    def watch(self) -> Iterator[asyncio.Queue[Opened]]:
        """A queue of what is published from now on, for as long as the block runs."""
        queue: asyncio.Queue[Opened] = asyncio.Queue(self.queue_size)
        self._watchers.add(queue)
        try:
            yield queue
        finally:
            self._watchers.discard(queue)

    def publish(self, opened: Opened) -> None:
        for queue in self._watchers:
            try:
                queue.put_nowait(opened)
            except asyncio.QueueFull:
                # A watcher this far behind reads what it missed from GetSession on first use.
                log.warning("a session watcher is behind: it misses these openings", queued=queue.qsize())
