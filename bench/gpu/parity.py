"""Parity of the torch engine with HF transformers on the same device and weights: greedy tokens
against `generate`, and the engine's logprobs against a teacher-forced HF forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from services.rollout.engine import EngineRequest, Sampling
from services.rollout.torch.engine import TorchEngine

FP32_LOGPROB_TOLERANCE = 1e-4
"""Largest |engine - HF| logprob allowed in fp32 (the issue's bound)."""


async def _collect(engine: TorchEngine, request: EngineRequest) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


async def _engine_runs(
    model_dir: Path, device: str, dtype: str, prompts: list[list[int]], max_tokens: int, eos: int
) -> tuple[list, list]:
    """Each prompt alone (batch 1), then all prompts in one batch (left-padded, continuous batching)."""
    engine = TorchEngine(model_dir, max_batch_size=len(prompts), device=device, dtype=dtype)
    await engine.start()
    try:

        def request(i: int, prompt: list[int]) -> EngineRequest:
            return EngineRequest(
                f"p{i}", prompt, Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=frozenset({eos}))
            )

        alone = [await _collect(engine, request(i, p)) for i, p in enumerate(prompts)]
        batched = await asyncio.gather(*(_collect(engine, request(i, p)) for i, p in enumerate(prompts)))
    finally:
        await engine.stop()
    return alone, list(batched)


@torch.inference_mode()
def _hf_reference(
    model, prompt: list[int], tokens: list[int], max_tokens: int, eos: int, pad: int, device: str
) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for `prompt`, and its logprobs of the engine's `tokens` (one forward)."""
    ids = torch.tensor([prompt], device=device)
    greedy = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )[0, len(prompt) :].tolist()
    full = torch.tensor([prompt + tokens], device=device)
    logits = model(input_ids=full).logits[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device=device)[:, None]).flatten()
    return greedy, chosen.tolist()


def check_parity(model_dir: Path, device: str, prompts: int = 6, max_tokens: int = 32, seed: int = 0) -> dict:
    """Figures per dtype (float32, bfloat16); `holds`: greedy tokens equal HF's at batch 1 in both
    dtypes and every fp32 logprob within FP32_LOGPROB_TOLERANCE."""
    config = AutoConfig.from_pretrained(model_dir)
    eos, pad = int(config.eos_token_id), int(config.pad_token_id)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (prompts,), generator=generator).tolist()
    # Ids of the character tokenizer's printable range, as a real prompt would hold.
    prompt_ids = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in lengths]
    figures: dict = {"prompts": prompts, "max_tokens": max_tokens}
    for dtype in ("float32", "bfloat16"):
        alone, batched = asyncio.run(_engine_runs(model_dir, device, dtype, prompt_ids, max_tokens, eos))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        equal, batched_equal, differences, generated = 0, 0, [], 0
        for prompt, (tokens, logprobs), (batch_tokens, _) in zip(prompt_ids, alone, batched):
            greedy, reference = _hf_reference(model, prompt, tokens, max_tokens, eos, pad, device)
            equal += tokens == greedy[: len(tokens)] and len(tokens) > 0
            batched_equal += batch_tokens == greedy[: len(batch_tokens)]
            differences += [abs(a - b) for a, b in zip(logprobs, reference)]
            generated += len(tokens)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        figures[dtype] = {
            "greedy_equal_alone": equal,
            "greedy_equal_batched": batched_equal,
            "tokens": generated,
            "max_logprob_difference": max(differences),
            "mean_logprob_difference": sum(differences) / len(differences),
        }
    figures["holds"] = (
        figures["float32"]["greedy_equal_alone"] == prompts
        and figures["bfloat16"]["greedy_equal_alone"] == prompts
        and figures["float32"]["max_logprob_difference"] <= FP32_LOGPROB_TOLERANCE
    )
    return figures
