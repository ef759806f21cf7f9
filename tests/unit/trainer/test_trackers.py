"""The experiment trackers' adapters behind the metrics writer, each run read back with its
tracker's own API: a W&B offline run by wandb's reader of its files, an MLflow run from the run
folder's SQLite store by MlflowClient. A job enabling a tracker whose package is missing is refused
naming it, and a tracker failing mid-run leaves metrics.jsonl whole."""

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow.artifacts
import pytest

from rlmesh.job import load_job
from rlmesh.settings import tracking
from rlmesh.settings.handover import trainer_settings
from rlmesh.settings.tracking import MlflowSettings, TrackingSettings, WandbSettings
from services.trainer.config import TrainerConfig
from services.trainer.tracking.metrics import MetricsWriter
from services.trainer.tracking.mlflow_tracker import PARAM_VALUE_LIMIT, flat_params
from services.trainer.tracking.runs import start_trackers
from services.trainer.tracking.tracker import SAMPLE_COLUMNS, HeldOutSample
from services.trainer.validation import HeldOut, held_out_rows
from tests.support.run_outputs import mlflow_run, wandb_history, wandb_records

CONFIG = {"algorithm": {"learning_rate": 0.001, "steps": 2}, "tasks": [{"name": "increment", "kind": "increment"}]}
SAMPLES = [
    HeldOutSample(2, 2, "increment", "sampled", 0, "12=", "14", 0.0),
    HeldOutSample(2, 2, "increment", "greedy", 0, "12=", "13", 1.0),
]
RECORDS = [
    (1, {"reward": 0.25, "loss": 0.5}),
    (2, {"reward": 0.5, "loss": 0.25}),
    (1, {"eval/sampled_reward": 0.75, "eval/exact_match": 0.5}),
]
"""What a run files, in the order it files it: a background validation of step 1 lands after step 2."""


def tracked_run(output_dir: Path, settings: TrackingSettings, failed: bool = False) -> list[dict]:
    """Files RECORDS and SAMPLES, draws the plot, closes the trackers; returns metrics.jsonl."""
    writer = MetricsWriter(output_dir)
    writer.trackers = start_trackers(settings, output_dir, CONFIG)
    for step, values in RECORDS:
        writer.write(step, values)
    writer.write_samples(2, SAMPLES)
    writer.plot()
    writer.close(failed=failed)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def offline_run_dir(output_dir: Path) -> Path:
    [run_dir] = (output_dir / "wandb").glob("offline-run-*")
    return run_dir


def test_an_offline_wandb_run_holds_the_job_every_metric_at_its_step_the_samples_and_the_curve(tmp_path):
    metrics = tracked_run(tmp_path, TrackingSettings(wandb=WandbSettings(mode="offline", tags=["unit"])))
    run_dir = offline_run_dir(tmp_path)
    records = wandb_records(run_dir)
    [run] = [record["run"] for record in records if record["type"] == "run"]
    assert run["display_name"] == tmp_path.name and run["project"] == "rlmesh" and run["tags"] == ["unit"]
    assert {key: value for key, value in run["config"]["update"].items() if key != "_wandb"} == CONFIG
    history = wandb_history(run_dir)
    for record in metrics:
        logged = next(
            row for row in history if row["step"] == record["step"] and record.keys() - {"time"} <= row.keys()
        )
        assert all(logged[key] == value for key, value in record.items() if key != "time")
    table = next(row for row in history if "eval/samples.path" in row)
    rows = json.loads((run_dir / "files" / table["eval/samples.path"]).read_text())
    assert rows["columns"] == SAMPLE_COLUMNS and rows["data"] == [list(vars_of(sample)) for sample in SAMPLES]
    curve = next(row for row in history if "reward_curve.path" in row)
    assert curve["step"] == 2 and (run_dir / "files" / curve["reward_curve.path"]).stat().st_size > 0
    [ended] = [record["exit"] for record in records if record["type"] == "exit"]
    assert ended.get("exit_code", 0) == 0


def vars_of(sample: HeldOutSample) -> list:
    return [getattr(sample, column) for column in SAMPLE_COLUMNS]


def test_an_mlflow_run_in_the_local_store_holds_the_job_every_metric_the_samples_and_the_curve(tmp_path):
    metrics = tracked_run(tmp_path, TrackingSettings(mlflow=MlflowSettings(enabled=True, run_name="unit")))
    client, run = mlflow_run(tmp_path)
    assert run.info.run_name == "unit" and run.info.status == "FINISHED"
    assert run.data.params["algorithm.learning_rate"] == "0.001" and run.data.params["tasks.0.name"] == "increment"
    for key in ("reward", "loss", "eval/sampled_reward"):
        logged = [(metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key)]
        assert logged == [(record["step"], record[key]) for record in metrics if key in record]
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"job.json", "reward.png", "eval"} <= artifacts
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/job.json") == CONFIG
    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/eval/samples.json")
    assert table["columns"] == SAMPLE_COLUMNS and table["data"] == [vars_of(sample) for sample in SAMPLES]
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path.resolve() / "mlflow")


def test_a_run_that_fails_is_marked_failed_in_each_tracker(tmp_path):
    settings = TrackingSettings(wandb=WandbSettings(mode="offline"), mlflow=MlflowSettings(enabled=True))
    tracked_run(tmp_path, settings, failed=True)
    [ended] = [record["exit"] for record in wandb_records(offline_run_dir(tmp_path)) if record["type"] == "exit"]
    assert ended["exit_code"] == 1
    assert mlflow_run(tmp_path)[1].info.status == "FAILED"


@pytest.mark.parametrize(
    ("absent", "settings", "named"),
    [
        ("wandb", {"wandb": {"mode": "offline"}}, "`wandb`"),
        ("mlflow", {"mlflow": {"enabled": True}}, "`mlflow-skinny`"),
        ("sqlalchemy", {"mlflow": {"enabled": True}}, "`sqlalchemy`"),
    ],
)
def test_a_tracker_whose_package_is_missing_is_refused_naming_it(absent, settings, named, tmp_path, monkeypatch):
    real_find_spec = tracking.find_spec
    monkeypatch.setattr(tracking, "find_spec", lambda name: None if name == absent else real_find_spec(name))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match=named) as refused:
        start_trackers(TrackingSettings.model_validate(settings), tmp_path, CONFIG)
    assert "`tracking` extra" in str(refused.value)
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlflow").exists()


def test_an_mlflow_server_needs_no_sqlite_packages(monkeypatch):
    real_find_spec = tracking.find_spec
    monkeypatch.setattr(tracking, "find_spec", lambda name: None if name == "sqlalchemy" else real_find_spec(name))
    server = TrackingSettings(mlflow=MlflowSettings(enabled=True, tracking_uri="http://mlflow.internal:5000"))
    assert server.missing_package() == ""


def test_the_tracking_section_reaches_the_trainer_from_the_job_and_set(tmp_path):
    overrides = {"tracking.wandb.mode": "offline", "tracking.wandb.entity": "team", "tracking.mlflow.enabled": True}
    job, base = load_job(None, overrides)
    config = TrainerConfig(**trainer_settings(job, base, tmp_path, tmp_path))
    assert config.tracking == job.tracking and config.tracking.wandb.mode == "offline"
    assert config.tracking.wandb.entity == "team" and config.tracking.mlflow.enabled


class RecordingTracker:
    name = "recording"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.finished: list[bool] = []

    def log_metrics(self, step, values, timestamp):
        self.steps.append(step)

    def log_samples(self, step, samples):
        pass

    def log_reward_curve(self, step, plot):
        pass

    def finish(self, failed):
        self.finished.append(failed)


class DownTracker(RecordingTracker):
    name = "down"

    def log_metrics(self, step, values, timestamp):
        raise ConnectionError("tracking server unreachable")


def test_a_tracker_failing_mid_run_leaves_metrics_jsonl_and_the_other_trackers_whole(tmp_path):
    writer = MetricsWriter(tmp_path)
    recording = RecordingTracker()
    writer.trackers = [DownTracker(), recording]
    for step, values in RECORDS:
        writer.write(step, values)
    writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 1]
    assert recording.steps == [1, 2, 1] and recording.finished == [False]


def test_mlflow_params_are_the_job_flattened_with_names_and_values_mlflow_takes():
    params = flat_params({"a": {"b": [1, {"c": None}], "odd:key!": "x" * (PARAM_VALUE_LIMIT + 5)}, "empty": []})
    assert params == {"a.b.0": "1", "a.b.1.c": "null", "a.odd_key_": "x" * PARAM_VALUE_LIMIT, "empty": "[]"}


def test_held_out_rows_follow_the_round_order_of_responses():
    held_out = HeldOut(SimpleNamespace(name="t"), [], ["p0", "p1"], [])
    rows = held_out_rows(3, 7, held_out, "sampled", ["a", "b", "c", "d"], [1.0, 0.0, 0.5, 0.25])
    assert [(row.sample, row.prompt, row.completion, row.reward) for row in rows] == [
        (0, "p0", "a", 1.0),
        (0, "p1", "b", 0.0),
        (1, "p0", "c", 0.5),
        (1, "p1", "d", 0.25),
    ]
    assert {(row.step, row.weight_version, row.task, row.kind) for row in rows} == {(3, 7, "t", "sampled")}
