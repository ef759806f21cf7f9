"""The torch engine's running sequences: one request's state as it decodes (its tokens, its pending
chunk, its seeded generator) and the batch of them in the row order of every rank's KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlmesh.chat.stop_strings import StopMatcher
from services.rollout.engine import Chunk, ChunkStream, EngineRequest, Finish


@dataclass(slots=True)
class DecodingSequence:
    request: EngineRequest
    stream: ChunkStream
    token_ids: list[int] = field(default_factory=list)
    """The tokens generated here (after the request's continued tokens)."""
    finish: Finish = Finish.NONE
    device: torch.device = torch.device("cpu")
    """Where its generator draws: the engine's device, where sampling runs."""
    stop: StopMatcher | None = None
    """Its stop strings, when it has any."""
    pending: Chunk = field(init=False)
    generator: torch.Generator | None = field(init=False)
    """Own generator only for seeded requests: their tokens then do not depend on batch-mates."""
    kv_version: int | None = None
    """The weight version that computed every entry of its KV cache; None before its prefill, or
    once another version decoded it further (update_mode continue: the weights switched under it)."""

    def __post_init__(self) -> None:
        self.pending = Chunk(self.request.request_id)
        self.restart_generator()

    @property
    def pinned(self) -> bool:
        """Runs on the served version until it ends: the engine switches only after it."""
        return self.request.pinned_version is not None and self.finish is Finish.NONE

    def context(self) -> list[int]:
        """What the KV cache must hold once the sequence is prefilled: prompt and every token so far."""
        return self.request.prompt_token_ids + self.request.continued_token_ids + self.token_ids

    def restart_generator(self) -> None:
        """Seeds the generator as a request continued from every token so far would be: a
        continuation must not replay the random stream of the attempt it continues, and a request
        recomputed here draws what its continuation would draw anywhere."""
        seed = self.request.sampling.seed
        done = len(self.request.continued_token_ids) + len(self.token_ids)
        self.generator = torch.Generator(self.device).manual_seed(seed + done) if seed else None

    def take_chunk(self, finish: Finish = Finish.NONE) -> Chunk:
        self.finish = finish
        self.pending.finish = finish
        chunk, self.pending = self.pending, Chunk(self.request.request_id)
        return chunk


class RunningBatch:
    """The sequences being decoded, in the row order of every rank's KV cache (see KvBatch), and
    the token each feeds next."""

    def __init__(self, device: torch.device) -> None:
        self.rows: list[DecodingSequence] = []
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=device)

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[DecodingSequence], tokens: torch.Tensor) -> None:
        self.rows = self.rows + rows
        self.next_tokens = torch.cat([self.next_tokens, tokens])

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.next_tokens = self.next_tokens[rows]
