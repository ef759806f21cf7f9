"""Sync environment calls on threads: at most `threads` run at once. A call past its deadline keeps
its thread (Python cannot stop one), so that thread is written off: it no longer takes a place, and
hung steps never starve later episodes. Written-off threads are bounded, counted and logged."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger()


def _settle(future: asyncio.Future, outcome: Callable[[Any], None], value: Any) -> None:
    if not future.done():
        outcome(value)


def _run(loop: asyncio.AbstractEventLoop, future: asyncio.Future, function: Callable[..., Any], args: tuple) -> None:
    try:
        result = function(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting episode, which ends with it
        outcome, value = future.set_exception, exc
    else:
        outcome, value = future.set_result, result
    try:
        loop.call_soon_threadsafe(_settle, future, outcome, value)
    except RuntimeError:  # the loop closed while the call ran: nobody waits for it
        pass


def _retrieve(future: asyncio.Future) -> None:
    """A call nobody awaits any more that ends after all: its outcome is read, so nothing is logged as lost."""
    if not future.cancelled():
        future.exception()


def _free_when_done(future: asyncio.Future, places: asyncio.Semaphore) -> None:
    def freed(done: asyncio.Future) -> None:
        places.release()
        _retrieve(done)

    future.add_done_callback(freed)


class EnvironmentThreads:
    """Runs sync calls each on a daemon thread of its own, `threads` at once at most; up to
    `max_written_off` calls past their deadline may hold a thread beyond those (default: `threads`)."""

    def __init__(self, threads: int, max_written_off: int | None = None) -> None:
        self.threads = threads
        self.max_written_off = threads if max_written_off is None else max_written_off
        self.written_off = 0
        """Calls past their deadline whose thread still runs."""
        self.written_off_total = 0
        self._places: asyncio.Semaphore | None = None

    async def call(self, function: Callable[..., Any], *args: Any, deadline: float) -> Any:
        """`function(*args)` on a thread; TimeoutError past `deadline` seconds from its start (the
        wait for a place does not count)."""
        if self._places is None:
            self._places = asyncio.Semaphore(self.threads)
        places = self._places
        await places.acquire()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        threading.Thread(target=_run, args=(loop, future, function, args), name="environment", daemon=True).start()
        holds_place = True
        try:
            return await asyncio.wait_for(asyncio.shield(future), deadline)
        except TimeoutError:
            if self.written_off < self.max_written_off:
                self._write_off(future, function)
            else:
                # Past the bound the place stays taken until the call ends: the pool shrinks instead of growing.
                holds_place = False
                _free_when_done(future, places)
                log.error(
                    "a hung environment call keeps its thread's place: too many are written off already",
                    call=getattr(function, "__qualname__", repr(function)),
                    written_off_threads=self.written_off,
                    max_written_off=self.max_written_off,
                )
            raise
        except asyncio.CancelledError:
            holds_place = False
            _free_when_done(future, places)
            raise
        finally:
            if holds_place:
                places.release()

    def _write_off(self, future: asyncio.Future, function: Callable[..., Any]) -> None:
        self.written_off += 1
        self.written_off_total += 1

        def came_back(done: asyncio.Future) -> None:
            self.written_off -= 1
            _retrieve(done)

        future.add_done_callback(came_back)
        log.warning(
            "an environment call passed its deadline: its thread is written off and another takes its place",
            call=getattr(function, "__qualname__", repr(function)),
            written_off_threads=self.written_off,
            written_off_total=self.written_off_total,
        )
