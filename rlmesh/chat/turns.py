"""Renders a conversation into a session's token stream turn by turn: the messages an environment or
harness adds become environment segments and whatever the chat template puts around them template
segments, appended after the model's own tokens, which are never rendered or tokenized again."""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer

ENVIRONMENT, TEMPLATE = "environment", "template"
_SENTINEL = "\x00rlmesh-assistant-turn\x00"
ANCHOR = "\x00rlmesh-anchor\x00"
"""An added token put before a run of text so that it is tokenized as text that follows other text:
a section of its own, to which no rule for the start of the input applies (the leading "▁" of a
SentencePiece tokenizer that prepends it to the first section only)."""


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
    """A message's content as text: a string, or OpenAI's list of text parts joined. A part of
    another type (an image, audio) is refused, never dropped: only text is rendered."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text":
                raise RenderError(
                    f"a {message.get('role', '?')} message's content[{index}] is a part of type {kind!r}: "
                    "only text parts are rendered"
                )
            if not isinstance(part.get("text"), str):
                raise RenderError(
                    f"a {message.get('role', '?')} message's content[{index}] is a text part whose text is not a string"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RenderError(f"a {message.get('role', '?')} message's content must be text or a list of text parts")


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to token ids without special tokens. A fast tokenizer's own encoder gives the same ids
    at a third of the cost of transformers' wrapper around it, which a gateway turn pays for every
    piece it renders."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def caching_encoder(
    encode: Callable[[str], list[int]], entries: int = 4096, max_chars: int = 256
) -> Callable[[str], list[int]]:
    """`encode` keeping the ids of short texts: the template's pieces between messages and the
    messages harnesses repeat come back every turn, and tokenizing them again would give the same ids."""
    cached = functools.lru_cache(maxsize=entries)(lambda text: tuple(encode(text)))
    return lambda text: list(cached(text)) if len(text) <= max_chars else encode(text)


class TurnEncoder:
    """Tokenizes what a turn appends the way the tokenizer tokenizes a whole rendered conversation,
    so the model sees the ids it would see at inference: the rendering is cut at the template's
    special tokens, each run of text between two of them (template text and message contents
    together) is tokenized at once, as text that follows other text unless it opens the
    conversation, and its tokens are told apart by their character offsets (a token that straddles
    a content's edge belongs to the content). A content never yields a special token: text that
    spells one (`<|im_end|>` in a tool's output) stays text, so no message forges a role's boundary."""

    def __init__(self, tokenizer: Any, entries: int = 4096, max_cached_chars: int = 256) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._plain: Tokenizer | None = None
        if backend is not None:
            specials = {
                token.content: index for index, token in backend.get_added_tokens_decoder().items() if token.special
            }
            # A copy that reads special tokens' text as text: contents go through it; the template's
            # special tokens are cut out before and keep their ids.
            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.no_truncation()
            self._plain.no_padding()
            self._plain.add_tokens([AddedToken(ANCHOR, special=False, normalized=False)])
            self._plain.encode_special_tokens = True
        else:
            specials = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
        self._special_ids = specials
        self._specials = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) if specials else None
        )
        self._max_cached_chars = max_cached_chars
        self._cached_run = functools.lru_cache(maxsize=entries)(self._run)

    def pieces(self, spans: Sequence[tuple[str, str]], opens: bool) -> list[Piece]:
        """`spans` ((source, text) in order: template text and contents) as pieces; `opens`: they
        begin the conversation's text."""
        pieces: list[Piece] = []
        run: list[tuple[str, str]] = []
        for source, text in spans:
            if source == ENVIRONMENT:
                if ANCHOR in text:
                    raise RenderError(
                        "a message's content holds the text rlmesh marks its tokenization with "
                        "(\\x00rlmesh-anchor\\x00)"
                    )
                run.append((source, text))
                continue
            last = 0
            for match in self._specials.finditer(text) if self._specials else ():
                run.append((TEMPLATE, text[last : match.start()]))
                pieces += self._run_pieces(run, opens)
                opens, run, last = False, [], match.end()
                pieces.append(Piece(TEMPLATE, [self._special_ids[match.group()]]))
            run.append((TEMPLATE, text[last:]))
        pieces += self._run_pieces(run, opens)
        merged: list[Piece] = []
        for piece in pieces:
            if merged and piece.source == TEMPLATE and merged[-1].source == TEMPLATE:
                merged[-1] = Piece(TEMPLATE, merged[-1].token_ids + piece.token_ids)
            else:
                merged.append(piece)
        return merged

    def _run_pieces(self, run: list[tuple[str, str]], opens: bool) -> list[Piece]:
        """One run of text between special tokens, tokenized at once and cut back into its spans."""
        text = "".join(part for _, part in run)
        if not text:
            return []
        if self._plain is None:
            return [
                Piece(
                    source,
                    list(
                        self._tokenizer.encode(
                            part, add_special_tokens=False, split_special_tokens=source == ENVIRONMENT
                        )
                    ),
                )
                for source, part in run
                if part
            ]
        ids, offsets = self._cached_run(text, opens) if len(text) <= self._max_cached_chars else self._run(text, opens)
        if len(run) == 1:
            return [Piece(run[0][0], list(ids))]
        starts = [start for start, _ in offsets]
        cuts = [0]
        for index, boundary in enumerate(itertools.accumulate(len(part) for _, part in run[:-1])):
            cut = bisect.bisect_left(starts, boundary, cuts[-1])
            # A token reaching from template text into a content belongs to the content.
            if (
                cut > cuts[-1]
                and offsets[cut - 1][1] > boundary
                and run[index + 1][0] == ENVIRONMENT
                and run[index][0] != ENVIRONMENT
            ):
                cut -= 1
            cuts.append(cut)
        cuts.append(len(ids))
        return [Piece(source, list(ids[cuts[index] : cuts[index + 1]])) for index, (source, _) in enumerate(run)]

    def _run(self, text: str, opens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        if opens:
            encoding = self._plain.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets
        encoding = self._plain.encode(ANCHOR + text, add_special_tokens=False)
        shift = len(ANCHOR)
        return encoding.ids[1:], [(start - shift, end - shift) for start, end in encoding.offsets[1:]]


class ChatTurns:
    """One tokenizer's chat template, rendering what goes between the model's turns."""

    def __init__(
        self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None, encoder: TurnEncoder | None = None
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the model's tokenizer has no chat template: multi-turn sessions render messages with it")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._encoder = encoder or TurnEncoder(tokenizer)

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
            raise RenderError(f"the chat template cannot render these messages: {exc}") from exc

    def _pieces(self, messages: Sequence[Mapping[str, Any]], render, opens: bool) -> list[Piece]:
        """The rendering of `messages` (by `render`) cut at each message's content into template
        and environment pieces (see TurnEncoder); `opens`: it begins the conversation. The contents
        are rendered as placeholders, so no template text is mistaken for content."""
        contents = [content_text(m) for m in messages]
        marked = [{**m, "content": _placeholder(i) if contents[i] else ""} for i, m in enumerate(messages)]
        text = render(marked)
        spans: list[tuple[str, str]] = []
        position = 0
        for index, content in enumerate(contents):
            if not content:
                continue
            found = text.find(_placeholder(index), position)
            if found < 0:
                raise RenderError(
                    f"the chat template dropped or changed a {messages[index].get('role', '?')} message's content"
                )
            spans += [(TEMPLATE, text[position:found]), (ENVIRONMENT, content)]
            position = found + len(_placeholder(index))
        spans.append((TEMPLATE, text[position:]))
        return [p for p in self._encoder.pieces(spans, opens) if p.token_ids]

    def first(self, messages: Sequence[Mapping[str, Any]]) -> list[Piece]:
        """The stream that opens a session: the messages and the generation prompt."""
        if not messages:
            raise RenderError("a session's first turn needs at least one message")
        return self._pieces(messages, lambda marked: self._render(marked, True), opens=True)

    def after_model(
        self, history: Sequence[Mapping[str, Any]], stop_text: str, messages: Sequence[Mapping[str, Any]]
    ) -> list[Piece]:
        """What follows the model's last turn: the end of its turn the model did not write itself,
        the new messages and the next generation prompt. `history` is the conversation so far
        ending with the model's turn; `stop_text` what its last tokens already said of the
        template's end of turn (its stop token's text, or "" when it was cut at max_tokens)."""
        if not messages:
            raise RenderError("a turn needs at least one new message after the model's")
        # Contents as text (parts joined as a message's key joins them, none as ""): a template takes strings.
        earlier = [
            *(m if isinstance(m.get("content"), str) else {**m, "content": content_text(m)} for m in history[:-1]),
            {"role": "assistant", "content": _SENTINEL},
        ]

        def rest(marked: list[dict[str, Any]]) -> str:
            text = self._render([*earlier, *marked], True)
            after = text.rfind(_SENTINEL)
            if after < 0:
                raise RenderError("the chat template dropped the assistant's turn")
            tail = text[after + len(_SENTINEL) :]
            return tail[len(stop_text) :] if stop_text and tail.startswith(stop_text) else tail

        return self._pieces(messages, rest, opens=False)
