"""Loading HF-format causal LMs from a local folder, and writing named tensors into a model."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlmesh.transfer.payload import name_mismatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_causal_lm(directory: str | Path) -> PreTrainedModel:
    """A float32 model on CPU in eval mode; fails with a clear message if the folder is not a model."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} holds no config.json: not a HF-format model folder")
    # Imported here: transformers' modeling code costs seconds to import, and processes that
    # read only configs and weights (a synthetic rollout engine) never build a model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    return model


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, tied ones once: what a weight version must carry."""
    return {name: param.detach() for name, param in model.named_parameters()}


@torch.no_grad()
def copy_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrites every parameter of `model` from `tensors`; the names must match exactly."""
    params = dict(model.named_parameters())
    mismatch = name_mismatch(params, tensors)
    if mismatch:
        raise ValueError(f"weight names do not match the model: {mismatch}")
    for name, tensor in tensors.items():
        target = params[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
        target.copy_(tensor)


def weights_dtype(config) -> torch.dtype:
    """The dtype a model folder's weights are stored and served in (float32 when unstated)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def serving_config(directory: str | Path, dtype: torch.dtype | None = None):
    """A model folder's config, with `dtype` (when given) as the dtype its weights are served in."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    if dtype is not None:
        config.dtype = dtype
    return config


def load_weights(directory: str | Path, names: Collection[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a folder's safetensors files, in their stored dtype, without building a
    model (a tied lm_head that the files also carry is left out when not asked for)."""
    from safetensors import safe_open

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name in names:
                    tensors[name] = handle.get_tensor(name)
    missing = sorted(set(names) - tensors.keys())
    if missing:
        raise ValueError(f"{directory}: weights {missing[:5]} are missing")
    return tensors
