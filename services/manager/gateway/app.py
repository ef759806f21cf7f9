"""The manager's OpenAI-compatible gateway (Starlette, served by uvicorn in a process of its own beside
the manager's): `/v1/chat/completions` and `/v1/completions`, whole or streamed, for the session named
in the base URL (`/sessions/<id>/v1`) or in the `X-Rlmesh-Session` header. A request's messages are
matched against the session's conversation, so earlier turns keep the exact tokens the model
produced; a harness's key reaches its own session only; turns run through the manager's contract."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from rlmesh.chat.gateway_client import KEY_HEADER
from rlmesh.chat.stop_strings import cut_at_stop, without_partial_stop
from rlmesh.chat.tool_calls import ParsedTurn
from rlmesh.chat.turns import ENVIRONMENT, ChatTurns, RenderError, TurnEncoder, caching_encoder, text_encoder
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.conversations import (
    ConversationError,
    TurnPlan,
    after_completion,
    describe_break,
    plan_turn,
)
from services.manager.gateway import openai_format as wire
from services.manager.gateway import requests as checks
from services.manager.gateway.openai_format import GatewayError
from services.manager.gateway.sessions import GatewaySessions, SessionView, TurnResult, model_turn

log = structlog.get_logger()

SESSION_HEADER = "x-rlmesh-session"
MAX_BODY_BYTES = 8 << 20
ROUTE_ERRORS = {
    404: "no such route: the gateway serves POST <base>/chat/completions, POST <base>/completions, GET <base>/models "
    "and POST <base>/rlmesh/reward, <base> being /sessions/<id>/v1, /sessions/<id>/key/<key>/v1 or /v1 (with the "
    f"{SESSION_HEADER} header); and GET /healthz",
    405: "{method} is not allowed on this route (POST for completions and rewards, GET for models and /healthz)",
}


class JsonReply(JSONResponse):
    """A JSON response encoded by orjson (see `openai_format.encode`)."""

    def render(self, content: Any) -> bytes:
        return wire.encode(content)


class Ids:
    """Ids unique to this process (a random prefix drawn once, then a counter): a request's id and a
    completion's, without reading the system's randomness on every request."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):012x}"


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    """A chat turn checked and rendered, ready to run."""

    plan: TurnPlan
    segments: list[manager_pb2.Segment]
    turn: int
    sampling: common_pb2.SamplingParams
    tools: bool = False
    """The request offered tools: only then are the model's calls read from its text."""


def environment_segment(token_ids: list[int], break_cause: str = "") -> manager_pb2.Segment:
    return manager_pb2.Segment(
        source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, token_ids=token_ids, break_cause=break_cause
    )


def refused_break(where: str) -> GatewayError:
    return GatewayError(
        409,
        f'{where}: this session refuses breaks (the task\'s environment.on_break is "refuse"); send a history '
        "that extends the session's",
        "invalid_request_error",
        "history_break",
    )


@dataclass(slots=True)
class SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    """Holding it or waiting for it."""


class Gateway:
    """The gateway's work, apart from HTTP: authorize, match, run the turn, shape the reply."""

    def __init__(self, sessions: GatewaySessions, tokenizer: Any, model_name: str) -> None:
        self.sessions = sessions
        self.tokenizer = tokenizer
        self._encode = caching_encoder(text_encoder(tokenizer))
        self._turn_encoder = TurnEncoder(tokenizer)
        self.model_name = model_name
        self._locks: dict[str, SessionLock] = {}

    async def hold(self, session_id: str) -> Callable[[], None]:
        """Waits for the session's turn: one at a time per session, since a harness's concurrent calls
        would race for the same turn. Returns its release; a lock nobody holds or waits for is
        dropped, so the gateway keeps none for the sessions that ended."""
        held = self._locks.setdefault(session_id, SessionLock())
        held.users += 1

        def release() -> None:
            held.users -= 1
            if not held.users:
                del self._locks[session_id]

        try:
            await held.lock.acquire()
        except BaseException:
            release()
            raise

        def unlock() -> None:
            held.lock.release()
            release()

        return unlock

    def sampling(self, session: SessionView, body: dict[str, Any]) -> common_pb2.SamplingParams:
        """The session's sampling (the task's temperature and stop tokens: the trainer's logprobs are
        at them), the request's max_tokens bounded by its own, and the request's stop strings."""
        params = common_pb2.SamplingParams()
        params.CopyFrom(session.sampling)
        params.stop.extend(checks.stop_strings(body))
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        if requested is not None:
            if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
                raise GatewayError(400, f"max_tokens must be a positive integer, got {requested!r}")
            params.max_tokens = min(params.max_tokens, requested)
        return params

    def plan_chat(self, session: SessionView, body: dict[str, Any]) -> PlannedTurn:
        """What a chat request asks of the session, checked before anything runs."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise GatewayError(400, "messages must be a list of message objects")
        if body.get("n", 1) != 1:
            raise GatewayError(400, "n must be 1: a session is one trajectory")
        tools = body.get("tools") or None
        turns = ChatTurns(self.tokenizer, tools, self._turn_encoder)
        try:
            plan = plan_turn(session.conversation, messages, turns)
        except (ConversationError, RenderError) as exc:
            raise GatewayError(400, str(exc)) from exc
        if plan.cause and session.refuse_breaks:
            raise refused_break(describe_break(plan, messages))
        segments = [
            manager_pb2.Segment(
                source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
                if p.source == ENVIRONMENT
                else manager_pb2.SEGMENT_SOURCE_TEMPLATE,
                token_ids=p.token_ids,
            )
            for p in plan.pieces
        ]
        if plan.cause and segments:
            segments[0].break_cause = plan.cause
        return PlannedTurn(plan, segments, session.next_turn, self.sampling(session, body), tools is not None)

    async def run_chat(
        self, session: SessionView, planned: PlannedTurn, progress: Callable[[list[int]], None] | None = None
    ) -> tuple[TurnResult, dict[str, Any], ParsedTurn | None]:
        """Runs a planned chat turn; returns its result, the assistant message it makes (as the
        harness will send it back) and its parsed tool calls. `progress` gets its tokens so far."""
        plan = planned.plan
        before = [*plan.kept, *plan.new_messages]
        result = await self.sessions.run(
            session, planned.segments, plan.keep_tokens, planned.sampling, before, progress
        )
        if result.segment is None:
            return result, wire.chat_message(None, ""), None
        message, parsed, logged = model_turn(
            self.tokenizer,
            session.session_id,
            planned.turn,
            result.segment,
            result.stream_tokens,
            planned.sampling.stop,
            tools=planned.tools,
        )
        session.conversation = [*before, logged]
        return result, message, parsed

    async def complete(self, session: SessionView, body: dict[str, Any]) -> tuple[TurnResult, int]:
        """Runs the turn a (text) completion asks for: its prompt must extend the session's stream
        (tokens compared, or text compared against the stream's decoding); where it does not, the
        common prefix is kept and the rest starts a new part (`edited_prompt`). The chat
        conversation is kept up to its last model turn the stream still holds: a chat request
        after it breaks there (`mixed_endpoints`)."""
        prompt = body.get("prompt")
        stream = session.stream
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            known = self.tokenizer.decode(stream, skip_special_tokens=False)
            ids = stream + self._encode(prompt[len(known) :]) if prompt.startswith(known) else self._encode(prompt)
        else:
            raise GatewayError(400, "prompt must be a non-empty string or a list of token ids")
        common = 0
        while common < min(len(ids), len(stream)) and ids[common] == stream[common]:
            common += 1
        rest = ids[common:]
        if not rest:
            raise GatewayError(
                400, "the prompt adds nothing to the session's stream: the model's next turn needs new tokens"
            )
        keep = None if common == len(stream) else common
        if keep is not None and session.refuse_breaks:
            raise refused_break(f"the prompt differs from the session's stream at token {common} (edited_prompt)")
        turn = session.next_turn
        conversation = after_completion(session.conversation, common)
        result = await self.sessions.run(
            session,
            [environment_segment(rest, "" if keep is None else "edited_prompt")],
            keep,
            self.sampling(session, body),
            conversation,
        )
        if result.segment is not None:
            session.conversation = conversation
        return result, turn

    def text_of(self, segment: manager_pb2.Segment, stop: Sequence[str] = ()) -> str:
        """A turn's text, ending before its stop string (its tokens include it)."""
        return cut_at_stop(self.tokenizer.decode(list(segment.token_ids), skip_special_tokens=True), stop)

    def partial_text(self, token_ids: list[int], stop: Sequence[str] = ()) -> str:
        """A turn's text so far, for streaming: "" while its last token ends in the middle of a
        character, and without an ending that may yet become a stop string."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return "" if text.endswith("\ufffd") else without_partial_stop(text, stop)

    def usage(self, result: TurnResult) -> dict[str, int]:
        completion = len(result.segment.token_ids) if result.segment else 0
        return {
            "prompt_tokens": result.stream_tokens - completion,
            "completion_tokens": completion,
            "total_tokens": result.stream_tokens,
        }


def create_app(gateway: Gateway) -> Starlette:
    """The HTTP app: plain Starlette routes, since the gateway needs nothing of FastAPI's request
    models or documentation and every turn would pay for its dependency resolution."""

    new_id = Ids()

    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        # Never the URL: its path may carry the session's key. The session id is bound to the log.
        log.info(
            "request refused",
            status=exc.status,
            code=exc.code,
            error=str(exc),
            endpoint=getattr(request.scope.get("endpoint"), "__name__", ""),
        )
        # A body refused unread: the connection cannot carry another request after it.
        headers = {"connection": "close"} if exc.status == 413 else None
        return JsonReply(
            wire.error_body(str(exc), exc.kind, exc.code, exc.param), status_code=exc.status, headers=headers
        )

    async def no_route(request: Request, exc: HTTPException) -> JSONResponse:
        # An OpenAI-style error like every other refusal; the path is not repeated (it may carry a key).
        message = (
            ROUTE_ERRORS[exc.status_code].format(method=request.method)
            if exc.status_code in ROUTE_ERRORS
            else exc.detail
        )
        return JsonReply(
            wire.error_body(message, "invalid_request_error", "unknown_route"),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def body_of(request: Request) -> dict[str, Any]:
        """The request's JSON object, refused (413) as soon as it is known to pass MAX_BODY_BYTES:
        from its Content-Length before reading, or once the bytes read pass it."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise GatewayError(
                413, f"the request body ({declared} bytes) is over {MAX_BODY_BYTES} bytes", code="body_too_large"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise GatewayError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            body = orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise GatewayError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def session_of(request: Request) -> SessionView:
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER, "")
        # Each request runs in a task of its own: what is bound here reaches its logs and, as the
        # request id of its calls, the manager's.
        structlog.contextvars.bind_contextvars(
            request_id=request.headers.get("x-request-id") or new_id(), session_id=session_id
        )
        if not session_id:
            raise GatewayError(
                400, f"name the session in the base URL (/sessions/<id>/v1) or the {SESSION_HEADER} header"
            )
        # The key in the base URL (/sessions/<id>/key/<key>/v1) wins over a bearer key: a harness
        # that takes one setting sends whatever key it was configured with. Then the key's header:
        # a client whose bearer key is set for another endpoint (verifiers' interception).
        authorization = request.headers.get("authorization", "")
        key = (
            request.path_params.get("key")
            or request.headers.get(KEY_HEADER)
            or (authorization[7:].strip() if authorization.lower().startswith("bearer ") else "")
        )
        return await gateway.sessions.authorized(session_id, key)

    async def chat_completions(request: Request):
        session = await session_of(request)
        body = await body_of(request)
        checks.check_chat(body)
        completion_id = f"chatcmpl-{new_id()}"
        model = gateway.model_name
        unlock = await gateway.hold(session.session_id)
        if not body.get("stream"):
            try:
                planned = gateway.plan_chat(session, body)
                result, message, parsed = await gateway.run_chat(session, planned)
            finally:
                unlock()
            rlmesh = wire.extension(
                session.session_id, planned.turn, result.segment, result.status, result.stream_tokens
            )
            logprobs = wire.token_logprobs(gateway.tokenizer, result.segment) if body.get("logprobs") else None
            return JsonReply(
                wire.chat_completion(
                    model,
                    completion_id,
                    message,
                    wire.finish_reason(result.segment, parsed),
                    gateway.usage(result),
                    rlmesh,
                    logprobs,
                )
            )
        # Checked before the stream starts, so a bad request still gets its HTTP status.
        try:
            planned = gateway.plan_chat(session, body)
        except BaseException:
            unlock()
            raise
        updates: asyncio.Queue[list[int]] = asyncio.Queue()

        async def run() -> tuple[TurnResult, dict[str, Any], ParsedTurn | None]:
            try:
                return await gateway.run_chat(session, planned, updates.put_nowait)
            finally:
                unlock()

        turn = asyncio.create_task(run())
        # A turn that may call tools streams its text only once it is parsed: a call is no content.
        stream_content = not body.get("tools")

        async def chunks() -> AsyncIterator[bytes]:
            yield wire.chat_chunk(model, completion_id, {"role": "assistant", "content": ""})
            sent = ""
            while not turn.done():
                update = asyncio.ensure_future(updates.get())
                await asyncio.wait({update, turn}, return_when=asyncio.FIRST_COMPLETED)
                if not update.done():
                    update.cancel()
                    break
                text = gateway.partial_text(update.result(), planned.sampling.stop) if stream_content else ""
                if text.startswith(sent) and len(text) > len(sent):
                    yield wire.chat_chunk(model, completion_id, {"content": text[len(sent) :]})
                    sent = text
            try:
                result, message, parsed = turn.result()
            except GatewayError as exc:
                yield wire.event(wire.error_body(str(exc), exc.kind, exc.code))
                yield wire.DONE
                return
            content = message.get("content") or ""
            if content.startswith(sent) and len(content) > len(sent):
                yield wire.chat_chunk(model, completion_id, {"content": content[len(sent) :]})
            for index, call in enumerate(message.get("tool_calls") or []):
                yield wire.chat_chunk(model, completion_id, {"tool_calls": [{"index": index, **call}]})
            rlmesh = wire.extension(
                session.session_id, planned.turn, result.segment, result.status, result.stream_tokens
            )
            yield wire.chat_chunk(model, completion_id, {}, wire.finish_reason(result.segment, parsed), rlmesh)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield wire.usage_chunk(model, completion_id, gateway.usage(result))
            yield wire.DONE

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def completions(request: Request):
        session = await session_of(request)
        body = await body_of(request)
        checks.check_completion(body)
        completion_id = f"cmpl-{new_id()}"
        unlock = await gateway.hold(session.session_id)
        try:
            result, turn = await gateway.complete(session, body)
        finally:
            unlock()
        rlmesh = wire.extension(session.session_id, turn, result.segment, result.status, result.stream_tokens)
        text = gateway.text_of(result.segment, checks.stop_strings(body)) if result.segment else ""
        finish = wire.finish_reason(result.segment, None)
        if not body.get("stream"):
            return JsonReply(
                wire.text_completion(gateway.model_name, completion_id, text, finish, gateway.usage(result), rlmesh)
            )

        async def chunks() -> AsyncIterator[bytes]:
            yield wire.text_chunk(gateway.model_name, completion_id, text)
            yield wire.text_chunk(gateway.model_name, completion_id, "", finish, rlmesh)
            yield wire.DONE

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def models(request: Request):
        await session_of(request)
        return JsonReply(
            {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "owned_by": "rlmesh"}]}
        )

    async def reward(request: Request):
        """A black-box agent reports its episode's reward: {"reward": x} (final) or {"reward": x, "turn": k}."""
        session = await session_of(request)
        if session.refuse_agent_rewards:
            raise GatewayError(
                403,
                "this task does not take rewards from its agents (environment.agent_rewards is false: the task "
                "scores its episodes itself)",
                "permission_error",
                "agent_rewards_refused",
            )
        value, turn = checks.reward_of(await body_of(request))
        await gateway.sessions.set_reward(session, value, turn)
        return JsonReply({"session_id": session.session_id, "reward": value, "turn": turn})

    async def health(request: Request):
        return JsonReply({"status": "serving", "sessions_cached": str(len(gateway.sessions))})

    routes = [Route("/healthz", health)]
    # The key's routes first: the other session routes would take `<id>/key/<key>` for a session id.
    for prefix in ("/sessions/{session_id:path}/key/{key}/v1", "/sessions/{session_id:path}/v1", "/v1"):
        routes += [
            Route(f"{prefix}/chat/completions", chat_completions, methods=["POST"]),
            Route(f"{prefix}/completions", completions, methods=["POST"]),
            Route(f"{prefix}/models", models, methods=["GET"]),
        ]
        if prefix != "/v1":
            routes.append(Route(f"{prefix}/rlmesh/reward", reward, methods=["POST"]))
    return Starlette(routes=routes, exception_handlers={GatewayError: gateway_error, HTTPException: no_route})
