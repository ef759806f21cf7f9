"""GRPO: group-normalised advantages, the clipped policy loss in three variants (PPO against the
behaviour policy, AReaL's decoupled PPO, truncated importance sampling), the k3 KL estimate and
DAPO's soft overlong penalty. Pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmesh.settings.trainer import CapMode, LossAggregation, LossKind


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / std within each group (rows); a group with equal rewards teaches nothing: 0.
    Computed in float64: rewards a few ulps apart in float32 would otherwise lose their centring."""
    values = rewards.double()
    mean = values.mean(dim=-1, keepdim=True)
    std = values.std(dim=-1, keepdim=True, unbiased=False)
    return torch.where(std > eps, (values - mean) / (std + eps), torch.zeros_like(values)).to(rewards.dtype)


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative estimate of KL(policy || reference), from tokens sampled
    by the policy whose `logprobs` are given."""
    log_ratio = reference_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1


def overlong_penalty(response_length: int, max_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, added to a sample's reward: 0 up to
    `max_tokens - buffer_tokens` tokens, then falling linearly to `-penalty` at `max_tokens` (and
    staying there). `buffer_tokens == 0` turns it off."""
    if not 0 <= buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens must be in [0, max_tokens = {max_tokens}], got {buffer_tokens}")
    if buffer_tokens == 0:
        return 0.0
    excess = response_length - (max_tokens - buffer_tokens)
    if excess <= 0:
        return 0.0
    return -penalty * min(excess, buffer_tokens) / buffer_tokens


@dataclass(frozen=True, slots=True)
class LossTotals:
    """A micro-batch's figures as sums over its response tokens (or sequences), so that the
    micro-batches of a mini-batch, and the ranks' shares of a micro-batch, simply add up."""

    loss: float
    """The unnormalised loss (per-sequence means summed, or token losses summed)."""
    count: float
    """What the mini-batch's summed loss is divided by: sequences (sequence-mean) or tokens (token-mean)."""
    tokens: float
    clipped_tokens: float
    """Tokens whose ratio to the clip's anchor lies outside [1 - clip_low, 1 + clip_high]."""
    kl: float
    """Summed k3 KL of the policy to the reference (to the behaviour policy without a reference)."""
    importance_weight: float
    """Summed pi_prox / pi_behav, before the cap."""
    importance_weight_max: float
    capped_tokens: float
    """Tokens whose pi_prox / pi_behav exceeds importance_cap (their weight truncated to it, or dropped)."""
    behaviour_kl: float
    """Summed k3 estimate of KL(pi_behav || pi_prox): how far the sampler is from the proximal policy."""


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: LossKind = "ppo",
    proximal_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance_cap: float = 2.0,
    cap_mode: CapMode = "truncate",
    aggregation: LossAggregation = "sequence-mean",
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossTotals]:
    """The micro-batch's loss as an unnormalised sum (see `LossTotals.count` for what the
    mini-batch's sum is divided by) and its figures.

    Three losses; in each, A is the token's advantage and clip(r) = clamp(r, 1 - clip_low, 1 + clip_high):

    - `ppo` (the baseline): -min(r A, clip(r) A) with r = pi / pi_behav, the ratio to the
      policy the rollout engine sampled with. Right when rollouts are on-policy (max_staleness 0)
      and the engine's numerics match the trainer's.
    - `decoupled` (AReaL's decoupled PPO, for stale rollouts, max_staleness >= 1): the clip
      anchors on the proximal policy pi_prox (the policy at the start of the training step), r =
      pi / pi_prox, so the trust region is around recent weights rather than the stale sampler;
      the off-policy gap is corrected by w = pi_prox / pi_behav: -w min(r A, clip(r) A), with w
      truncated at importance_cap (`cap_mode="truncate"`), or the token dropped (w = 0) past the
      cap as AReaL's code does (`cap_mode="drop"`). Truncating keeps the signal of the tokens
      the policy moved furthest towards since they were sampled, negative advantages included,
      with their weight bounded; dropping treats them as noise.
    - `tis` (token-level truncated importance sampling, as in verl: on-policy, max_staleness 0,
      but the engine computes probabilities differently from the trainer, e.g. another kernel or
      precision): the same objective with w always truncated. At max_staleness 0 pi_prox is the
      trainer's own recomputation of the sampling policy, so w is exactly the engine/trainer
      mismatch.

    w is a constant (no gradient flows through it). `proximal_logprobs=None` means the proximal
    policy is the current one (no optimizer step yet in this training step): its log-probabilities
    are `logprobs`, detached. Under `ppo` the importance figures describe that w but the loss
    ignores it.

    Aggregation: `sequence-mean` sums each sequence's token mean (count = sequences), so the
    mini-batch loss is the mean of per-sequence means; `token-mean` (DAPO) sums every token's loss
    (count = tokens), so long sequences weigh by their length.

    logprobs, behaviour_logprobs, proximal_logprobs, reference_logprobs, mask: [sequences, tokens];
    advantages: [sequences] (one per sequence) or [sequences, tokens] (one per token). A k3 KL
    penalty to the reference, weighted by kl_coef, is added to every token's loss."""
    mask = mask.to(logprobs.dtype)
    proximal = (logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    log_weight = proximal - behaviour_logprobs
    raw_weight = log_weight.exp()
    over_cap = raw_weight > importance_cap
    if loss == "ppo":
        anchor, weight = behaviour_logprobs, None
    elif loss in ("decoupled", "tis"):
        if loss == "decoupled" and cap_mode not in ("truncate", "drop"):
            raise ValueError(f"unknown importance cap mode {cap_mode!r}: expected truncate or drop")
        drop = loss == "decoupled" and cap_mode == "drop"
        anchor = proximal
        weight = torch.where(over_cap, torch.zeros_like(raw_weight), raw_weight) if drop else raw_weight.clamp(max=importance_cap)
    else:
        raise ValueError(f"unknown loss {loss!r}: expected ppo, decoupled or tis")
    ratio = (logprobs - anchor).exp()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    token_loss = -torch.minimum(ratio * adv, clipped * adv)
    if weight is not None:
        token_loss = weight * token_loss
    if reference_logprobs is not None and kl_coef > 0:
        token_loss = token_loss + kl_coef * k3_kl(logprobs, reference_logprobs)
    lengths = mask.sum(dim=-1)
    if aggregation == "sequence-mean":
        total = ((token_loss * mask).sum(dim=-1) / lengths.clamp(min=1)).sum()
        count = torch.tensor(float(mask.shape[0]), device=mask.device)
    elif aggregation == "token-mean":
        total = (token_loss * mask).sum()
        count = lengths.sum()
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}: expected sequence-mean or token-mean")
    with torch.no_grad():
        kl_anchor = reference_logprobs if reference_logprobs is not None else behaviour_logprobs
        was_clipped = ((ratio - clipped).abs() > 1e-8).to(mask.dtype)
        # Weights are positive: 0 stands for "no response token" and never exceeds a real one.
        masked_weights = torch.where(mask > 0, raw_weight, torch.zeros_like(raw_weight))
        weight_max = masked_weights.max() if masked_weights.numel() else masked_weights.new_zeros(())
        # One transfer of every figure: on a GPU each float() would wait for the device on its own.
        figures = torch.stack([
            total.detach(), count.to(mask.dtype), mask.sum(), (was_clipped * mask).sum(),
            (k3_kl(logprobs, kl_anchor) * mask).sum(), (raw_weight * mask).sum(), weight_max,
            (over_cap.to(mask.dtype) * mask).sum(), (k3_kl(behaviour_logprobs, proximal) * mask).sum(),
        ]).tolist()
        (loss_sum, count_value, tokens, clipped_tokens, kl, importance_weight, importance_weight_max, capped_tokens,
         behaviour_kl) = figures
        totals = LossTotals(loss=loss_sum, count=count_value, tokens=tokens, clipped_tokens=clipped_tokens, kl=kl,
                            importance_weight=importance_weight, importance_weight_max=importance_weight_max,
                            capped_tokens=capped_tokens, behaviour_kl=behaviour_kl)
    return total, totals
