"""Running one turn of a session for a caller (RunTurn, StreamTurn): start or find the
turn, dispatch it, wait for it while reporting its tokens as they come, and make it durable before
its reply (turns that end together share one journal write)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlmesh.common.v1 import common_pb2
from services.manager.dispatcher import Changes, Dispatcher
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.records import Segment, TurnState
from services.manager.domain.state import ManagerState
from services.manager.journal import Journal, NoJournal


class TurnRunner:
    def __init__(
        self, state: ManagerState, dispatcher: Dispatcher, changes: Changes, journal: Journal | NoJournal
    ) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.changes = changes
        self.journal = journal
        self._flush: asyncio.Future[None] | None = None
        """The journal write the turns that ended since the last one wait for."""
        self._waiting: dict[str, set[asyncio.Event]] = {}
        """By session: the calls waiting for its running turn to end. They are woken when it ends,
        not at every change of the state: hundreds of sessions wait at once, and tokens arrive
        many times a second."""
        state.sessions.turn_ended = self._turn_ended

    async def run(
        self,
        session_id: str,
        turn: int,
        append: list[Segment],
        keep_tokens: int | None,
        sampling: common_pb2.SamplingParams | None,
        conversation: list[LoggedMessage] | None = None,
        progress: Callable[[list[int]], None] | None = None,
    ) -> TurnState:
        """The turn, finished (or cut by the session's end). `progress` gets the turn's tokens so far
        whenever more arrived."""
        state = self.state.run_turn(session_id, turn, append, keep_tokens, sampling, conversation)
        if state.running is not None:
            # Not journaled before it runs: a turn the manager loses with a crash is started again
            # by the caller's retry (the same turn), and its tokens so far reach the journal with
            # the periodic flush.
            self.dispatcher.dispatch()
            self.changes.notify()
        seen = 0
        ended = asyncio.Event()
        self._waiting.setdefault(session_id, set()).add(ended)
        try:
            while state.running is not None:
                # A caller that reports progress wakes at every change (tokens came); the state is
                # looked at again at least every second whatever happens.
                await (self.changes.wait(timeout=1.0) if progress is not None else _wait(ended, 1.0))
                state = self.state.sessions.turn_state(self.state.sessions.get(session_id), turn)
                tokens = (
                    state.running.token_ids
                    if state.running is not None
                    else state.segment.token_ids
                    if state.segment
                    else []
                )
                if progress is not None and len(tokens) > seen:
                    progress(list(tokens))
                    seen = len(tokens)
        finally:
            waiting = self._waiting[session_id]
            waiting.discard(ended)
            if not waiting:
                del self._waiting[session_id]
        # What the reply confirms is in the journal first; turns ending together share one write.
        await self.flushed()
        return state

    def _turn_ended(self, session_id: str) -> None:
        for ended in self._waiting.get(session_id, ()):
            ended.set()

    async def flushed(self) -> None:
        """Returns once what the state holds now is in the journal: the callers waiting at one
        moment share one write."""
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._write)
        await asyncio.shield(self._flush)

    def _write(self) -> None:
        flush, self._flush = self._flush, None
        try:
            self.journal.flush(self.state)
        except Exception as exc:  # noqa: BLE001 - every turn waiting on this write gets its error
            flush.set_exception(exc)
            return
        flush.set_result(None)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass
    event.clear()
