"""The start-up check of a job's tasks (`python -m rlmesh.tasks.check`, which `rlmesh up` forks from
the fork server): a job that can run passes with exit 0, a task that cannot fails with exit 2 and a
message naming the task and what is wrong."""

import json

from rlmesh.job import load_job
from rlmesh.tasks.check import CHECK_FAILED, main
from tests.support.jobs import dataset_job


def write_job_json(tmp_path, job_file) -> str:
    job, _ = load_job(job_file)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job.model_dump(mode="json")))
    return str(path)


def test_a_job_that_can_run_passes(tmp_path, model_dir):
    job = write_job_json(tmp_path, dataset_job(tmp_path))
    assert main(["--job", job, "--model-dir", str(model_dir), "--search-path", str(tmp_path)]) == 0


def test_a_task_that_cannot_run_fails_naming_it(tmp_path, model_dir, capsys):
    job = write_job_json(tmp_path, dataset_job(tmp_path, fields='{ answer = "solutoin" }'))
    assert main(["--job", job, "--model-dir", str(model_dir), "--search-path", str(tmp_path)]) == CHECK_FAILED
    error = capsys.readouterr().err
    assert error.startswith("rlmesh up: ") and "task 'mine'" in error and "row 0 has no field 'solutoin'" in error
