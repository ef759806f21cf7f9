"""The model's tool-call syntax read into OpenAI `tool_calls`: the Hermes / Qwen form, a JSON object
{"name", "arguments"} between <tool_call> and </tool_call>, used by the Qwen2 family and the tiny chat model."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text, as OpenAI carries it."""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    content: str
    """The text outside the tool calls."""
    tool_calls: list[ToolCall]
    malformed: int
    """<tool_call> blocks that did not hold a JSON object with a name."""


def parse_tool_calls(text: str, call_id_prefix: str = "call") -> ParsedTurn:
    """The turn's tool calls in order and its remaining text. A call's id is derived from its
    position and text, so the same turn parsed again gets the same ids."""
    calls: list[ToolCall] = []
    malformed = 0
    for index, match in enumerate(_CALL.finditer(text)):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            malformed += 1
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            malformed += 1
            continue
        arguments = body.get("arguments", {})
        arguments_text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        digest = hashlib.blake2b(f"{index}:{match.group(0)}".encode(), digest_size=6).hexdigest()
        calls.append(ToolCall(f"{call_id_prefix}_{digest}", body["name"], arguments_text))
    content = _CALL.sub("", text).strip() if calls or malformed else text
    return ParsedTurn(content, calls, malformed)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """How the model writes a call (what a warm-up teaches it)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
