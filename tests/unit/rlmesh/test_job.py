"""The job file: defaults, overrides, paths relative to the file, and a bad job refused with a
message naming what is wrong (unknown key, conflicting settings, invalid TOML)."""

import json
import tomllib
from pathlib import Path

import pytest

from rlmesh.config import ConfigError
from rlmesh.job import Job, load_job, parse_value
from tests.support.jobs import dataset_job
from tests.support.paths import REPO_ROOT


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_default_job_trains_the_increment_task():
    job, _ = load_job(None)
    assert [t.kind for t in job.tasks] == ["increment"]
    assert job.algorithm.steps == 600 and job.mesh.rollout_instances == 1 and job.model.path is None


def test_paths_resolve_against_the_job_folder_and_overrides_apply(tmp_path):
    job, base = load_job(
        dataset_job(tmp_path), {"algorithm.steps": 7, "tasks.0.weight": 2.5, "rollout.engine.tensor_parallel_size": 2}
    )
    assert base == tmp_path.resolve()
    assert job.tasks[0].dataset.path == str(tmp_path.resolve() / "data.jsonl")
    assert (job.algorithm.steps, job.tasks[0].weight, job.rollout.engine.tensor_parallel_size) == (7, 2.5, 2)


def test_a_data_file_a_task_names_and_lacks_is_found_without_reading_any_data(tmp_path):
    job, _ = load_job(dataset_job(tmp_path, extra='path = "held_out.jsonl"'))
    assert job.missing_file() == f"task 'mine': eval.path {tmp_path / 'held_out.jsonl'} does not exist"
    (tmp_path / "held_out.jsonl").write_text("")
    assert job.missing_file() == ""
    (tmp_path / "data.jsonl").unlink()
    assert job.missing_file() == f"task 'mine': dataset {tmp_path / 'data.jsonl'} does not exist"


def test_set_on_the_default_job_addresses_its_task():
    job, _ = load_job(None, {"tasks.0.eval.prompts": 16})
    assert job.tasks[0].eval.prompts == 16 and job.tasks[0].kind == "increment"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[algorithm]\nstepz = 3\n", "algorithm.stepz: Extra inputs are not permitted"),
        ("[[tasks]]\nname = 'x'\nkind = 'dataset'\n", "kind 'dataset' needs a [dataset] section"),
        ("[[tasks]]\nname = 'a'\nkind = 'increment'\n[[tasks]]\nname = 'a'\nkind = 'increment'\n", "repeated: ['a']"),
        ("[[tasks]]\nname = 'x'\nkind = 'increment'\nreward.function = 'nocolon'\n", "module:function"),
        ("[weights]\nbackend = 'mooncake'\ncompression = 'delta'\n", "mooncake backend writes raw bytes"),
        (
            "[rollout.engine]\nkind = 'vllm'\ntensor_parallel_size = 2\n",
            "only the torch engine runs tensor-parallel, not vllm",
        ),
        ("[weights]\ncompression = 'int8'\n", "weights compression int8 is lossy"),
        ("[mesh]\nrollout_tp = 2\n", "mesh.rollout_tp moved to rollout.engine.tensor_parallel_size"),
        (
            "[mesh]\ntrainer_device = 'cuda'\n",
            "mesh.trainer_device moved to trainer.distributed_backend (cpu: gloo, cuda: nccl)",
        ),
        (
            "[mesh]\nengine = 'vllm'\ncompression = 'zstd'\n",
            "mesh.engine moved to rollout.engine.kind; mesh.compression moved to weights.compression",
        ),
        (
            "[mesh]\nrollout_instances = 2\nrollout_netns = 3\n",
            "rollout_netns (3) is more than the rollout instances at start (2)",
        ),
        ("[mesh]\nrollout_instances = 63\nrollout_netns = 63\n", "at most 62 instances run in network namespaces"),
        ("[algorithm\n", "not valid TOML"),
        ("[algorithm]\nloss = 'tis'\nimportance_cap_mode = 'drop'\n", "tis truncates by definition"),
        (
            "[algorithm]\nmin_micro_batch_groups = 8\n",
            "min_micro_batch_groups (8) must not exceed micro_batch_groups (4)",
        ),
    ],
)
def test_a_bad_job_names_the_problem(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=None) as caught:
        load_job(write(tmp_path / "job.toml", text))
    assert expected in str(caught.value)


def test_values_given_on_the_command_line_read_as_toml():
    assert parse_value("1e-4") == 1e-4 and parse_value("true") is True and parse_value("'a b'") == "a b"
    assert parse_value("plain") == "plain"


def test_the_job_model_carries_every_documented_section():
    assert set(Job.model_fields) == {
        "model",
        "tasks",
        "algorithm",
        "trainer",
        "manager",
        "relay",
        "rollout",
        "weights",
        "mesh",
        "output",
        "tracking",
    }


def test_the_update_mode_flag_the_stream_interval_the_device_and_dtype_reach_every_rollout_instance(
    tmp_path, model_dir, monkeypatch
):
    """`rlmesh up --update-mode` sets rollout.engine.update_mode, which each rollout instance reads
    at start from the settings the launcher hands it; rollout.engine.stream_interval and .device
    likewise, model.dtype as the engine's dtype, and the trainer gets trainer.distributed_backend,
    trainer.precision and model.dtype as the dtype it publishes in."""
    from rlmesh.cli import main as cli
    from rlmesh.config import load_config
    from rlmesh.launch import run
    from rlmesh.launch.services import rollout_spec
    from services.rollout.config import RolloutConfig

    plans = []

    async def run_mesh(plan):
        plans.append(plan)
        return 0

    monkeypatch.setattr(run, "run_mesh", run_mesh)
    monkeypatch.setattr("rlmesh.logging.configure_logging", lambda *args, **kwargs: None)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert (
        cli.main(
            [
                "up",
                "--update-mode",
                "pause",
                "--set",
                "rollout.engine.stream_interval=8",
                "--set",
                "rollout.engine.device=cuda",
                "--set",
                "trainer.distributed_backend=gloo",
                "--set",
                "model.dtype=bfloat16",
                "--set",
                "trainer.precision=bf16",
                "--model-dir",
                str(model_dir),
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "job.json").read_text())["rollout"]["engine"]["update_mode"] == "pause"
    config = load_config(
        RolloutConfig,
        tmp_path / "rollout.json",
        env_prefix="RLMESH_ROLLOUT_",
        environ=rollout_spec(plans[0], 0).settings,
    )
    assert config.engine.update_mode == "pause" and config.engine.stream_interval == 8
    assert config.engine.device == "cuda" and config.engine.dtype == "bfloat16"
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    assert (
        trainer["distributed_backend"] == "gloo"
        and trainer["weights_dtype"] == "bfloat16"
        and trainer["precision"] == "bf16"
    )
    assert (
        load_job(None, {"rollout.engine.update_mode": "abort-continue"})[0].rollout.engine.update_mode
        == "abort-continue"
    )
    with pytest.raises(ConfigError, match="update_mode"):
        load_job(None, {"rollout.engine.update_mode": "drop"})


def test_the_up_flags_set_the_service_settings_they_name():
    from rlmesh.cli import main as cli
    from rlmesh.cli import run_commands

    def job_of(*flags: str):
        return load_job(None, run_commands.overrides(cli.build_parser().parse_args(["up", *flags])))[0]

    job = job_of("--rollout-tp", "2", "--update-mode", "pause", "--transfer-backend", "grpc", "--compression", "zstd")
    assert (job.rollout.engine.tensor_parallel_size, job.rollout.engine.update_mode) == (2, "pause")
    assert (job.weights.backend, job.weights.compression) == ("grpc", "zstd")
    assert job_of("--engine", "vllm").rollout.engine.kind == "vllm"


def test_the_up_flags_paths_are_the_working_directorys_not_the_job_files(tmp_path, monkeypatch):
    from rlmesh.cli import main as cli
    from rlmesh.cli import run_commands

    (tmp_path / "examples" / "x").mkdir(parents=True)
    job_file = write(tmp_path / "examples" / "x" / "job.toml", "")
    monkeypatch.chdir(tmp_path)
    flags = ["--model-dir", "models/mine", "--output-dir", "runs/a", "--secrets-dir", "s", "--tls-dir", "t"]
    job, base = load_job(
        job_file, run_commands.overrides(cli.build_parser().parse_args(["up", "--job", str(job_file), *flags]))
    )
    assert base == job_file.parent
    assert Path(job.model.path) == tmp_path / "models" / "mine"
    assert Path(job.output.dir) == tmp_path / "runs" / "a"
    assert (Path(job.mesh.secrets_dir), Path(job.mesh.tls_dir)) == (tmp_path / "s", tmp_path / "t")


def test_a_job_streams_a_chunk_per_16_tokens_unless_it_says_otherwise_and_a_lone_service_per_token(tmp_path):
    from services.rollout.config import EngineConfig

    assert load_job(None)[0].rollout.engine.stream_interval == 16 and Job().rollout.engine.stream_interval == 16
    partial = load_job(write(tmp_path / "job.toml", "[rollout.engine]\nseed = 3\n"))[0].rollout.engine
    assert (partial.seed, partial.stream_interval) == (3, 16)
    assert load_job(None, {"rollout.engine.stream_interval": 1})[0].rollout.engine.stream_interval == 1
    assert EngineConfig(model_dir="m").stream_interval == 1


EXAMPLE_JOBS = sorted((REPO_ROOT / "examples").glob("*/job.toml"))


@pytest.mark.parametrize("path", EXAMPLE_JOBS, ids=lambda path: path.parent.name)
def test_every_example_job_loads_with_the_settings_it_writes(path):
    job, base = load_job(path)
    assert base == path.parent
    given = tomllib.loads(path.read_text()).get("algorithm", {})
    assert {key: getattr(job.algorithm, key) for key in given} == given


def test_the_examples_folder_has_jobs():
    assert {"async", "calculator", "feedback", "word-problems"} <= {path.parent.name for path in EXAMPLE_JOBS}


def test_the_async_example_job_sets_three_values_and_leaves_the_rest_to_defaults():
    path = REPO_ROOT / "examples" / "async" / "job.toml"
    job, _ = load_job(path)
    given = tomllib.loads(path.read_text())
    tuned = [f"{section}.{key}" for section, values in given.items() for key in values]
    assert tuned == ["algorithm.max_staleness", "algorithm.steps", "mesh.rollout_instances"]
    assert job.algorithm.max_staleness == 4 and job == load_job(None, {"algorithm.max_staleness": 4})[0]


def test_the_agent_command_examples_compose_config_runs_its_job():
    """examples/agent-command's trainer config for containers holds the job's task and algorithm."""
    from rlmesh.config import load_config
    from services.trainer.config import TrainerConfig

    folder = REPO_ROOT / "examples" / "agent-command"
    job, _ = load_job(folder / "job.toml")
    config = load_config(TrainerConfig, folder / "compose-trainer.toml", overrides={"model_dir": "/models/policy"})
    assert config.tasks == job.tasks and config.python_path == ["/jobs/agent-command"]
    given = tomllib.loads((folder / "job.toml").read_text())["algorithm"]
    assert {key: getattr(config, key) for key in given} == given
