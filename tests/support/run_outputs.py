"""What a run wrote, read back: the steps metrics.jsonl records, the trainer's pid in mesh.json,
and an experiment tracker's run (W&B offline, MLflow) read through the tracker's own API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def step_records_written(output_dir: Path) -> int:
    """How many step records metrics.jsonl holds, across restarts: a step trained again after a
    resume counts again, so the figure grows with every step any trainer finished."""
    path = output_dir / "metrics.jsonl"
    # Polled every few milliseconds while a run goes on: a count over the bytes (a record holds
    # "loss" once) keeps the polling from taking a core the run needs.
    return path.read_bytes().count(b'"loss"') if path.exists() else 0


def last_trained_step(output_dir: Path) -> int:
    """The highest step metrics.jsonl reports a reward for (0 before the first)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if '"reward"' in line), default=0)


def trainer_pid(output_dir: Path) -> int | None:
    """The pid of the trainer `rlmesh up` runs for `output_dir` (its mesh.json), once there is one."""
    try:
        return json.loads((output_dir / "mesh.json").read_text())["trainer"]["pid"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return None


def wandb_records(run_dir: Path) -> list[dict]:
    """An offline W&B run's records (its config, history rows, summaries, exit), as wandb's own
    reader of a run's files prints them (`wandb leet inspect --json`)."""
    printed = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [json.loads(line) for line in printed.splitlines() if line.strip()]


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows an offline W&B run logged, in order."""
    return [record["history"]["item"] for record in wandb_records(run_dir) if record["type"] == "history"]


def mlflow_run(output_dir: Path, experiment: str = "rlmesh"):
    """The MLflow client of a run folder's own store (`<output>/mlflow/mlflow.db`) and the one run
    it holds in `experiment`."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{output_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run
