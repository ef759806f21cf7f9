"""Held-out evaluation of the policy: mean sampled reward (temperature 1) and greedy exact match."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from rlmesh.tasks.increment import Problem, exact_match, reward


@dataclass(frozen=True, slots=True)
class EvalResult:
    sampled_reward: float
    greedy_reward: float
    exact_match: float


@torch.no_grad()
def evaluate(model, tokenizer: Tokenizer, problems: list[Problem], eos_id: int, pad_id: int,
             max_tokens: int, samples: int, seed: int, synced_gpus: bool = False,
             device: torch.device | None = None) -> EvalResult:
    """`synced_gpus`: the model is sharded over several ranks that all run this evaluation; every
    rank keeps decoding until all are done, so their FSDP collectives stay matched."""
    prompts = [tokenizer.encode(p.prompt).ids for p in problems]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    was_training = model.training
    model.eval()

    def responses(do_sample: bool, repeat: int) -> list[str]:
        outputs = model.generate(
            input_ids=input_ids.repeat(repeat, 1),
            attention_mask=attention.repeat(repeat, 1),
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_p=1.0 if do_sample else None,
            top_k=None,
            max_new_tokens=max_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            synced_gpus=synced_gpus,
        )
        texts = []
        for row in outputs[:, width:].tolist():
            tokens = row[: row.index(eos_id)] if eos_id in row else row
            texts.append(tokenizer.decode([t for t in tokens if t != pad_id]))
        return texts

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        sampled = responses(True, samples)
    greedy = responses(False, 1)
    if was_training:
        model.train()
    answers = [p.answer for p in problems]
    return EvalResult(
        sampled_reward=sum(reward(r, a) for r, a in zip(sampled, answers * samples)) / len(sampled),
        greedy_reward=sum(reward(r, a) for r, a in zip(greedy, answers)) / len(greedy),
        exact_match=sum(exact_match(r, a) for r, a in zip(greedy, answers)) / len(greedy),
    )
