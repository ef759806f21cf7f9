"""Decode steps of the torch engine in the calling process, against a plain HF decode loop with a
KV cache on the same weights and device: what a step costs without the rollout service around it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from services.rollout.engine import EngineRequest, Sampling
from services.rollout.torch.engine import TorchEngine

PROMPT = [5, 6, 7, 8, 9]


async def _engine_rate(model_dir: Path, device: str, batch: int, tokens: int) -> float:
    """Tokens/s of `batch` sampled requests decoded together, after one round to warm up."""
    engine = TorchEngine(model_dir, max_batch_size=batch, device=device)
    await engine.start()

    async def one(request_id: str) -> int:
        request = EngineRequest(request_id, PROMPT, Sampling(temperature=1.0, max_tokens=tokens))
        return sum([len(chunk.token_ids) async for chunk in engine.generate(request)])

    try:
        await asyncio.gather(*(one(f"warm-{i}") for i in range(batch)))
        started = time.perf_counter()
        generated = sum(await asyncio.gather(*(one(f"timed-{i}") for i in range(batch))))
        return generated / (time.perf_counter() - started)
    finally:
        await engine.stop()


@torch.inference_mode()
def _hf_step_seconds(model, device: str, batch: int, tokens: int) -> float:
    """Seconds per greedy step of HF's forward with a growing KV cache (second of two rounds)."""
    ids = torch.tensor([PROMPT] * batch, device=device)
    for _ in range(2):
        cache, mask = DynamicCache(), torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        following = out.logits[:, -1].argmax(-1)
        following.tolist()
        started = time.perf_counter()
        for _ in range(tokens):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
            out = model(
                input_ids=following[:, None],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            following = out.logits[:, -1].argmax(-1)
            following.tolist()
        seconds = (time.perf_counter() - started) / tokens
    return seconds


def measure_engine_steps(model_dir: Path, device: str, batches: list[int], tokens: int) -> dict:
    """Per batch size: the engine's tokens/s and milliseconds per step, and HF's milliseconds per step."""
    figures: dict = {"tokens": tokens}
    for batch in batches:
        rate = asyncio.run(_engine_rate(model_dir, device, batch, tokens))
        figures[str(batch)] = {"engine_tokens_per_second": rate, "engine_step_ms": 1000 * batch / rate}
    # The folder's dtype, as the engine serves it.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    for batch in batches:
        figures[str(batch)]["hf_step_ms"] = 1000 * _hf_step_seconds(model, device, batch, tokens)
    return figures
