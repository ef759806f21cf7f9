"""Where and in which dtype the torch engine runs (`engine.device`, `engine.dtype`), checked with a
message naming what is wrong."""

from __future__ import annotations

import torch


def engine_device(device: str, tensor_parallel_size: int) -> torch.device:
    """The device the engine runs on; raises ValueError naming what is wrong when it cannot."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"engine device must be cpu or cuda, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"engine device cuda: torch {torch.__version__} sees no CUDA device on this host")
    if tensor_parallel_size > 1:
        raise ValueError(
            "engine device cuda runs one rank per instance: tensor_parallel_size must be 1 "
            "(tensor-parallel decoding on GPUs is the vLLM engine's)"
        )
    return torch.device("cuda", torch.cuda.current_device())


def serving_dtype(dtype: str) -> torch.dtype | None:
    """The dtype the engine serves in; None: the model folder's."""
    if dtype == "auto":
        return None
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"engine dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return getattr(torch, dtype)
