"""The run's MLflow run: the job as its params (and whole, as the artifact job.json), every metric
at its step, the held-out samples as the table eval/samples.json, the reward plot as an artifact.
Without a tracking URI the store is a SQLite file under <output>/mlflow: no server needed."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus

from rlmesh.settings.tracking import MlflowSettings
from services.trainer.tracking.tracker import SAMPLE_COLUMNS, HeldOutSample

PARAMS_PER_BATCH = 100
"""The most params MLflow takes in one log_batch call."""
PARAM_VALUE_LIMIT = 6000
"""The longest param value MLflow takes."""
PARAM_KEY_LIMIT = 250
NOT_IN_A_PARAM_KEY = re.compile(r"[^/\w.\- ]")
"""What MLflow refuses in a param's name (a user's mapping may hold any key): written as `_`."""
SAMPLES_ARTIFACT = "eval/samples.json"


def local_store(output_dir: Path) -> Path:
    """The folder of a run's own MLflow store (the default): the SQLite file and the artifacts."""
    return output_dir.resolve() / "mlflow"


def flat_params(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (list items by index), JSON values cut to
    MLflow's limit (job.json holds them whole)."""
    if isinstance(config, dict) and config:
        children = config.items()
    elif isinstance(config, list) and config:
        children = enumerate(config)
    else:
        key = NOT_IN_A_PARAM_KEY.sub("_", prefix.removesuffix("."))[:PARAM_KEY_LIMIT]
        return {key: (config if isinstance(config, str) else json.dumps(config))[:PARAM_VALUE_LIMIT]}
    return {key: value for name, child in children for key, value in flat_params(child, f"{prefix}{name}.").items()}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, settings: MlflowSettings, output_dir: Path, config: dict[str, Any]) -> None:
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if uri is None:
            store = local_store(output_dir)
            store.mkdir(parents=True, exist_ok=True)
            # Artifacts beside the database, not in the working directory (MLflow's default).
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(settings.experiment, artifact_location=artifacts)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name or output_dir.name).info.run_id
        self.where = f"{uri} (experiment {settings.experiment}, run {self.run_id})"
        params = [Param(key, value) for key, value in flat_params(config).items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_BATCH])
        self.client.log_dict(self.run_id, config, "job.json")
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-uploads")
        """Tables and artifacts, uploaded in order off the training loop."""
        self._pending: list[Callable[[], object]] = []
        """What `finish` waits for: the metric batches in MLflow's queue, the uploads in ours."""

    def log_metrics(self, step: int, values: dict[str, float], timestamp: float) -> None:
        milliseconds = int(timestamp * 1000)
        metrics = [Metric(key, float(value), milliseconds, step) for key, value in values.items()]
        # Logged in MLflow's background queue: a slow tracking server does not hold the training loop.
        self._pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False).wait)

    def log_samples(self, step: int, samples: list[HeldOutSample]) -> None:
        columns = {column: [getattr(sample, column) for sample in samples] for column in SAMPLE_COLUMNS}
        # MLflow appends to a table artifact of the same name: one table over every validation.
        self._pending.append(self._uploads.submit(self.client.log_table, self.run_id, columns, SAMPLES_ARTIFACT).result)

    def log_reward_curve(self, step: int, plot: Path) -> None:
        self._pending.append(self._uploads.submit(self.client.log_artifact, self.run_id, str(plot)).result)

    def finish(self, failed: bool) -> None:
        """Waits for what is still being logged, then closes the run; raises the first failure met."""
        pending, self._pending = self._pending, []
        first_failure: Exception | None = None
        for wait in pending:
            try:
                wait()
            except Exception as exc:  # noqa: BLE001 - the run is closed whatever failed; the first is raised after
                first_failure = first_failure or exc
        self._uploads.shutdown()
        self.client.set_terminated(self.run_id, RunStatus.to_string(RunStatus.FAILED if failed else RunStatus.FINISHED))
        if first_failure is not None:
            raise first_failure
