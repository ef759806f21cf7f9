"""The gateway process's view of the sessions harnesses reach it for: each read from the manager
(GetSession) on first use, then kept in step with the turns the gateway runs through the manager's
session contract (RunTurn, StreamTurn); a bounded cache that a restarted gateway fills again."""

from __future__ import annotations

import asyncio
import hmac
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.rpc import call_options
from rlmesh.tool_calls import ParsedTurn, parse_tool_calls
from services.manager import openai_format as wire
from services.manager.conversations import LoggedMessage, conversation_from_proto, conversation_to_proto, message_key
from services.manager.openai_format import GatewayError
from services.manager.sessions import stream_of

MAX_VIEWS = 4096
"""Sessions kept in the cache; one evicted is read from the manager again on its next request."""
WATCH_SECONDS = 600.0
"""The deadline of one WatchSessions stream; the next is opened at once."""
WATCH_RETRY_SECONDS = (0.5, 10.0)
"""The wait before watching again after a failed stream: the first, doubled up to the second."""

log = structlog.get_logger()

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    """The manager's refusal as HTTP: its message, and the status closest to its code (502 for the rest)."""
    return GatewayError(_HTTP_STATUS.get(exc.code(), 502), exc.details() or exc.code().name, "invalid_request_error", exc.code().name)


@dataclass(slots=True)
class SessionView:
    """What the gateway needs of a session: its key and sampling, the turn it runs next, the
    conversation matched so far and its current part's tokens."""

    session_id: str
    key: str
    sampling: common_pb2.SamplingParams
    next_turn: int
    conversation: list[LoggedMessage]
    stream: list[int]
    announced: bool = False
    """Made from the session's opening (WatchSessions), not read from its record: it assumes no turn
    ran yet, which its first turn confirms."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    """A turn's end: the session's status, the model's segment (None when the session ended
    instead) and the tokens of its current part."""

    status: int
    segment: manager_pb2.Segment | None
    stream_tokens: int


def model_turn(tokenizer: Any, session_id: str, turn: int, segment: manager_pb2.Segment,
               end: int) -> tuple[dict[str, Any], ParsedTurn, LoggedMessage]:
    """A model turn as the harness sees it (its assistant message and parsed tool calls) and as the
    conversation logs it (ending at `end` tokens of the part)."""
    text = tokenizer.decode(list(segment.token_ids), skip_special_tokens=True)
    parsed = parse_tool_calls(text, f"call_{session_id.rsplit('/', 1)[-1]}_{turn}")
    message = wire.chat_message(parsed, text)
    stop_text = "" if segment.finish_reason == common_pb2.FINISH_REASON_LENGTH else tokenizer.decode(list(segment.token_ids[-1:]))
    return message, parsed, LoggedMessage(message_key(message), end, stop_text)


class GatewaySessions:
    def __init__(self, manager: Any, tokenizer: Any, turn_timeout: float, rpc_timeout: float, capacity: int = MAX_VIEWS) -> None:
        self.manager = manager
        """The manager's ManagerService stub."""
        self.tokenizer = tokenizer
        self.turn_timeout = turn_timeout
        self.rpc_timeout = rpc_timeout
        self.capacity = capacity
        self._views: OrderedDict[str, SessionView] = OrderedDict()
        self._announced: OrderedDict[str, manager_pb2.OpenedSession] = OrderedDict()
        """Sessions opened that no request has reached yet."""

    def __len__(self) -> int:
        return len(self._views)

    async def authorized(self, session_id: str, key: str) -> SessionView:
        """The session `key` opens. The same answer for an unknown session and a wrong key: a key
        tells nothing about other sessions."""
        view = self._views.get(session_id)
        if view is None and key:
            opened = self._announced.pop(session_id, None)
            if opened is not None:
                view = self._keep(SessionView(session_id, opened.key, opened.sampling, 0, [], list(opened.token_ids), announced=True))
            else:
                view = await self._load(session_id)
        if view is None or not key or not hmac.compare_digest(view.key.encode(), key.encode()):
            raise GatewayError(401, f"no session {session_id!r} for this key: present the session's key as the bearer key",
                               "authentication_error", "invalid_api_key")
        self._views.move_to_end(session_id)
        return view

    async def _load(self, session_id: str) -> SessionView | None:
        try:
            reply = await self.manager.GetSession(manager_pb2.GetSessionRequest(session_id=session_id), **call_options(self.rpc_timeout))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise http_error(exc) from exc
        return self._keep(self._view_of(reply))

    def _keep(self, view: SessionView) -> SessionView:
        # A request for the same session may have loaded it meanwhile and run a turn since.
        view = self._views.setdefault(view.session_id, view)
        while len(self._views) > self.capacity:
            self._views.popitem(last=False)
        return view

    async def follow(self) -> None:
        """Learns of sessions as they open (WatchSessions), so a harness's first request needs no
        GetSession before its turn; one opened while no stream was open is read on first use."""
        wait = WATCH_RETRY_SECONDS[0]
        while True:
            try:
                async for reply in self.manager.WatchSessions(manager_pb2.WatchSessionsRequest(), **call_options(WATCH_SECONDS)):
                    wait = WATCH_RETRY_SECONDS[0]
                    self.announce(reply.sessions)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the manager announces no sessions: each is read on its first request")
                    return
                log.warning("watching the sessions that open failed; watching again", code=exc.code().name, after_seconds=wait)
            await asyncio.sleep(wait)
            wait = min(2 * wait, WATCH_RETRY_SECONDS[1])

    def announce(self, sessions: Iterable[manager_pb2.OpenedSession]) -> None:
        for opened in sessions:
            if opened.session_id not in self._views:
                self._announced[opened.session_id] = opened
        while len(self._announced) > self.capacity:
            self._announced.popitem(last=False)

    def _view_of(self, reply: manager_pb2.GetSessionResponse) -> SessionView:
        """A session's view from the manager's record: a turn still running is the one to ask for
        next (asking again returns it); a finished last turn joins the conversation recorded with it."""
        trajectory = reply.session
        segments = list(trajectory.segments)
        conversation = conversation_from_proto(reply.conversation)
        last_turn = trajectory.turns - 1
        index = next((i for i in range(len(segments) - 1, -1, -1)
                      if segments[i].source == manager_pb2.SEGMENT_SOURCE_MODEL and segments[i].turn == last_turn), None)
        running = trajectory.status == manager_pb2.SESSION_STATUS_OPEN and trajectory.turns > 0 and index is None
        if index is not None and conversation and not conversation[-1].is_model_turn:
            _, _, logged = model_turn(self.tokenizer, trajectory.session_id, last_turn, segments[index], len(stream_of(segments[:index + 1])))
            conversation.append(logged)
        return SessionView(trajectory.session_id, reply.key, reply.sampling, last_turn if running else trajectory.turns,
                           conversation, stream_of(segments))

    def forget(self, session_id: str) -> None:
        """Drops a view that may no longer match the manager's record: the next request reads it again."""
        self._views.pop(session_id, None)

    async def run(self, view: SessionView, append: list[manager_pb2.Segment], keep_tokens: int | None,
                  sampling: common_pb2.SamplingParams, conversation: list[LoggedMessage],
                  progress: Callable[[list[int]], None] | None = None) -> TurnResult:
        """Runs the view's next turn; `progress` (streamed through StreamTurn) gets its tokens so far."""
        request = manager_pb2.RunTurnRequest(session_id=view.session_id, turn=view.next_turn, append=append, sampling=sampling,
                                             conversation=conversation_to_proto(conversation))
        if keep_tokens is not None:
            request.keep_tokens = keep_tokens
        try:
            if progress is None:
                reply = await self.manager.RunTurn(request, **call_options(self.turn_timeout))
            else:
                reply = None
                async for message in self.manager.StreamTurn(manager_pb2.StreamTurnRequest(run=request), **call_options(self.turn_timeout)):
                    if message.HasField("result"):
                        reply = message.result
                    else:
                        progress(list(message.token_ids))
                if reply is None:
                    raise GatewayError(502, "the manager's turn stream ended before the turn did", "api_error", "INTERNAL")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.forget(view.session_id)
            raise http_error(exc) from exc
        generated = reply.generated if reply.HasField("generated") else None
        if generated is None:
            self.forget(view.session_id)
        else:
            stream = view.stream if keep_tokens is None else view.stream[:keep_tokens]
            for segment in append:
                stream.extend(segment.token_ids)
            stream.extend(generated.token_ids)
            view.stream = stream
            view.next_turn += 1
            if len(stream) != reply.stream_tokens:
                self.forget(view.session_id)
                if view.announced:
                    # Turn 0 had run before (through the contract): what came back is that turn.
                    raise GatewayError(409, f"session {view.session_id!r} had run turns this gateway did not know of: send the "
                                            "request again", "invalid_request_error", "FAILED_PRECONDITION")
            view.announced = False
        return TurnResult(reply.status, generated, reply.stream_tokens)

    async def set_reward(self, view: SessionView, reward: float, turn: int | None) -> None:
        request = manager_pb2.SetSessionRewardRequest(session_id=view.session_id, reward=reward)
        if turn is not None:
            request.turn = turn
        try:
            await self.manager.SetSessionReward(request, **call_options(self.rpc_timeout))
        except grpc.aio.AioRpcError as exc:
            raise http_error(exc) from exc
