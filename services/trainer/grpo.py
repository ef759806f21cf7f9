"""GRPO: group-normalised advantages and the PPO-clip token loss against the behaviour policy,
with an optional k3 KL penalty to a frozen reference. Pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / std within each group (rows); a group with equal rewards teaches nothing: 0.
    Computed in float64: rewards a few ulps apart in float32 would otherwise lose their centring."""
    values = rewards.double()
    mean = values.mean(dim=-1, keepdim=True)
    std = values.std(dim=-1, keepdim=True, unbiased=False)
    return torch.where(std > eps, (values - mean) / (std + eps), torch.zeros_like(values)).to(rewards.dtype)


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative estimate of KL(policy || reference)."""
    log_ratio = reference_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1


@dataclass(frozen=True, slots=True)
class LossStats:
    clip_fraction: float
    ratio_mean: float
    kl: float


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
    normaliser: int,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch, scaled so that summing micro-batches of a mini-batch of
    `normaliser` sequences gives the mini-batch mean of per-sequence token means.

    logprobs, behaviour_logprobs, mask: [sequences, tokens]; advantages: [sequences] (one per
    sequence) or [sequences, tokens] (one per token)."""
    mask = mask.to(logprobs.dtype)
    ratio = (logprobs - behaviour_logprobs).exp()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
    token_loss = -torch.minimum(ratio * adv, clipped * adv)
    kl_tokens = (
        k3_kl(logprobs, reference_logprobs) if reference_logprobs is not None else k3_kl(logprobs, behaviour_logprobs)
    ).detach()
    if reference_logprobs is not None and kl_coef > 0:
        penalty = k3_kl(logprobs, reference_logprobs)
        token_loss = token_loss + kl_coef * penalty
    lengths = mask.sum(dim=-1).clamp(min=1)
    sequence_loss = (token_loss * mask).sum(dim=-1) / lengths
    loss = sequence_loss.sum() / normaliser
    tokens = mask.sum().clamp(min=1)
    with torch.no_grad():
        was_clipped = ((ratio - clipped).abs() > 1e-8).to(mask.dtype)
        stats = LossStats(
            clip_fraction=float((was_clipped * mask).sum() / tokens),
            ratio_mean=float((ratio * mask).sum() / tokens),
            kl=float((kl_tokens * mask).sum() / tokens),
        )
    return loss, stats
