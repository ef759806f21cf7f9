"""Renders a conversation into a session's token stream turn by turn: the messages an environment or
harness adds become environment segments and whatever the chat template puts around them template
segments, appended after the model's own tokens, which are never rendered or tokenized again."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENVIRONMENT, TEMPLATE = "environment", "template"
_SENTINEL = "\x00rlmesh-assistant-turn\x00"


def _placeholder(index: int) -> str:
    return f"\x00rlmesh-content-{index}\x00"


class RenderError(ValueError):
    """The chat template cannot render these messages as a continuation of the stream."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens of one source: `environment` (message content) or `template`."""

    source: str
    token_ids: list[int]


def content_text(message: Mapping[str, Any]) -> str:
    """A message's content as text (OpenAI's list of parts joined)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise RenderError(f"a {message.get('role', '?')} message's content must be text or a list of text parts")


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to token ids without special tokens. A fast tokenizer's own encoder gives the same ids
    at a third of the cost of transformers' wrapper around it, which a gateway turn pays for every
    piece it renders."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def caching_encoder(encode: Callable[[str], list[int]], entries: int = 4096, max_chars: int = 256) -> Callable[[str], list[int]]:
    """`encode` keeping the ids of short texts: the template's pieces between messages and the
    messages harnesses repeat come back every turn, and tokenizing them again would give the same ids."""
    cached = functools.lru_cache(maxsize=entries)(lambda text: tuple(encode(text)))
    return lambda text: list(cached(text)) if len(text) <= max_chars else encode(text)


class ChatTurns:
    """One tokenizer's chat template, rendering what goes between the model's turns."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the model's tokenizer has no chat template: multi-turn sessions render messages with it")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._encode_text = encode or text_encoder(tokenizer)

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, add_generation_prompt=generation_prompt,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
            raise RenderError(f"the chat template cannot render these messages: {exc}") from exc

    def _pieces(self, messages: Sequence[Mapping[str, Any]], render) -> list[Piece]:
        """The rendering of `messages` (by `render`) cut at each message's content into template
        and environment pieces, each tokenized on its own: a later turn appends tokens, so no
        boundary is ever tokenized again. The contents are rendered as placeholders, so no template
        text is mistaken for content."""
        contents = [content_text(m) for m in messages]
        marked = [{**m, "content": _placeholder(i)} if contents[i] else dict(m) for i, m in enumerate(messages)]
        text = render(marked)
        pieces: list[Piece] = []
        position = 0
        for index, content in enumerate(contents):
            if not content:
                continue
            found = text.find(_placeholder(index), position)
            if found < 0:
                raise RenderError(f"the chat template dropped or changed a {messages[index].get('role', '?')} message's content")
            pieces.append(Piece(TEMPLATE, self._encode(text[position:found])))
            pieces.append(Piece(ENVIRONMENT, self._encode(content)))
            position = found + len(_placeholder(index))
        pieces.append(Piece(TEMPLATE, self._encode(text[position:])))
        return [p for p in pieces if p.token_ids]

    def _encode(self, text: str) -> list[int]:
        return self._encode_text(text) if text else []

    def first(self, messages: Sequence[Mapping[str, Any]]) -> list[Piece]:
        """The stream that opens a session: the messages and the generation prompt."""
        if not messages:
            raise RenderError("a session's first turn needs at least one message")
        return self._pieces(messages, lambda marked: self._render(marked, True))

    def after_model(self, history: Sequence[Mapping[str, Any]], stop_text: str, messages: Sequence[Mapping[str, Any]]) -> list[Piece]:
        """What follows the model's last turn: the end of its turn the model did not write itself,
        the new messages and the next generation prompt. `history` is the conversation so far
        ending with the model's turn; `stop_text` what its last tokens already said of the
        template's end of turn (its stop token's text, or "" when it was cut at max_tokens)."""
        if not messages:
            raise RenderError("a turn needs at least one new message after the model's")
        earlier = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]

        def rest(marked: list[dict[str, Any]]) -> str:
            text = self._render([*earlier, *marked], True)
            after = text.rfind(_SENTINEL)
            if after < 0:
                raise RenderError("the chat template dropped the assistant's turn")
            tail = text[after + len(_SENTINEL):]
            return tail[len(stop_text):] if stop_text and tail.startswith(stop_text) else tail

        return self._pieces(messages, rest)
