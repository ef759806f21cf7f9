"""The optimizer step of a sharded model whose gradients were summed, unnormalised, over a
mini-batch's micro-batches and the ranks' shares (the policy's and the critic's alike)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def mini_batch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: float, max_grad_norm: float,
                    apply: bool = True) -> float:
    """Divides the accumulated gradients by the mini-batch's size `count` (gradients are linear:
    exact), clips their norm over every rank's shards, steps unless `apply` is False, clears;
    returns the norm before clipping."""
    if count > 1:
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(count)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if apply:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
