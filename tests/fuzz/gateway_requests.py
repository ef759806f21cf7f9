"""What the gateway fuzzer sends, drawn from a seeded generator: a valid request of one of the
gateway's routes with fields (at any depth) replaced by values of the wrong type, nulls, huge
numbers, deep nesting or odd text, deleted, or added among the options it refuses; or a body broken
at the byte level (truncated JSON, bad UTF-8, not an object, NaN, over the size limit, declared or
streamed); sent with right, wrong or missing keys, other content types and methods, to open, closed,
unknown and malformed session ids, streamed or not."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

OVERSIZE_BYTES = (8 << 20) + 1
"""One byte over the gateway's body limit."""

ODD_TEXT = [
    "",
    " ",
    "x",
    "héllo wörld",
    "🤖" * 3,
    "\u0000",
    "\n\n",
    "<|im_end|>",
    '<tool_call>{"name": 1}</tool_call>',
    "a" * 5000,
    "\\ud800",
    "%00",
    "../..",
    '{"json": true}',
    "Observation:",
    "null",
    "[" * 3000 + "]" * 3000,
    '{"a": 1e999, "b": NaN}',
]
NUMBERS = [
    0,
    -1,
    1,
    2,
    7,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    0.5,
    -0.0,
    1e-320,
    1e38,
    1e39,
    1e308,
]
EXTRA_FIELDS = [
    "n",
    "stop",
    "tool_choice",
    "response_format",
    "logit_bias",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "best_of",
    "echo",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_p",
    "seed",
    "user",
    "max_completion_tokens",
    "functions",
    "parallel_tool_calls",
    "metadata",
    "turn",
    "reward",
    "prompt",
    "messages",
    "tools",
]
CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
]


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    key: str


@dataclass(slots=True)
class Request:
    kind: str
    """What was varied (the report counts answers per kind)."""
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None
    mutated: set[str] = field(default_factory=set)
    """Top-level fields of the body that were changed: a 400 that names a field names one of them."""
    oversize: str = ""
    """"declared" (a Content-Length over the limit, little sent) or "streamed" (chunks past it)."""


def deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for index in range(depth):
        value = [value] if index % 2 else {"a": value}
    return value


class Generator:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def odd_value(self) -> Any:
        rng = self.rng
        choice = rng.randrange(12)
        if choice == 0:
            return None
        if choice == 1:
            return rng.choice([True, False])
        if choice in (2, 3):
            return rng.choice(NUMBERS)
        if choice in (4, 5):
            return rng.choice(ODD_TEXT)
        if choice == 6:
            return rng.choice([[], [None], [1, "a"], [[1, 2], [3]], [{"type": "text", "text": None}], ["a", "b"]])
        if choice == 7:
            return rng.choice(
                [
                    {},
                    {"a": None},
                    {"type": "json_object"},
                    {"type": "text"},
                    {"role": "user"},
                    {"function": None},
                    {"name": 1},
                ]
            )
        if choice == 8:
            return deep(rng.choice([3, 50, 400, 900]))
        if choice == 9:
            return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(1, 6))]
        if choice == 10:
            return rng.choice(["auto", "none", "required", {"type": "function", "function": {"name": "calculator"}}])
        return rng.choice([["Observation:"], ["a", "b", "c", "d", "e"], [""], "\n", ["x" * 300]])

    def valid_body(self, route: str, stream: bool) -> dict[str, Any]:
        rng = self.rng
        if route == "chat":
            messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}]
            if rng.random() < 0.3:
                call = {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
                messages += [
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]},
                ]
            body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 4}
            if rng.random() < 0.3:
                body["tools"] = [
                    {
                        "type": "function",
                        "function": {
                            "name": "calculator",
                            "description": "Computes.",
                            "parameters": {"type": "object", "properties": {}},
                        },
                    }
                ]
        elif route == "text":
            prompt: Any = rng.choice(["Count: 1 2", "Thought: look\nAction:", [5, 6, 7, 8]])
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
            if rng.random() < 0.3:
                body["stop"] = rng.choice(["\n", ["Observation:", "3"]])
        else:
            body = {"reward": rng.choice([0.0, 1.0, -0.5])}
            if rng.random() < 0.5:
                body["turn"] = rng.randrange(3)
        if stream and route != "reward":
            body["stream"] = True
            if route == "chat" and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return body

    def mutate(self, body: dict[str, Any]) -> set[str]:
        """Changes one to three places of `body`; returns the top-level fields changed."""
        rng = self.rng
        touched = set()
        for _ in range(rng.randrange(1, 4)):
            action = rng.randrange(4)
            if action == 0 or not body:
                name = rng.choice(EXTRA_FIELDS)
                body[name] = self.odd_value()
                touched.add(name)
                continue
            top = rng.choice(list(body))
            touched.add(top)
            parent, key = self._somewhere(body, top)
            if action == 1:
                if isinstance(parent, dict):
                    parent.pop(key, None)
                else:
                    parent[key] = self.odd_value()
            else:
                parent[key] = self.odd_value()
        return touched

    def _somewhere(self, body: dict[str, Any], top: str) -> tuple[Any, Any]:
        """A place inside body[top], at a random depth: its container and its key."""
        parent, key = body, top
        while isinstance(parent[key], (dict, list)) and parent[key] and self.rng.random() < 0.7:
            child = parent[key]
            parent, key = (
                child,
                (self.rng.choice(list(child)) if isinstance(child, dict) else self.rng.randrange(len(child))),
            )
        return parent, key

    def request(self, open_sessions: list[Session], closed: list[Session]) -> Request:
        rng = self.rng
        route = rng.choices(["chat", "text", "reward", "models", "health", "nowhere"], [40, 25, 12, 8, 3, 4])[0]
        session = rng.choice(open_sessions)
        kind = "valid"
        # Whose session, named how, with which key.
        naming = rng.choices(["path", "key-in-path", "header", "none"], [70, 12, 14, 4])[0]
        target_id, key = session.session_id, session.key
        who = rng.choices(
            ["own", "wrong-key", "no-key", "closed", "unknown", "malformed", "other-key"], [84, 4, 3, 3, 2, 2, 2]
        )[0]
        if who == "wrong-key":
            key = rng.choice(["wrong", key[:-1] + ("0" if key[-1] != "0" else "1"), "", key.upper(), "k" * 300])
        elif who == "no-key":
            key = ""
        elif who == "closed" and closed:
            target_id, key = rng.choice(closed).session_id, rng.choice(closed).key
        elif who == "unknown":
            target_id = rng.choice(["nobody/p/0", f"fuzz/p/{rng.randrange(10**6)}", "b/p/999999"])
        elif who == "malformed":
            target_id = rng.choice(["", "/", "a" * 3000, "é/ü/🤖", "..", "%2e%2e", "b/p/0/../../x", "a\tb"])
        elif who == "other-key":
            key = rng.choice(open_sessions).key
        if who != "own":
            kind = f"session:{who}"
        quoted = quote(target_id, safe="/")
        base = {
            "path": f"/sessions/{quoted}/v1",
            "key-in-path": f"/sessions/{quoted}/key/{quote(key, safe='') or 'x'}/v1",
            "header": "/v1",
            "none": "/v1",
        }[naming]
        headers: dict[str, str] = {}
        if naming == "header":
            headers["x-rlmesh-session"] = quote(target_id, safe="/")
        if naming != "key-in-path" and key:
            style = rng.choices(["bearer", "header", "basic", "bare"], [90, 6, 2, 2])[0]
            headers.update(
                {
                    "bearer": {"authorization": f"Bearer {key}"},
                    "header": {"x-rlmesh-session-key": key},
                    "basic": {"authorization": f"Basic {key}"},
                    "bare": {"authorization": key},
                }[style]
            )
            if style != "bearer" and style != "header":
                kind = f"auth:{style}"
        stream = rng.random() < 0.3
        method = {"models": "GET", "health": "GET"}.get(route, "POST")
        path = {
            "chat": f"{base}/chat/completions",
            "text": f"{base}/completions",
            "reward": f"{base}/rlmesh/reward",
            "models": f"{base}/models",
            "health": "/healthz",
            "nowhere": rng.choice([f"{base}/embeddings", f"{base}/chat", "/v2/chat/completions", f"{base}/responses"]),
        }[route]
        if rng.random() < 0.04:
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH"] if method == "POST" else ["POST", "DELETE"])
            kind = "method"
        if route in ("models", "health", "nowhere") or method == "GET":
            return Request(kind if route != "nowhere" else "route", method, path, headers, None)
        body = self.valid_body(route, stream)
        mutated: set[str] = set()
        raw: bytes | None = None
        oversize = ""
        shape = rng.choices(["valid", "fields", "bytes", "oversize"], [25, 60, 13, 2])[0]
        if shape == "fields":
            mutated = self.mutate(body)
            kind = "fields" if kind == "valid" else kind
        elif shape == "bytes":
            kind, raw = self._broken(body)
        elif shape == "oversize":
            body["padding"] = "x" * OVERSIZE_BYTES
            oversize = rng.choice(["declared", "streamed"])
            kind = f"oversize:{oversize}"
        if raw is None:
            raw = json.dumps(body, allow_nan=True).encode()
        content_type = "application/json" if rng.random() < 0.85 else rng.choice(CONTENT_TYPES)
        if content_type:
            headers["content-type"] = content_type
        return Request(kind, method, path, headers, raw, mutated, oversize)

    def _broken(self, body: dict[str, Any]) -> tuple[str, bytes]:
        rng = self.rng
        text = json.dumps(body).encode()
        choice = rng.randrange(8)
        if choice == 0:
            return "bytes:truncated", text[: rng.randrange(len(text))]
        if choice == 1:
            return "bytes:bad-utf8", text[:5] + b"\xff\xfe\xc3" + text[5:]
        if choice == 2:
            return "bytes:not-an-object", rng.choice([b"[1, 2]", b"5", b'"x"', b"null", b"true", b"[]"])
        if choice == 3:
            return "bytes:empty", b""
        if choice == 4:
            return "bytes:nan", text[:-1] + b', "reward": NaN, "max_tokens": Infinity}'
        if choice == 5:
            return "bytes:huge-number", text[:-1] + b', "max_tokens": 1' + b"0" * 400 + b"}"
        if choice == 6:
            return "bytes:deep", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        return "bytes:random", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
