"""The tracker runs a job enables, started on rank 0 with the run's config; each tracker's module is
imported only when the job enables it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlmesh.settings.tracking import TrackingSettings
from services.trainer.tracking.tracker import JOB_FILE, Tracker


def run_config(output_dir: Path, fallback: dict[str, Any]) -> dict[str, Any]:
    """The run's config: the resolved job `rlmesh up` wrote, else (a trainer started on its own)
    the trainer's own config."""
    job = output_dir / JOB_FILE
    return json.loads(job.read_text()) if job.is_file() else fallback


def start_trackers(settings: TrackingSettings, output_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """A started run in each tracker the job enables; ValueError naming the package a tracker
    needs when it is not installed. Each tracker's module is imported only when it is enabled."""
    if missing := settings.missing_package():
        raise ValueError(missing)
    trackers: list[Tracker] = []
    try:
        if settings.wandb.enabled:
            from services.trainer.tracking.wandb_tracker import WandbTracker

            trackers.append(WandbTracker(settings.wandb, output_dir, config))
        if settings.mlflow.enabled:
            from services.trainer.tracking.mlflow_tracker import MlflowTracker

            trackers.append(MlflowTracker(settings.mlflow, output_dir, config))
    except BaseException:
        for tracker in trackers:
            tracker.finish(failed=True)
        raise
    return trackers
