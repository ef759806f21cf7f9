"""Resumable checkpoints: the policy in HF format (loadable by any engine), the optimizer, the
step and weight version, and RNG state."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

KEEP = 2


@dataclass(slots=True)
class TrainerState:
    step: int
    """Training steps completed."""
    version: int
    """Weight version of the policy: the step plus an offset fixed when a run starts, since a
    run restarted on a mesh that already holds versions must publish above them."""


def save_checkpoint(directory: Path, model, optimizer: torch.optim.Optimizer, state: TrainerState) -> Path:
    target = directory / f"step_{state.step:06d}"
    partial = target.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    torch.save(
        {"optimizer": optimizer.state_dict(), "step": state.step, "version": state.version, "rng": torch.get_rng_state()},
        partial / "trainer_state.pt",
    )
    shutil.rmtree(target, ignore_errors=True)
    # Rename last so a crash mid-save never leaves a checkpoint that looks complete.
    partial.rename(target)
    for old in sorted(directory.glob("step_??????"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(directory: Path) -> Path | None:
    complete = [p for p in sorted(directory.glob("step_??????")) if (p / "trainer_state.pt").is_file()]
    return complete[-1] if complete else None


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer) -> TrainerState:
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    model.load_state_dict(weights, strict=False)
    saved = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    return TrainerState(step=saved["step"], version=saved["version"])
