"""Turns rollout groups into padded training tensors and scores policy log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class TrainingSample:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    """Log-probabilities the rollout engine sampled with (after temperature)."""
    advantage: float
    temperature: float = 1.0
    """The temperature the sample was drawn at (its task's): logprobs are compared at it."""
    token_rewards: list[float] | None = None
    """Per-token rewards from the task, added to the sample's advantage token by token."""
    reference_logprobs: list[float] | None = None
    """Per response token, the frozen reference's log-probability at the sample's temperature,
    when the reference runs in its own process (`reference.py`); None: the trainer computes them."""
    reward: float = 0.0
    """The sample's reward (shaped): a critic's return counts it on the last trained response token."""
    response_mask: list[float] | None = None
    """Per response token, 1 where it is trained (a multi-turn trajectory's model tokens) and 0 where
    it is context (environment and template tokens); None trains every response token."""
    token_turns: list[int] | None = None
    """Multi-turn: per response token, the turn of a model token (-1 for context)."""
    token_advantages: list[float] | None = None
    """Per response token, its advantage (per-turn credit: each turn's from its group); when set it
    replaces `advantage`."""
    sample_id: str = ""
    """Which sample it is (`<batch>/<prompt>/<index>`, a session's id for a trajectory's part), for
    errors that must name it."""


@dataclass(slots=True)
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    """[B, L-1]: 1 where position i predicts a response token."""
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    """[B, L-1]: each response token's advantage (the sample's, plus its token reward if any)."""
    temperatures: torch.Tensor
    """[B]"""
    reference_logprobs: torch.Tensor | None = None
    """[B, L-1]: the samples' reference log-probabilities, if every sample carries them."""
    rewards: torch.Tensor | None = None
    """[B, L-1]: each response token's reward: its token reward, plus the sample's reward on the last one."""

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(*(None if t is None else t.to(device) for t in (getattr(self, f.name) for f in fields(self))))


def build_micro_batch(samples: list[TrainingSample], pad_id: int) -> MicroBatch:
    rows = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width - 1))
    behaviour = torch.zeros((len(rows), width - 1))
    advantages = torch.zeros((len(rows), width - 1))
    rewards = torch.zeros((len(rows), width - 1))
    given = all(s.reference_logprobs is not None for s in samples)
    reference = torch.zeros((len(rows), width - 1)) if given else None
    for i, (sample, row) in enumerate(zip(samples, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        start = len(sample.prompt_ids) - 1
        end = start + len(sample.response_ids)
        if sample.response_mask is None:
            response_mask[i, start:end] = 1
            last = end - 1
        else:
            response_mask[i, start:end] = torch.tensor(sample.response_mask)
            last = start + max(k for k, trained in enumerate(sample.response_mask) if trained)
        behaviour[i, start:end] = torch.tensor(sample.behaviour_logprobs)
        if sample.token_advantages is not None:
            advantages[i, start:end] = torch.tensor(sample.token_advantages)
        else:
            advantages[i, start:end] = sample.advantage
        if sample.token_rewards is not None:
            advantages[i, start:end] += torch.tensor(sample.token_rewards)
            rewards[i, start:end] = torch.tensor(sample.token_rewards)
        rewards[i, last] += sample.reward
        if reference is not None:
            reference[i, start:end] = torch.tensor(sample.reference_logprobs)
    temperatures = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
    return MicroBatch(input_ids, attention, response_mask, behaviour, advantages, temperatures, reference, rewards)


def token_logprobs(model: torch.nn.Module, batch: MicroBatch, temperature: float | None = None) -> torch.Tensor:
    """[B, L-1] log-probability of each next token under `model` at each sample's temperature
    (or at `temperature` for every sample)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    scale = batch.temperatures[:, None, None].to(logits.device) if temperature is None else temperature
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
