"""OpenAI's wire format for the gateway: completions and chat completions (whole and as server-sent
chunks) built from a session's turn, with rlmesh's extension carrying the turn's token ids, logprobs
and versions; and OpenAI-style errors."""

from __future__ import annotations

import time
from typing import Any

import orjson

from rlmesh.chat.tool_calls import ParsedTurn
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2

STATUS_NAMES = {
    s: manager_pb2.SessionStatus.Name(s).removeprefix("SESSION_STATUS_").lower()
    for s in manager_pb2.SessionStatus.values()
}


class GatewayError(Exception):
    """A request the gateway refuses: its HTTP status, OpenAI's error type and code, and the field at
    fault (OpenAI's `param`), when one is."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


def encode(body: Any) -> bytes:
    """A body as JSON. orjson: the standard encoder was a twentieth of the gateway's CPU per turn,
    formatting the extension's logprobs. A non-finite float (a logprob of -inf) is written as null."""
    return orjson.dumps(body)


def event(body: Any) -> bytes:
    """One server-sent event carrying `body`."""
    return b"data: " + encode(body) + b"\n\n"


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def finish_reason(segment: manager_pb2.Segment | None, parsed: ParsedTurn | None) -> str:
    if segment is None or segment.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "tool_calls" if parsed is not None and parsed.tool_calls else "stop"


def extension(
    session_id: str, turn: int, segment: manager_pb2.Segment | None, status: int, stream_tokens: int
) -> dict[str, Any]:
    """What rlmesh adds to a response: the exact tokens the engine sampled, their logprobs and the
    weight version of each, and where the session stands."""
    return {
        "session_id": session_id,
        "turn": turn,
        "session_status": STATUS_NAMES[status],
        "stream_tokens": stream_tokens,
        "token_ids": list(segment.token_ids) if segment else [],
        "logprobs": list(segment.logprobs) if segment else [],
        "weight_versions": list(segment.weight_versions) if segment else [],
    }


def token_logprobs(tokenizer: Any, segment: manager_pb2.Segment | None) -> dict[str, Any]:
    """OpenAI's `logprobs.content`: each sampled token with its logprob (no alternatives are kept)."""
    if segment is None:
        return {"content": []}
    tokens = tokenizer.convert_ids_to_tokens(list(segment.token_ids))
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logprob in zip(tokens, segment.logprobs)
        ]
    }


def chat_completion(
    model: str,
    completion_id: str,
    message: dict[str, Any],
    finish: str,
    usage: dict[str, int],
    rlmesh: dict[str, Any],
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
        "usage": usage,
        "rlmesh": rlmesh,
    }


def chat_message(parsed: ParsedTurn | None, text: str) -> dict[str, Any]:
    if parsed is None:
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.tool_calls else text}
    if parsed.tool_calls:
        message["tool_calls"] = [call.openai() for call in parsed.tool_calls]
    return message


def chat_chunk(
    model: str,
    completion_id: str,
    delta: dict[str, Any],
    finish: str | None = None,
    rlmesh: dict[str, Any] | None = None,
    usage: dict[str, int] | None = None,
) -> bytes:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if rlmesh is not None:
        body["rlmesh"] = rlmesh
    if usage is not None:
        body["usage"] = usage
    return event(body)


def usage_chunk(model: str, completion_id: str, usage: dict[str, int]) -> bytes:
    """The stream's last chunk when the client asked for usage (`stream_options.include_usage`)."""
    body = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return event(body)


def text_completion(
    model: str, completion_id: str, text: str, finish: str, usage: dict[str, int], rlmesh: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
        "rlmesh": rlmesh,
    }


def text_chunk(
    model: str, completion_id: str, text: str, finish: str | None = None, rlmesh: dict[str, Any] | None = None
) -> bytes:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if rlmesh is not None:
        body["rlmesh"] = rlmesh
    return event(body)


DONE = b"data: [DONE]\n\n"
