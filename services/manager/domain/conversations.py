"""A session's conversation as a harness sees it: the messages so far, each model turn with where it
ends in the token stream. A request's messages are matched against it canonically (see
docs/agents.md): a strict extension appends only the new messages after the model's exact tokens;
any other history is a break, named by its cause, that starts a new part at the last model turn
both agree on."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlmesh.chat.turns import ChatTurns, Piece, RenderError, content_text
from rlmesh.manager.v1 import manager_pb2


class ConversationError(ValueError):
    """The request's messages cannot continue the session (no new message, a trailing assistant turn)."""


@dataclass(frozen=True, slots=True)
class LoggedMessage:
    """A message of the conversation as matched: its digest and, for a model turn, where it ends."""

    key: str
    """What two messages must share to be the same message: a digest of role, text and tool calls."""
    end: int = 0
    """A model turn: the stream's length after its last token (0 for other messages)."""
    stop_text: str = ""
    """A model turn: the text of its stop token ("" when it was cut at max_tokens)."""
    content_key: str = ""
    """A model turn: a digest of its role, name and text as a harness may echo it (`echo_text`)."""
    calls_key: str = ""
    """A model turn: a digest of its tool calls' names and canonical arguments."""

    @property
    def is_model_turn(self) -> bool:
        return self.end > 0


COMPLETIONS_KEY = "completions"
"""Stands last in a conversation for the turns run through /v1/completions after its messages: a
chat request cannot extend them, so it breaks there (`mixed_endpoints`). No message's key."""
BREAK_CAUSES = (
    "edited_message",
    "removed_message",
    "inserted_message",
    "content_mismatch",
    "tool_calls",
    "mixed_endpoints",
    "edited_prompt",
)
"""Why a request's history did not extend the session's: the first message that differs was edited,
removed or inserted before; it is the model's turn with other text or other tool calls; the
session's last turns ran through /v1/completions; a completions prompt is no extension of the stream."""


def conversation_to_proto(messages: Sequence[LoggedMessage]) -> list[manager_pb2.ConversationMessage]:
    return [
        manager_pb2.ConversationMessage(
            match_key=m.key, end=m.end, stop_text=m.stop_text, content_key=m.content_key, calls_key=m.calls_key
        )
        for m in messages
    ]


def conversation_from_proto(messages: Sequence[manager_pb2.ConversationMessage]) -> list[LoggedMessage]:
    return [LoggedMessage(m.match_key, m.end, m.stop_text, m.content_key, m.calls_key) for m in messages]


KEYS_CACHED = 4_096
KEY_CACHE_MAX_CHARS = 1_024
"""Keys of messages without tool calls and up to this many characters are kept: a harness sends the
whole conversation with every turn, so each earlier message comes back once per turn. Bounded
small: most messages (the model's turns, tool outputs) belong to one session, and the cache only
has to span the sessions running at once (at most 4 MiB of text)."""


def message_key(message: Mapping[str, Any]) -> str:
    """What two messages share when they are the same message: a digest of role, text, name, tool
    calls (names and canonical arguments, not their ids) and tool call id."""
    role, text = message.get("role"), content_text(message)
    call_id, name = message.get("tool_call_id") or "", message.get("name") or ""
    if message.get("tool_calls"):
        return _digest(role, text, canonical_calls(message["tool_calls"]), call_id, name)
    if (
        len(text) <= KEY_CACHE_MAX_CHARS
        and (role is None or isinstance(role, str))
        and isinstance(call_id, str)
        and isinstance(name, str)
    ):
        return _plain_key(role, text, call_id, name)
    return _digest(role, text, [], call_id, name)


def _digest(role: Any, text: str, calls: list[list[Any]], call_id: Any, name: Any = "", size: int = 16) -> str:
    # Without a name, the form keys had before names counted: a journal's conversations still match.
    canonical = json.dumps([role, text, calls, call_id, name] if name else [role, text, calls, call_id])
    # A digest: the session's record travels with every turn and is journaled, whatever the messages' length.
    return hashlib.blake2b(canonical.encode(), digest_size=size).hexdigest()


@functools.lru_cache(maxsize=KEYS_CACHED)
def _plain_key(role: str | None, text: str, call_id: str, name: str) -> str:
    return _digest(role, text, [], call_id, name)


def canonical_calls(calls: Any) -> list[list[Any]]:
    """Tool calls as matched: each call's function name and canonical arguments."""
    if not isinstance(calls, list):
        raise ConversationError(f"tool_calls must be a list of tool calls, got {type(calls).__name__}")
    canonical = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ConversationError(
                f"tool_calls[{index}] must be an object with a `function` object (its name and arguments)"
            )
        canonical.append([function.get("name"), canonical_arguments(function.get("arguments"))])
    return canonical


def canonical_arguments(arguments: Any) -> str:
    """A tool call's arguments in one form whatever wrote them: JSON parsed and written again with
    sorted keys, fixed separators and integral numbers as integers (Go writes 2.0 as 2); text that
    is not JSON as it is."""
    try:
        value = json.loads(arguments if isinstance(arguments, str) else json.dumps(arguments), parse_float=_number)
    except (ValueError, RecursionError):
        return str(arguments)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
THINK_END = "</think>"


def echo_text(text: str) -> str:
    """A model turn's text as harnesses echo it back: without its <think> blocks (a turn that opened
    inside one, its generation prompt having opened it, without what precedes its end) and without
    the whitespace at its ends."""
    text = _THINK.sub("", text)
    end = text.find(THINK_END)
    return (text[end + len(THINK_END) :] if end >= 0 else text).strip()


def echo_keys(message: Mapping[str, Any]) -> tuple[str, str]:
    """An assistant message's content and calls keys, as LoggedMessage keeps them for a model turn."""
    calls = message.get("tool_calls")
    return (
        _digest(message.get("role"), echo_text(content_text(message)), [], "", message.get("name") or "", size=8),
        _digest(None, "", canonical_calls(calls) if calls else [], "", size=8),
    )


def logged_model_turn(
    message: Mapping[str, Any], end: int, stop_text: str, echoed: Mapping[str, Any] | None = None
) -> LoggedMessage:
    """The model's turn as the conversation logs it: the assistant message the harness was sent, and
    also as it may echo it back (`echoed`: another form it may come back in; by default the same)."""
    return LoggedMessage(message_key(message), end, stop_text, *echo_keys(message if echoed is None else echoed))


def same_message(logged: LoggedMessage, key: str, message: Mapping[str, Any]) -> bool:
    """The request's message (with its key) is the logged one: the same key, or the model's turn
    echoed with its whitespace, <think> blocks or the serialization of its arguments changed."""
    if logged.key == key:
        return True
    return (
        bool(logged.content_key)
        and message.get("role") == "assistant"
        and echo_keys(message) == (logged.content_key, logged.calls_key)
    )


def break_cause(
    log: Sequence[LoggedMessage], keys: Sequence[str], messages: Sequence[Mapping[str, Any]], at: int
) -> str:
    """Why the request's history differs from the log from message `at` on (one of BREAK_CAUSES)."""
    logged = log[at]
    if logged.key == COMPLETIONS_KEY:
        return "mixed_endpoints"
    if at >= len(keys) or (at + 1 < len(log) and same_message(log[at + 1], keys[at], messages[at])):
        return "removed_message"
    if at + 1 < len(keys) and same_message(logged, keys[at + 1], messages[at + 1]):
        return "inserted_message"
    if logged.is_model_turn and messages[at].get("role") == "assistant":
        calls = echo_keys(messages[at])[1]
        return "tool_calls" if logged.calls_key and calls != logged.calls_key else "content_mismatch"
    return "edited_message"


def after_completion(log: Sequence[LoggedMessage], kept_tokens: int) -> list[LoggedMessage]:
    """The conversation once a turn ran through /v1/completions after the first `kept_tokens` tokens
    of the stream: its messages up to the last model turn those tokens still hold, then the mark
    later chat requests break at."""
    last = next((i for i in range(len(log) - 1, -1, -1) if log[i].is_model_turn and log[i].end <= kept_tokens), -1)
    return [*log[: last + 1], LoggedMessage(COMPLETIONS_KEY)]


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What to send for the next turn: segments to append, after `keep_tokens` tokens of the stream
    when the history broke (None: after the whole stream)."""

    pieces: list[Piece]
    keep_tokens: int | None
    kept: list[LoggedMessage]
    """The conversation the new turn continues (without the request's new messages)."""
    new_messages: list[LoggedMessage]
    cause: str = ""
    """Why the history broke (one of BREAK_CAUSES); "" when the request extends it."""
    differs_at: int = 0
    """Where it broke: the index of the first message that differs from the session's history."""


def plan_turn(log: Sequence[LoggedMessage], messages: Sequence[Mapping[str, Any]], turns: ChatTurns) -> TurnPlan:
    """Matches `messages` against `log`. Only messages after the last model turn both agree on are
    rendered; everything before it is reused token for token."""
    if not messages:
        raise ConversationError("messages is empty")
    if messages[-1].get("role") == "assistant":
        raise ConversationError("the last message is the assistant's: the model's next turn is what is asked for")
    keys = []
    for index, message in enumerate(messages):
        try:
            keys.append(message_key(message))
        except (ConversationError, RenderError) as exc:
            raise ConversationError(f"messages[{index}]: {exc}") from exc
    agreed = 0
    while agreed < min(len(log), len(keys)) and same_message(log[agreed], keys[agreed], messages[agreed]):
        agreed += 1
    last_model = next((i for i in range(agreed - 1, -1, -1) if log[i].is_model_turn), None)
    edited = agreed < len(log)
    if last_model is None:
        pieces = turns.first(messages)
        kept: list[LoggedMessage] = []
        start = 0
    else:
        if last_model == len(keys) - 1:
            raise ConversationError("no new message after the assistant's last turn")
        model = log[last_model]
        pieces = turns.after_model(messages[: last_model + 1], model.stop_text, messages[last_model + 1 :])
        kept = list(log[: last_model + 1])
        start = last_model + 1
    keep_tokens = (kept[-1].end if kept else 0) if edited else None
    cause = break_cause(log, keys, messages, agreed) if edited else ""
    return TurnPlan(pieces, keep_tokens, kept, [LoggedMessage(k) for k in keys[start:]], cause, agreed)


def describe_break(plan: TurnPlan, messages: Sequence[Mapping[str, Any]]) -> str:
    """The break a request makes, for a refusal: where the history first differs, and why."""
    at = plan.differs_at
    if at < len(messages):
        return f"messages[{at}] ({messages[at].get('role')!s}) differs from the session's history ({plan.cause})"
    return f"the request's {at} messages end where the session's history goes on ({plan.cause})"
