"""What an engine decodes when called directly (no server): one request's tokens, logprobs and
versions, or a list of prompts' decoded greedily."""

from __future__ import annotations

import asyncio

from services.rollout.engine import EngineRequest, Sampling


async def engine_output(engine, request) -> tuple[list[int], list[float], list[int], object]:
    """(tokens, logprobs, weight versions, last finish) of one request run on an engine directly."""
    tokens, logprobs, versions, finish = [], [], [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        finish = chunk.finish
    return tokens, logprobs, versions, finish


async def greedy_outputs(engine, prompts, tag) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, weight versions) of each prompt decoded greedily, all at once, on an engine directly."""
    outputs = await asyncio.gather(
        *[
            engine_output(engine, EngineRequest(f"{tag}-{i}", p, Sampling(temperature=0, max_tokens=16)))
            for i, p in enumerate(prompts)
        ]
    )
    return [(tokens, logprobs, versions) for tokens, logprobs, versions, _ in outputs]
