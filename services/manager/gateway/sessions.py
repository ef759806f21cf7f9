"""The gateway process's view of the sessions harnesses reach it for: each read from the manager
(GetSession) on first use, then kept in step with the turns the gateway runs through the manager's
session contract (RunTurn, StreamTurn); a bounded cache that a restarted gateway fills again."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from rlmesh.chat.stop_strings import cut_at_stop
from rlmesh.chat.tool_calls import ParsedTurn, parse_tool_calls
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.rpc.channels import call_options
from services.manager.domain.conversations import (
    COMPLETIONS_KEY,
    LoggedMessage,
    conversation_from_proto,
    conversation_to_proto,
    logged_model_turn,
)
from services.manager.domain.records import stream_of
from services.manager.gateway import openai_format as wire
from services.manager.gateway.openai_format import GatewayError

MAX_VIEWS = 4096
"""Sessions kept in the cache; one evicted is read from the manager again on its next request."""
UNVERIFIED_VIEWS = 256
"""Views read for requests that presented a wrong key, kept apart from the good ones."""
UNKNOWN_SECONDS = 2.0
"""How long a session id the manager did not know is refused without asking it again. A session
that opens meanwhile is announced at once (WatchSessions), which clears it; without a watch its
harness waits this long at most."""
WATCH_SECONDS = 600.0
"""The deadline of one WatchSessions stream; the next is opened at once."""
WATCH_RETRY_SECONDS = (0.5, 10.0)
"""The wait before watching again after a failed stream: the first, doubled up to the second."""

log = structlog.get_logger()

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    """The manager's refusal as HTTP: its message, and the status closest to its code (502 for the rest)."""
    return GatewayError(
        _HTTP_STATUS.get(exc.code(), 502), exc.details() or exc.code().name, "invalid_request_error", exc.code().name
    )


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
    refuse_agent_rewards: bool = False
    """The task scores its episodes itself: the harness may not report a reward (SessionLimits)."""
    refuse_breaks: bool = False
    """A request whose history does not extend the session's is refused, not a new part (SessionLimits)."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    """A turn's end: the session's status, the model's segment (None when the session ended
    instead) and the tokens of its current part."""

    status: int
    segment: manager_pb2.Segment | None
    stream_tokens: int


def _same_key(expected: str, presented: str) -> bool:
    return hmac.compare_digest(expected.encode(), presented.encode())


class ExpiringSet:
    """Strings remembered for `seconds` each, at most `capacity` of them (the oldest go first)."""

    def __init__(self, seconds: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.capacity, self._clock = seconds, capacity, clock
        self._until: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, item: str) -> None:
        now = self._clock()
        self._until.pop(item, None)
        self._until[item] = now + self.seconds
        # Every entry lives as long, so the oldest expire first.
        while self._until and (len(self._until) > self.capacity or next(iter(self._until.values())) <= now):
            self._until.popitem(last=False)

    def known(self, item: str) -> bool:
        until = self._until.get(item)
        if until is None:
            return False
        if until > self._clock():
            return True
        del self._until[item]
        return False

    def forget(self, item: str) -> None:
        self._until.pop(item, None)


def model_turn(
    tokenizer: Any,
    session_id: str,
    turn: int,
    segment: manager_pb2.Segment,
    end: int,
    stop: Sequence[str] = (),
    tools: bool | None = None,
) -> tuple[dict[str, Any], ParsedTurn, LoggedMessage]:
    """A model turn as the harness sees it (its assistant message and parsed tool calls, its text
    ending before a stop string) and as the conversation logs it (ending at `end` tokens of the part).
    `tools`: whether its request offered tools (only then are calls read from its text); None when
    not known (a turn read back from the record): its log then matches the turn as text and as calls."""
    text = cut_at_stop(tokenizer.decode(list(segment.token_ids), skip_special_tokens=True), stop)
    parsed = (
        parse_tool_calls(text, f"call_{session_id.rsplit('/', 1)[-1]}_{turn}")
        if tools is not False
        else ParsedTurn(text, [], 0)
    )
    message = wire.chat_message(parsed, text)
    stop_text = (
        ""
        if segment.finish_reason == common_pb2.FINISH_REASON_LENGTH
        else tokenizer.decode(list(segment.token_ids[-1:]))
    )
    if tools is None and parsed.tool_calls:
        return (
            message,
            parsed,
            logged_model_turn({"role": "assistant", "content": text}, end, stop_text, echoed=message),
        )
    return message, parsed, logged_model_turn(message, end, stop_text)


def ran_elsewhere(view: SessionView, refusal: str = "") -> GatewayError:
    if refusal:
        return GatewayError(
            409,
            f"{refusal} (session {view.session_id!r} may have run turns this gateway did not know of)",
            "invalid_request_error",
            "FAILED_PRECONDITION",
        )
    return GatewayError(
        409,
        f"session {view.session_id!r} had run turns this gateway did not know of: send the request again",
        "invalid_request_error",
        "FAILED_PRECONDITION",
    )


class GatewaySessions:
    def __init__(
        self, manager: Any, tokenizer: Any, turn_timeout: float, rpc_timeout: float, capacity: int = MAX_VIEWS
    ) -> None:
        self.manager = manager
        """The manager's ManagerService stub."""
        self.tokenizer = tokenizer
        self.turn_timeout = turn_timeout
        self.rpc_timeout = rpc_timeout
        self.capacity = capacity
        self._views: OrderedDict[str, SessionView] = OrderedDict()
        self._announced: OrderedDict[str, manager_pb2.OpenedSession] = OrderedDict()
        """Sessions opened that no request with their key has reached yet."""
        self._unverified: OrderedDict[str, SessionView] = OrderedDict()
        """Views read for a request whose key was wrong: kept apart, so they evict no good view."""
        self._unknown = ExpiringSet(UNKNOWN_SECONDS, capacity)
        """Session ids the manager did not know of a moment ago."""

    def __len__(self) -> int:
        return len(self._views)

    async def authorized(self, session_id: str, key: str) -> SessionView:
        """The session `key` opens. The same answer for an unknown session and a wrong key: a key
        tells nothing about other sessions. Only a view whose key was presented is kept among the
        views (a caller without it evicts none); an unknown id is remembered a moment, so a
        stranger's requests do not each cost a GetSession."""
        view = self._views.get(session_id)
        if view is None and key:
            view = self._unverified.pop(session_id, None)
            if view is None:
                opened = self._announced.get(session_id)
                if opened is not None:
                    view = SessionView(
                        session_id,
                        opened.key,
                        opened.sampling,
                        0,
                        [],
                        list(opened.token_ids),
                        announced=True,
                        refuse_agent_rewards=opened.refuse_agent_rewards,
                        refuse_breaks=opened.refuse_breaks,
                    )
                elif not self._unknown.known(session_id):
                    view = await self._load(session_id)
            if view is not None:
                if _same_key(view.key, key):
                    self._announced.pop(session_id, None)
                    view = self._keep(view)
                elif not view.announced:
                    self._unverified[session_id] = view
                    while len(self._unverified) > UNVERIFIED_VIEWS:
                        self._unverified.popitem(last=False)
                    view = None
                else:
                    view = None
        if view is None or not key or not _same_key(view.key, key):
            raise GatewayError(
                401,
                f"no session {session_id!r} for this key: present the session's key as the bearer key",
                "authentication_error",
                "invalid_api_key",
            )
        self._views.move_to_end(session_id)
        return view

    async def _load(self, session_id: str) -> SessionView | None:
        try:
            reply = await self.manager.GetSession(
                manager_pb2.GetSessionRequest(session_id=session_id), **call_options(self.rpc_timeout)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                self._unknown.add(session_id)
                return None
            raise http_error(exc) from exc
        return self._view_of(reply)

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
                async for reply in self.manager.WatchSessions(
                    manager_pb2.WatchSessionsRequest(), **call_options(WATCH_SECONDS)
                ):
                    wait = WATCH_RETRY_SECONDS[0]
                    self.announce(reply.sessions)
                    self.drop(reply.forgotten)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the manager announces no sessions: each is read on its first request")
                    return
                log.warning(
                    "watching the sessions that open failed; watching again", code=exc.code().name, after_seconds=wait
                )
            await asyncio.sleep(wait)
            wait = min(2 * wait, WATCH_RETRY_SECONDS[1])

    def drop(self, session_ids: Iterable[str]) -> None:
        """The manager forgot these sessions (their batch was delivered or cancelled): nothing of
        them is kept, so the gateway holds only what the sessions alive need."""
        for session_id in session_ids:
            self._views.pop(session_id, None)
            self._announced.pop(session_id, None)
            self._unverified.pop(session_id, None)

    def announce(self, sessions: Iterable[manager_pb2.OpenedSession]) -> None:
        for opened in sessions:
            self._unknown.forget(opened.session_id)
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
        index = next(
            (
                i
                for i in range(len(segments) - 1, -1, -1)
                if segments[i].source == manager_pb2.SEGMENT_SOURCE_MODEL and segments[i].turn == last_turn
            ),
            None,
        )
        running = trajectory.status == manager_pb2.SESSION_STATUS_OPEN and trajectory.turns > 0 and index is None
        # After turns through /v1/completions the last is no chat turn: chat requests break at the mark.
        if (
            index is not None
            and conversation
            and not conversation[-1].is_model_turn
            and conversation[-1].key != COMPLETIONS_KEY
        ):
            _, _, logged = model_turn(
                self.tokenizer, trajectory.session_id, last_turn, segments[index], len(stream_of(segments[: index + 1]))
            )
            conversation.append(logged)
        return SessionView(
            trajectory.session_id,
            reply.key,
            reply.sampling,
            last_turn if running else trajectory.turns,
            conversation,
            stream_of(segments),
            refuse_agent_rewards=reply.refuse_agent_rewards,
            refuse_breaks=reply.refuse_breaks,
        )

    def forget(self, session_id: str) -> None:
        """Drops a view that may no longer match the manager's record: the next request reads it again."""
        self._views.pop(session_id, None)

    async def run(
        self,
        view: SessionView,
        append: list[manager_pb2.Segment],
        keep_tokens: int | None,
        sampling: common_pb2.SamplingParams,
        conversation: list[LoggedMessage],
        progress: Callable[[list[int]], None] | None = None,
    ) -> TurnResult:
        """Runs the view's next turn; `progress` (streamed through StreamTurn) gets its tokens so far."""
        request = manager_pb2.RunTurnRequest(
            session_id=view.session_id,
            turn=view.next_turn,
            append=append,
            sampling=sampling,
            conversation=conversation_to_proto(conversation),
        )
        if keep_tokens is not None:
            request.keep_tokens = keep_tokens
        try:
            if progress is None:
                reply = await self.manager.RunTurn(request, **call_options(self.turn_timeout))
            else:
                reply = None
                async for message in self.manager.StreamTurn(
                    manager_pb2.StreamTurnRequest(run=request), **call_options(self.turn_timeout)
                ):
                    if message.HasField("result"):
                        reply = message.result
                    else:
                        progress(list(message.token_ids))
                if reply is None:
                    raise GatewayError(
                        502, "the manager's turn stream ended before the turn did", "api_error", "INTERNAL"
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.forget(view.session_id)
                if view.announced:
                    # Turn 0 may have run before (through the contract) from other tokens: the manager refused these.
                    raise ran_elsewhere(view, exc.details() or "") from exc
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
                    raise ran_elsewhere(view)
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
