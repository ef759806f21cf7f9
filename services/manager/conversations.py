"""A session's conversation as a harness sees it: the messages so far, each model turn with where it
ends in the token stream. A request's messages are matched against it: a strict extension appends
only the new messages after the model's exact tokens; an edited history starts a new part at the
last model turn both agree on."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlmesh.chat_turns import ChatTurns, Piece, content_text
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

    @property
    def is_model_turn(self) -> bool:
        return self.end > 0


def conversation_to_proto(messages: Sequence[LoggedMessage]) -> list[manager_pb2.ConversationMessage]:
    return [manager_pb2.ConversationMessage(match_key=m.key, end=m.end, stop_text=m.stop_text) for m in messages]


def conversation_from_proto(messages: Sequence[manager_pb2.ConversationMessage]) -> list[LoggedMessage]:
    return [LoggedMessage(m.match_key, m.end, m.stop_text) for m in messages]


KEYS_CACHED = 16_384
KEY_CACHE_MAX_CHARS = 4_096
"""Keys of messages without tool calls and up to this many characters are kept: a harness sends the
whole conversation with every turn, so each earlier message comes back once per turn."""


def message_key(message: Mapping[str, Any]) -> str:
    role, text, call_id = message.get("role"), content_text(message), message.get("tool_call_id") or ""
    if message.get("tool_calls"):
        calls = [{"name": c.get("function", {}).get("name"), "arguments": _canonical(c.get("function", {}).get("arguments"))}
                 for c in message["tool_calls"]]
        return _digest(role, text, calls, call_id)
    if len(text) <= KEY_CACHE_MAX_CHARS and (role is None or isinstance(role, str)) and isinstance(call_id, str):
        return _plain_key(role, text, call_id)
    return _digest(role, text, [], call_id)


def _digest(role: Any, text: str, calls: list[dict[str, Any]], call_id: Any) -> str:
    canonical = json.dumps([role, text, calls, call_id])
    # A digest: the session's record travels with every turn and is journaled, whatever the messages' length.
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


@functools.lru_cache(maxsize=KEYS_CACHED)
def _plain_key(role: str | None, text: str, call_id: str) -> str:
    return _digest(role, text, [], call_id)


def _canonical(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What to send for the next turn: segments to append, after `keep_tokens` tokens of the stream
    when the history was edited (None: after the whole stream)."""

    pieces: list[Piece]
    keep_tokens: int | None
    kept: list[LoggedMessage]
    """The conversation the new turn continues (without the request's new messages)."""
    new_messages: list[LoggedMessage]


def plan_turn(log: Sequence[LoggedMessage], messages: Sequence[Mapping[str, Any]], turns: ChatTurns) -> TurnPlan:
    """Matches `messages` against `log`. Only messages after the last model turn both agree on are
    rendered; everything before it is reused token for token."""
    if not messages:
        raise ConversationError("messages is empty")
    if messages[-1].get("role") == "assistant":
        raise ConversationError("the last message is the assistant's: the model's next turn is what is asked for")
    keys = [message_key(m) for m in messages]
    agreed = 0
    while agreed < min(len(log), len(keys)) and log[agreed].key == keys[agreed]:
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
        pieces = turns.after_model(messages[:last_model + 1], model.stop_text, messages[last_model + 1:])
        kept = list(log[:last_model + 1])
        start = last_model + 1
    keep_tokens = (kept[-1].end if kept else 0) if edited else None
    return TurnPlan(pieces, keep_tokens, kept, [LoggedMessage(k) for k in keys[start:]])
