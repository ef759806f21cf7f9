"""Whether a rollout engine can serve a model, read from its config.json before anything starts: a
job an engine cannot serve is refused at start instead of failing on its first batch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes vLLM's CPU attention takes (`CPUAttentionBackend.get_supported_head_sizes`
of the vLLM `make setup-vllm` installs; the vLLM engine refuses to start when the two differ)."""


def head_size(config: dict) -> int:
    """A HF config's attention head size: `head_dim` where the family sets it, else the hidden size
    split over the heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def vllm_cpu_refusal(model_dir: str | Path, supported: Sequence[int] = VLLM_CPU_HEAD_SIZES) -> str:
    """Why vLLM on CPU cannot serve this model ("" when it can)."""
    size = head_size(json.loads((Path(model_dir) / "config.json").read_text()))
    if size in supported:
        return ""
    return (
        f"the vllm engine cannot serve {model_dir} on CPU: its attention head size is {size}, and vLLM's CPU attention "
        f"takes head sizes {', '.join(map(str, supported))} only (use the torch engine, or a model with one of those)"
    )
