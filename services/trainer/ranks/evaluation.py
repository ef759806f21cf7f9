"""Held-out generation with the trainer's own policy: sampled and greedy responses to rendered
prompts, as token ids (rank 0 decodes and scores them with the task's reward)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """One task's held-out prompts and how to sample them."""

    prompts: list[list[int]]
    max_tokens: int
    samples: int
    """Sampled responses per prompt (plus one greedy)."""
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True, slots=True)
class EvalResponses:
    sampled: list[list[int]]
    """`samples` rounds over the prompts: response i of round k is at k * len(prompts) + i. Each
    response ends with its stop token if it generated one."""
    greedy: list[list[int]]


@torch.no_grad()
def generate_responses(
    model,
    request: EvalRequest,
    stop_ids: Sequence[int],
    pad_id: int,
    synced_gpus: bool = False,
    device: torch.device | None = None,
) -> EvalResponses:
    """`synced_gpus`: the model is sharded over several ranks that all run this evaluation; every
    rank keeps decoding until all are done, so their FSDP collectives stay matched."""
    prompts = request.prompts
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    was_training = model.training
    model.eval()

    def responses(do_sample: bool, repeat: int) -> list[list[int]]:
        outputs = model.generate(
            input_ids=input_ids.repeat(repeat, 1),
            attention_mask=attention.repeat(repeat, 1),
            do_sample=do_sample,
            temperature=request.temperature if do_sample else None,
            top_p=request.top_p if do_sample else None,
            top_k=None,
            max_new_tokens=request.max_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            synced_gpus=synced_gpus,
        )
        cut = []
        for row in outputs[:, width:].tolist():
            # Up to and including the first stop token, as the rollout engines return a response.
            end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))
            cut.append(row[:end])
        return cut

    with torch.random.fork_rng():
        torch.manual_seed(request.seed)
        sampled = responses(True, request.samples)
    greedy = responses(False, 1)
    if was_training:
        model.train()
    return EvalResponses(sampled, greedy)
