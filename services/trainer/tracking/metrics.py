"""Training metrics: one JSON line per record, TensorBoard scalars, and the reward-over-steps plot;
each record, the held-out samples and the plot also go to the experiment trackers the job enables."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from services.trainer.tracking.tracker import HeldOutSample, Tracker

log = structlog.get_logger()


class MetricsWriter:
    def __init__(self, output_dir: Path) -> None:
        # Imported here, not with the module: only the leader rank writes metrics, and the other
        # ranks' start-up need not pay for TensorBoard's import.
        from torch.utils.tensorboard import SummaryWriter

        self.jsonl_path = output_dir / "metrics.jsonl"
        self.plot_path = output_dir / "reward.png"
        self.tensorboard_dir = output_dir / "tensorboard"
        self._tensorboard = SummaryWriter(str(self.tensorboard_dir))
        self.history: list[dict[str, float]] = []
        if self.jsonl_path.exists():
            self.history = [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]
        self.trackers: list[Tracker] = []
        """The experiment trackers the job enables (`tracker.py`), started with the run: each is handed
        every record as it is filed."""

    def write(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **values}
        self.history.append(record)
        with self.jsonl_path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        for name, value in values.items():
            self._tensorboard.add_scalar(name, value, step)
        self._tensorboard.flush()
        self._to_trackers(lambda tracker: tracker.log_metrics(step, values, record["time"]))

    def write_samples(self, step: int, samples: list[HeldOutSample]) -> None:
        """A validation's held-out responses, for the trackers' samples tables."""
        self._to_trackers(lambda tracker: tracker.log_samples(step, samples))

    def plot(self) -> Path:
        # matplotlib's import costs about a CPU-second: paid once, at the end of a run, by the
        # process that draws. The Figure API needs no pyplot and no global backend.
        from matplotlib.figure import Figure

        train = [r for r in self.history if "reward" in r]
        # Background validations are filed when they finish, not always in step order.
        held_out = sorted((r for r in self.history if "eval/sampled_reward" in r), key=lambda r: r["step"])
        figure = Figure(figsize=(7, 4))
        axis = figure.subplots()
        if train:
            axis.plot(
                [r["step"] for r in train], [r["reward"] for r in train], label="training reward (sampled)", alpha=0.7
            )
        if held_out:
            axis.plot(
                [r["step"] for r in held_out],
                [r["eval/sampled_reward"] for r in held_out],
                "o-",
                label="held-out reward (sampled)",
            )
            axis.plot(
                [r["step"] for r in held_out],
                [r["eval/exact_match"] for r in held_out],
                "s--",
                label="held-out exact match (greedy)",
            )
            tasks = sorted(
                {key.split("/")[1] for r in held_out for key in r if key.startswith("eval/") and key.count("/") == 2}
            )
            if len(tasks) > 1:
                for task in tasks:
                    key = f"eval/{task}/sampled_reward"
                    rows = [r for r in held_out if key in r]
                    axis.plot([r["step"] for r in rows], [r[key] for r in rows], ".:", label=f"held-out reward: {task}")
        axis.set_xlabel("training step")
        axis.set_ylim(0, 1.02)
        axis.set_title("rlmesh: reward over steps")
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right")
        figure.tight_layout()
        figure.savefig(self.plot_path, dpi=110)
        last_step = max((r["step"] for r in self.history), default=0)
        self._to_trackers(lambda tracker: tracker.log_reward_curve(last_step, self.plot_path))
        return self.plot_path

    def close(self, failed: bool = False) -> None:
        """Closes TensorBoard's file and each tracker's run, marked failed or finished."""
        self._tensorboard.close()
        self._to_trackers(lambda tracker: tracker.finish(failed))
        self.trackers = []

    def _to_trackers(self, call: Callable[[Tracker], None]) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - metrics.jsonl holds every record: a tracker's outage ends no run
                log.warning(
                    "an experiment tracker failed; training goes on",
                    tracker=tracker.name,
                    error=f"{type(exc).__name__}: {exc}",
                )
