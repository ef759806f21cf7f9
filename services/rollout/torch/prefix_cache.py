"""The torch engine's side of the per-session prefix cache: which finished turns' KV caches the ranks
keep (by cache key, the tokens each covers and the version that computed it), within a memory bound,
least recently kept first out. The ranks hold the tensors (rank.py's save_prefix, drop_prefix and
prefill_prefixed); every decision is made here and replayed by all of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Prefix:
    token_ids: list[int]
    version: int
    nbytes: int


class PrefixCache:
    def __init__(self, budget_bytes: int, bytes_per_token: int, run: Callable[..., Any]) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.run = run
        """Runs a step operation on every rank (the tensor-parallel group's `run`)."""
        self.entries: dict[str, _Prefix] = {}
        self.hits = 0
        self.tokens_reused = 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def keep(self, key: str, covered: list[int], version: int, row: int, computed_by: int | None) -> None:
        """Keeps the KV cache of the batch's `row` (a finished turn, covering `covered`) under `key`
        and the served `version`, only if that version computed all of it (`computed_by`, None when
        several did): a turn decoded on through a switch leaves nothing, and its key's older entry goes."""
        if computed_by != version:
            self.forget(key)
            return
        nbytes = len(covered) * self.bytes_per_token
        if not self.budget_bytes or nbytes > self.budget_bytes:
            return
        self.forget(key)
        while self.entries and sum(p.nbytes for p in self.entries.values()) + nbytes > self.budget_bytes:
            self.forget(next(iter(self.entries)))
        self.run("save_prefix", key, row)
        self.entries[key] = _Prefix(covered, version, nbytes)

    def take(self, key: str, context: list[int], version: int) -> int | None:
        """The tokens a request of `key` with this context may skip (its kept prefix, then handed
        to the request's prefill), or None when nothing kept serves it: only an entry computed by
        the served `version` does."""
        prefix = self.entries.get(key) if key else None
        if (
            prefix is None
            or prefix.version != version
            or len(context) <= len(prefix.token_ids)
            or context[: len(prefix.token_ids)] != prefix.token_ids
        ):
            return None
        del self.entries[key]
        self.hits += 1
        self.tokens_reused += len(prefix.token_ids)
        return len(prefix.token_ids)

    def forget(self, key: str) -> None:
        if self.entries.pop(key, None) is not None:
            self.run("drop_prefix", key)

    def clear(self) -> None:
        """Drops every kept cache (the weights switched: they were computed by the old ones)."""
        if self.entries:
            self.run("drop_prefix", None)
            self.entries.clear()
