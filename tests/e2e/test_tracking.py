"""`rlmesh up` reporting a short job to an experiment tracker, read back with the tracker's own API:
a W&B offline run (wandb's reader of the run's files) and an MLflow run in the run folder's SQLite
store (MlflowClient) each hold the job, every metric of metrics.jsonl at its step, the held-out
samples (whose rewards make the held-out reward filed) and the reward curve; a job that fails
leaves both runs marked failed."""

import json
import math
import subprocess
from pathlib import Path

import mlflow.artifacts
import pytest

from rlmesh.launch.ports import free_base_port
from tests.support.jobs import up_command
from tests.support.paths import REPO_ROOT
from tests.support.run_outputs import mlflow_run, wandb_history, wandb_records

pytestmark = pytest.mark.e2e

STEPS = 2
"""Validations at steps 0 and 2 (up_command validates every 2 steps, 4 prompts, 1 sample each)."""


def run_job(model_dir: Path, output_dir: Path, setting: str, tracker: str) -> list[dict]:
    """Runs the short job with `--set setting`; returns its metrics.jsonl. Its summary names where
    the tracker's run is."""
    command = up_command(model_dir, output_dir, free_base_port(), steps=STEPS) + ["--set", setting]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    where = json.loads((output_dir / "summary.json").read_text())["tracking"][tracker]
    assert f"{tracker}:" in result.stdout and where in result.stdout
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def same(logged: float, written: float) -> bool:
    return logged == written or (math.isnan(logged) and math.isnan(written))


def assert_samples_make_the_held_out_reward(rows: list[list], columns: list[str], metrics: list[dict]) -> None:
    """Every validation's sampled rows average to the eval/sampled_reward filed for its step."""
    samples = [dict(zip(columns, row)) for row in rows]
    validations = {r["step"]: r["eval/sampled_reward"] for r in metrics if "eval/sampled_reward" in r}
    assert validations.keys() == {0, STEPS} and {s["step"] for s in samples} == set(validations)
    for step, held_out_reward in validations.items():
        sampled = [s["reward"] for s in samples if s["step"] == step and s["kind"] == "sampled"]
        greedy = [s for s in samples if s["step"] == step and s["kind"] == "greedy"]
        assert len(sampled) == len(greedy) == 4 and all(s["prompt"] and s["task"] == "increment" for s in greedy)
        assert math.isclose(sum(sampled) / len(sampled), held_out_reward)


def test_a_job_reported_to_wandb_offline_reads_back_through_wandb(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    metrics = run_job(model_dir, output_dir, "tracking.wandb.mode=offline", "wandb")
    [run_dir] = (output_dir / "wandb").glob("offline-run-*")
    records = wandb_records(run_dir)
    [run] = [record["run"] for record in records if record["type"] == "run"]
    config = {key: value for key, value in run["config"]["update"].items() if key != "_wandb"}
    assert (
        config == json.loads((output_dir / "job.json").read_text()) and config["tracking"]["wandb"]["mode"] == "offline"
    )
    history = wandb_history(run_dir)
    for record in metrics:
        written = {key: value for key, value in record.items() if key != "time"}
        assert any(
            row.get("step") == record["step"] and all(key in row and same(row[key], v) for key, v in written.items())
            for row in history
        ), f"metrics.jsonl record of step {record['step']} not in the W&B run: {sorted(written)}"
    tables = [row for row in history if "eval/samples.path" in row]
    rows = [
        r for table in tables for r in json.loads((run_dir / "files" / table["eval/samples.path"]).read_text())["data"]
    ]
    columns = json.loads((run_dir / "files" / tables[0]["eval/samples.path"]).read_text())["columns"]
    assert_samples_make_the_held_out_reward(rows, columns, metrics)
    [curve] = [row for row in history if "reward_curve.path" in row]
    assert curve["step"] == STEPS and (run_dir / "files" / curve["reward_curve.path"]).stat().st_size > 0
    [ended] = [record["exit"] for record in records if record["type"] == "exit"]
    assert ended.get("exit_code", 0) == 0


def test_a_job_reported_to_mlflow_reads_back_through_mlflow_client(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    metrics = run_job(model_dir, output_dir, "tracking.mlflow.enabled=true", "mlflow")
    client, run = mlflow_run(output_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["algorithm.steps"] == str(STEPS) and run.data.params["tasks.0.name"] == "increment"
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/job.json") == json.loads(
        (output_dir / "job.json").read_text()
    )
    for key in sorted({key for record in metrics for key in record} - {"step", "time"}):
        logged = sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key))
        written = sorted((record["step"], record[key]) for record in metrics if key in record)
        assert len(logged) == len(written) and all(
            step == written_step and same(value, written_value)
            for (step, value), (written_step, written_value) in zip(logged, written)
        ), f"{key}: MLflow holds {logged}, metrics.jsonl {written}"
    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/eval/samples.json")
    assert_samples_make_the_held_out_reward(table["data"], table["columns"], metrics)
    assert "reward.png" in {artifact.path for artifact in client.list_artifacts(run.info.run_id)}


def test_a_job_that_fails_leaves_each_trackers_run_marked_failed(model_dir, tmp_path):
    (tmp_path / "broken.py").write_text("def score(completion, answer):\n    raise KeyError('no verifier today')\n")
    job = tmp_path / "job.toml"
    job.write_text("""
[[tasks]]
name = "increment"
kind = "increment"
reward.function = "broken:score"

[tracking.wandb]
mode = "offline"

[tracking.mlflow]
enabled = true
""")
    command = up_command(model_dir, tmp_path / "run", free_base_port(), steps=STEPS) + ["--job", str(job)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 1 and "no verifier today" in result.stderr, result.stderr[-3000:]
    [run_dir] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    [ended] = [record["exit"] for record in wandb_records(run_dir) if record["type"] == "exit"]
    assert ended["exit_code"] == 1
    assert mlflow_run(tmp_path / "run")[1].info.status == "FAILED"
