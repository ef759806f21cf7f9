"""Stop strings (OpenAI's `stop`): an engine ends a response at the token with which its text first
contains one, keeping the tokens as sampled; the text shown ends before the stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_STOP_STRINGS = 4
"""As OpenAI's API: up to four."""
MAX_STOP_CHARS = 256
"""The longest stop string: an engine decodes a window of tokens as long as a few times this at every step."""
TOKENS_PER_CHAR = 4
"""The most tokens one character can take (a byte-level tokenizer's four bytes of UTF-8)."""


def stop_problem(stops: Sequence[str]) -> str:
    """What is wrong with these stop strings, or ""."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            return f"a stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(stop)}"
    return ""


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first stop string in it (all of it when there is none)."""
    found = [index for index in (text.find(stop) for stop in stops if stop) if index >= 0]
    return text[: min(found)] if found else text


def without_partial_stop(text: str, stops: Sequence[str]) -> str:
    """What of a response's text so far can be shown: up to a stop string, and without an ending
    that may yet grow into one."""
    text = cut_at_stop(text, stops)
    held = max(
        (size for stop in stops for size in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:size])),
        default=0,
    )
    return text[: len(text) - held]


class StopMatcher:
    """Finds the token with which a response's text first contains one of its stop strings. Checked
    after every token, so only the last tokens' text is decoded: a stop string found there ends
    with the newest token (any earlier one would have been found a token earlier)."""

    __slots__ = ("_decode", "_stops", "_window")

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        # Enough tokens that a stop string never starts at the window's first token, whose text a
        # partial character or a tokenizer's leading-space rule may change.
        self._window = TOKENS_PER_CHAR * max((len(s) for s in self._stops), default=0) + TOKENS_PER_CHAR

    def reached(self, earlier: Sequence[int], recent: Sequence[int]) -> bool:
        """Whether the response's tokens, `earlier` then `recent` (`recent` ending with the newest),
        now contain a stop string."""
        if not self._stops:
            return False
        window = list(recent[-self._window :])
        if len(window) < self._window and earlier:
            window = list(earlier[-(self._window - len(window)) :]) + window
        text = self._decode(window)
        return any(stop in text for stop in self._stops)


def tokenizer_decoder(model_dir: str) -> Callable[[list[int]], str]:
    """A model folder's text decoding with special tokens skipped (the text the gateway shows, and
    what vLLM matches stop strings against). FileNotFoundError when the folder holds no tokenizer."""
    from rlmesh.models.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)
