"""Running one turn of a session for a caller (the gRPC RunTurn, the HTTP gateway): start or find the
turn, make its start durable, dispatch it, and wait for it while reporting its tokens as they come."""

from __future__ import annotations

from collections.abc import Callable

from rlmesh.common.v1 import common_pb2
from services.manager.dispatcher import Changes, Dispatcher
from services.manager.journal import Journal, NoJournal
from services.manager.sessions import Segment, TurnState
from services.manager.state import ManagerState


class TurnRunner:
    def __init__(self, state: ManagerState, dispatcher: Dispatcher, changes: Changes, journal: Journal | NoJournal) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.changes = changes
        self.journal = journal

    async def run(self, session_id: str, turn: int, append: list[Segment], keep_tokens: int | None,
                  sampling: common_pb2.SamplingParams | None,
                  progress: Callable[[list[int]], None] | None = None) -> TurnState:
        """The turn, finished (or cut by the session's end). `progress` gets the turn's tokens so far
        whenever more arrived."""
        state = self.state.run_turn(session_id, turn, append, keep_tokens, sampling)
        if state.running is not None:
            self.journal.flush(self.state)
            self.dispatcher.dispatch()
            self.changes.notify()
        seen = 0
        while state.running is not None:
            await self.changes.wait(timeout=1.0)
            state = self.state.sessions.turn_state(self.state.sessions.get(session_id), turn)
            tokens = state.running.token_ids if state.running is not None else state.segment.token_ids if state.segment else []
            if progress is not None and len(tokens) > seen:
                progress(list(tokens))
                seen = len(tokens)
        # What the reply confirms is in the journal first.
        self.journal.flush(self.state)
        return state
