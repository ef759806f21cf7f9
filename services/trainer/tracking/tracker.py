"""What the metrics writer sends an experiment tracker (`Tracker`) and the held-out samples' record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

JOB_FILE = "job.json"
"""The resolved job `rlmesh up` writes in the run's folder: what a tracker gets as the run's config."""


@dataclass(frozen=True, slots=True)
class HeldOutSample:
    """One held-out response of a validation, as the samples table shows it."""

    step: int
    weight_version: int
    task: str
    kind: str
    """`sampled` or `greedy`."""
    sample: int
    """Which of the prompt's sampled responses (0 for the greedy one)."""
    prompt: str
    completion: str
    reward: float


SAMPLE_COLUMNS = list(HeldOutSample.__dataclass_fields__)


class Tracker(Protocol):
    """An experiment tracker's run: the metrics writer hands it what it files, as it files it."""

    name: str
    where: str
    """Where the run can be found: a folder, or a server and the run's id."""

    def log_metrics(self, step: int, values: dict[str, float], timestamp: float) -> None:
        """A record of metrics.jsonl: its figures, under its step."""

    def log_samples(self, step: int, samples: list[HeldOutSample]) -> None:
        """A validation's held-out responses."""

    def log_reward_curve(self, step: int, plot: Path) -> None:
        """The reward-over-steps plot, drawn when the run ends."""

    def finish(self, failed: bool) -> None:
        """Closes the run, marked failed or finished."""
