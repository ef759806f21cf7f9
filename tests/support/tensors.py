"""Weights as named tensors: a model folder's scaled or perturbed, and a sharded model's gathered whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from rlmesh.models.loading import load_causal_lm, trainable_tensors


def scaled_weights(model_dir, factor: float) -> dict[str, torch.Tensor]:
    return {name: tensor * factor for name, tensor in trainable_tensors(load_causal_lm(model_dir)).items()}


def perturbed_weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t * (1 + 0.1 * torch.randn(t.shape, generator=generator)) for name, t in base.items()}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of `model` as a whole tensor (DTensor shards gathered), detached and copied."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
