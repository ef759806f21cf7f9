"""The optimizer step of a sharded model whose gradients were summed, unnormalised, over a
mini-batch's micro-batches and the ranks' shares (the policy's and the critic's alike), and the
refusal of a step whose loss or gradient is not finite."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

NAMED_SAMPLES = 16
"""At most this many samples are named in an error; the rest are counted."""


class NonFiniteUpdate(RuntimeError):
    """A loss or gradient that is not finite: the optimizer step is refused, its gradients cleared."""


def sample_names(names: Sequence[str]) -> str:
    """The samples an error is about, the first NAMED_SAMPLES of them by name."""
    shown = ", ".join(names[:NAMED_SAMPLES])
    return shown + (f" and {len(names) - NAMED_SAMPLES} more" if len(names) > NAMED_SAMPLES else "")


def clipped_norm(model: torch.nn.Module, count: float, max_grad_norm: float) -> float:
    """Divides the accumulated gradients by the mini-batch's size `count` (gradients are linear:
    exact) and clips their norm over every rank's shards; returns the norm before clipping (the
    same on every rank, so every rank decides alike whether it is finite)."""
    if count > 1:
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(count)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def mini_batch_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: float, max_grad_norm: float, apply: bool = True
) -> float:
    """`clipped_norm`, then a step unless `apply` is False, then clears; returns the norm before
    clipping. A norm that is not finite never reaches the optimizer: the gradients are cleared
    and NonFiniteUpdate raised."""
    norm = clipped_norm(model, count, max_grad_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteUpdate(f"the gradient norm is {norm}, not finite: the optimizer step is refused")
    if apply:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
