"""Policy losses, registered by name: each turns a micro-batch's log-probabilities and per-token
advantages into per-token losses (`TokenLoss`); `policy_loss` adds the KL penalty, aggregates
them and measures the figures every loss reports. Pure tensor functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.trainer.algorithms.registry import Registry


@dataclass(frozen=True, slots=True)
class LossInputs:
    """What a policy loss sees, every tensor [sequences, tokens]."""

    logprobs: torch.Tensor
    """The policy being trained (with gradient)."""
    behaviour_logprobs: torch.Tensor
    """The policy the rollout engine sampled with."""
    proximal_logprobs: torch.Tensor
    """The policy at the start of the training step (detached)."""
    advantages: torch.Tensor
    clip_low: float
    clip_high: float
    importance_cap: float
    """Bound on w = pi_prox / pi_behav."""
    cap_mode: str
    """What a weighted loss does with a token whose w exceeds importance_cap: truncate or drop."""


@dataclass(frozen=True, slots=True)
class TokenLoss:
    loss: torch.Tensor
    """Per token, before masking and aggregation."""
    ratio: torch.Tensor
    """The ratio the loss clips: tokens whose ratio lies outside the clip range count as clipped."""


PolicyLoss = Callable[[LossInputs], TokenLoss]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """PPO's pessimistic objective, as a loss: -min(r A, clip(r) A)."""
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)


@POLICY_LOSSES.register("ppo")
def ppo(inputs: LossInputs) -> TokenLoss:
    """The clip against the behaviour policy that sampled: r = pi / pi_behav. Right when rollouts
    are on-policy (max_staleness 0) and the engine's numerics match the trainer's."""
    ratio = (inputs.logprobs - inputs.behaviour_logprobs).exp()
    return TokenLoss(clipped_surrogate(ratio, inputs.advantages, inputs.clip_low, inputs.clip_high), ratio)


def importance_weight(inputs: LossInputs, drop: bool) -> torch.Tensor:
    """w = pi_prox / pi_behav, truncated at importance_cap, or 0 past it with `drop`."""
    weight = (inputs.proximal_logprobs - inputs.behaviour_logprobs).exp()
    if drop:
        return torch.where(weight > inputs.importance_cap, torch.zeros_like(weight), weight)
    return weight.clamp(max=inputs.importance_cap)


def proximal_surrogate(inputs: LossInputs, weight: torch.Tensor) -> TokenLoss:
    """The clip anchored on the proximal policy, r = pi / pi_prox, each token weighted by `weight`."""
    ratio = (inputs.logprobs - inputs.proximal_logprobs).exp()
    return TokenLoss(weight * clipped_surrogate(ratio, inputs.advantages, inputs.clip_low, inputs.clip_high), ratio)


@POLICY_LOSSES.register("decoupled")
def decoupled(inputs: LossInputs) -> TokenLoss:
    """AReaL's decoupled PPO, for stale rollouts (max_staleness >= 1): the trust region is around
    the policy at the step's start rather than the stale sampler, and the off-policy gap is
    corrected by w. Truncating w keeps the signal of the tokens the policy moved furthest towards
    since they were sampled, with their weight bounded; dropping them (AReaL's code) treats them as noise."""
    if inputs.cap_mode not in ("truncate", "drop"):
        raise ValueError(f"unknown importance cap mode {inputs.cap_mode!r}: expected truncate or drop")
    return proximal_surrogate(inputs, importance_weight(inputs, drop=inputs.cap_mode == "drop"))


@POLICY_LOSSES.register("tis")
def tis(inputs: LossInputs) -> TokenLoss:
    """Token-level truncated importance sampling (as in verl), for on-policy runs whose engine
    computes probabilities differently from the trainer: at max_staleness 0 pi_prox is the
    trainer's own recomputation of the sampler, so w is exactly the engine/trainer mismatch."""
    return proximal_surrogate(inputs, importance_weight(inputs, drop=False))


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative estimate of KL(policy || reference), from tokens sampled
    by the policy whose `logprobs` are given."""
    log_ratio = reference_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1


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
    nonfinite_rows: tuple[int, ...] = ()
    """The sequences whose loss is not finite (a NaN or infinite input): their step must be refused."""


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: str = "ppo",
    proximal_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance_cap: float = 2.0,
    cap_mode: str = "truncate",
    aggregation: str = "sequence-mean",
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossTotals]:
    """The micro-batch's loss (the registered policy loss named `loss`) as an unnormalised sum
    (see `LossTotals.count` for what the mini-batch's sum is divided by) and its figures.

    `proximal_logprobs=None` means the proximal policy is the current one (no optimizer step yet in
    this training step): its log-probabilities are `logprobs`, detached. Under `ppo` the
    importance figures describe w = pi_prox / pi_behav but the loss ignores it; w is a constant
    (no gradient flows through it) in every loss.

    Aggregation: `sequence-mean` sums each sequence's token mean (count = sequences), so the
    mini-batch loss is the mean of per-sequence means; `token-mean` (DAPO) sums every token's loss
    (count = tokens), so long sequences weigh by their length.

    logprobs, behaviour_logprobs, proximal_logprobs, reference_logprobs, mask: [sequences, tokens];
    advantages: [sequences] (one per sequence) or [sequences, tokens] (one per token). A k3 KL
    penalty to the reference, weighted by kl_coef, is added to every token's loss."""
    compute = POLICY_LOSSES.get(loss)
    mask = mask.to(logprobs.dtype)
    proximal = (logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    token = compute(
        LossInputs(logprobs, behaviour_logprobs, proximal, adv, clip_low, clip_high, importance_cap, cap_mode)
    )
    token_loss = token.loss
    if reference_logprobs is not None and kl_coef > 0:
        token_loss = token_loss + kl_coef * k3_kl(logprobs, reference_logprobs)
    lengths = mask.sum(dim=-1)
    row_losses = masked(token_loss, mask).sum(dim=-1)
    if aggregation == "sequence-mean":
        total = (row_losses / lengths.clamp(min=1)).sum()
        count = torch.tensor(float(mask.shape[0]), device=mask.device)
    elif aggregation == "token-mean":
        total = row_losses.sum()
        count = lengths.sum()
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}: expected sequence-mean or token-mean")
    with torch.no_grad():
        raw_weight = (proximal - behaviour_logprobs).exp()
        over_cap = raw_weight > importance_cap
        kl_anchor = reference_logprobs if reference_logprobs is not None else behaviour_logprobs
        was_clipped = ((token.ratio - token.ratio.clamp(1 - clip_low, 1 + clip_high)).abs() > 1e-8).to(mask.dtype)
        # Weights are positive: 0 stands for "no response token" and never exceeds a real one.
        masked_weights = torch.where(mask > 0, raw_weight, torch.zeros_like(raw_weight))
        weight_max = masked_weights.max() if masked_weights.numel() else masked_weights.new_zeros(())
        # One transfer of every figure: on a GPU each float() would wait for the device on its own.
        figures = torch.cat(
            [
                torch.stack(
                    [
                        total.detach(),
                        count.to(mask.dtype),
                        mask.sum(),
                        masked(was_clipped, mask).sum(),
                        masked(k3_kl(logprobs, kl_anchor), mask).sum(),
                        masked(raw_weight, mask).sum(),
                        weight_max,
                        masked(over_cap.to(mask.dtype), mask).sum(),
                        masked(k3_kl(behaviour_logprobs, proximal), mask).sum(),
                    ]
                ),
                (~torch.isfinite(row_losses.detach())).to(mask.dtype),
            ]
        ).tolist()
        (
            loss_sum,
            count_value,
            tokens,
            clipped_tokens,
            kl,
            importance_weight_sum,
            importance_weight_max,
            capped_tokens,
            behaviour_kl,
        ) = figures[:9]
        totals = LossTotals(
            loss=loss_sum,
            count=count_value,
            tokens=tokens,
            clipped_tokens=clipped_tokens,
            kl=kl,
            importance_weight=importance_weight_sum,
            importance_weight_max=importance_weight_max,
            capped_tokens=capped_tokens,
            behaviour_kl=behaviour_kl,
            nonfinite_rows=tuple(row for row, flag in enumerate(figures[9:]) if flag),
        )
    return total, totals


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` weighted by `mask`, 0 off it whatever they hold there (0 times an infinity would be NaN)."""
    return torch.where(mask > 0, values * mask, torch.zeros_like(values))


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """The critic's loss summed over the masked tokens: half the larger squared error of the value
    and of the value kept within `clip` of `old_values` (PPO's value clipping: one update moves a
    value at most that far from where the step started, as the policy's ratio clip does)."""
    kept = old_values + (values - old_values).clamp(-clip, clip)
    errors = torch.maximum((values - returns) ** 2, (kept - returns) ** 2)
    return 0.5 * (errors * mask).sum()
