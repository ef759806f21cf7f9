"""The run's Weights & Biases run: the job as its config, every metric against the training step,
the held-out samples as a table per validation, the reward plot as an image. Offline runs are
written under <output>/wandb, for `wandb sync` later."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import wandb

from rlmesh.settings.tracking import WandbSettings
from services.trainer.tracking.tracker import SAMPLE_COLUMNS, HeldOutSample

STEP_KEY = "step"
"""The x-axis of every chart: the training step. Validations finish after later steps were filed,
and W&B drops what is logged at a `step=` lower than one it saw, so each record carries its step
as this metric instead (`define_metric`)."""


def effective_mode(mode: str) -> str:
    """The job's mode, except that `WANDB_MODE=offline` in the environment keeps an online job
    offline, as it keeps any wandb run on a machine without network."""
    return "offline" if mode == "online" and os.environ.get("WANDB_MODE") == "offline" else mode


class WandbTracker:
    name = "wandb"

    def __init__(self, settings: WandbSettings, output_dir: Path, config: dict[str, Any]) -> None:
        # The services' output is already their log file: W&B need not capture it.
        self.run = wandb.init(
            dir=str(output_dir),
            mode=effective_mode(settings.mode),
            project=settings.project,
            entity=settings.entity,
            name=settings.run_name or output_dir.name,
            tags=settings.tags,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.where = (
            self.run.url if not self.run.offline else f"{self.run.settings.sync_dir} (offline: `wandb sync` uploads it)"
        )

    def log_metrics(self, step: int, values: dict[str, float], timestamp: float) -> None:
        self.run.log({**values, STEP_KEY: step})

    def log_samples(self, step: int, samples: list[HeldOutSample]) -> None:
        rows = [[getattr(sample, column) for column in SAMPLE_COLUMNS] for sample in samples]
        self.run.log({"eval/samples": wandb.Table(columns=SAMPLE_COLUMNS, data=rows), STEP_KEY: step})

    def log_reward_curve(self, step: int, plot: Path) -> None:
        self.run.log({"reward_curve": wandb.Image(str(plot)), STEP_KEY: step})

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
