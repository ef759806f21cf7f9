"""The model folders the GPU check runs on: random-init Qwen2.5 shapes on a GPU, small ones on the
CPU, written once per run (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlmesh.models.random_init import real_config, scaled_config, write_random_model

QWEN25_1_5B_OVERRIDES = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_window_layers": 28,
}
"""Qwen2.5-1.5B's config.json where it differs from Qwen2.5-0.5B's (tied embeddings in both)."""


def shapes(device: str) -> dict[str, dict]:
    """Config values by name: the real Qwen2.5-0.5B and -1.5B shapes on a GPU; on the CPU two small
    ones of the same family (the second deeper), so every section runs in seconds."""
    if device == "cuda":
        return {"qwen2.5-0.5b": real_config("qwen2"), "qwen2.5-1.5b": {**real_config("qwen2"), **QWEN25_1_5B_OVERRIDES}}
    return {"small": scaled_config("qwen2"), "small-deep": scaled_config("qwen2", num_hidden_layers=4)}


def write_models(root: Path, device: str) -> dict[str, Path]:
    """bf16 folders (as Qwen2.5 ships) of every shape, initialised on `device`."""
    folders = {}
    for name, values in shapes(device).items():
        folder = root / name
        if not (folder / "model.safetensors").is_file():
            write_random_model(folder, values, dtype=torch.bfloat16, device=device)
        folders[name] = folder
    return folders
