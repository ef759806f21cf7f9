"""Command-line bad input, each command run as its own process: a clear message and a non-zero
exit before anything starts (bad arguments, a bad service setting, a bad job, an unsupported
model folder), and a health check of an address nothing serves."""

import json
import os
import subprocess
import sys

from rlmesh.launch.ports import free_port
from tests.support.jobs import dataset_job
from tests.support.paths import REPO_ROOT


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )


def up(*args: str) -> subprocess.CompletedProcess:
    return run("up", *args)


def test_up_refuses_bad_arguments():
    result = run("up", "--rollout-instances", "0")
    assert result.returncode == 2 and "argument --rollout-instances: must be at least 1, got 0" in result.stderr
    result = run("up", "--steps", "0")
    assert result.returncode == 2 and "must be at least 1" in result.stderr
    result = run("up", "--max-staleness", "-1")
    assert result.returncode == 2 and "--max-staleness" in result.stderr


def test_a_service_with_a_bad_setting_names_the_field():
    result = run("manager", env={"RLMESH_MANAGER_SERVER__PORT": "not-a-port"})
    assert result.returncode == 2
    assert "server.port" in result.stderr
    result = run("rollout")
    assert result.returncode == 2 and "engine" in result.stderr


def test_health_of_nothing_is_not_serving():
    result = run("health", f"127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert result.returncode == 1 and "NOT SERVING" in result.stdout


def test_up_stops_a_bad_job_before_starting_anything(tmp_path, model_dir):
    missing_file = dataset_job(tmp_path)
    (tmp_path / "data.jsonl").unlink()
    # A model folder given: without one, a fresh clone's first `up` spends half a minute creating
    # the built-in model before it reads the job's tasks.
    result = up("--job", str(missing_file), "--model-dir", str(model_dir))
    assert result.returncode == 2 and "dataset" in result.stderr and "data.jsonl does not exist" in result.stderr

    other = tmp_path / "other"
    other.mkdir()
    result = up("--job", str(dataset_job(other, fields='{ answer = "solutoin" }')), "--model-dir", str(model_dir))
    assert result.returncode == 2
    assert "task 'mine'" in result.stderr and "row 0 has no field 'solutoin'" in result.stderr

    # Checked by a process forked from the fork server, and, with the fork server off, in `up`'s own.
    for fork_server in ("true", "false"):
        refused = tmp_path / f"refused-{fork_server}"
        result = up(
            "--job",
            str(dataset_job(other)),
            "--model-dir",
            str(model_dir),
            "--output-dir",
            str(refused),
            "--set",
            "tasks.0.reward.function=my_reward:nope",
            "--set",
            f"mesh.fork_server={fork_server}",
        )
        assert result.returncode == 2 and "has no attribute 'nope'" in result.stderr
        # A job refused before any service started leaves no run folder behind.
        assert not refused.exists()

    result = up("--job", str(tmp_path / "absent.toml"))
    assert result.returncode == 2 and "job file not found" in result.stderr

    result = up("--set", "algorithm.learning_rate")
    assert result.returncode == 2 and "FIELD=VALUE" in result.stderr


def test_up_refuses_a_model_folder_of_an_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    result = up("--model-dir", str(tmp_path))
    assert result.returncode == 2
    assert (
        "'GPT2LMHeadModel'" in result.stderr
        and "supported: qwen2 (Qwen2ForCausalLM), llama (LlamaForCausalLM), qwen3" in result.stderr
    )


def test_up_refuses_vllm_on_cpu_for_a_head_size_its_attention_lacks(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    result = up("--model-dir", str(model_dir), "--engine", "vllm", "--steps", "40", "--output-dir", str(run_dir))
    assert result.returncode == 2
    assert (
        f"rollout.engine.kind = vllm: the vllm engine cannot serve {model_dir} on CPU: its attention head size is 16"
        in result.stderr
    )
    assert not run_dir.exists()


def test_init_model_takes_a_short_warm_up_for_a_chat_model_of_ones_own_only(tmp_path):
    result = run(
        "init-model", "--kind", "tiny-increment", "--warmup-iterations", "3", "--model-dir", str(tmp_path / "m")
    )
    assert result.returncode == 2 and "--warmup-iterations applies to --kind tiny-chat" in result.stderr
    assert not (tmp_path / "m").exists()
    result = run("init-model", "--kind", "tiny-chat", "--warmup-iterations", "0", "--model-dir", str(tmp_path / "m"))
    assert result.returncode == 2 and "must be at least 1" in result.stderr
    result = run("init-model", "--kind", "tiny-chat", "--warmup-iterations", "2", "--model-dir", str(tmp_path / "chat"))
    assert result.returncode == 0, result.stderr
    assert (
        "chat_template" in (tmp_path / "chat" / "tokenizer_config.json").read_text()
        or (tmp_path / "chat" / "chat_template.jinja").exists()
    )
    assert (tmp_path / "chat" / "config.json").exists()


def test_up_refuses_a_tracker_whose_package_is_missing_before_starting_anything(tmp_path, model_dir):
    # `rlmesh up` in a Python where no `wandb` package is found.
    without_wandb = (
        "import sys; from rlmesh.settings import tracking; found = tracking.find_spec; "
        "tracking.find_spec = lambda name: None if name == 'wandb' else found(name); "
        "from rlmesh.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    output_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", without_wandb, "up", "--model-dir", str(model_dir), "--output-dir", str(output_dir)]
        + ["--set", "tracking.wandb.mode=offline"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2 and not output_dir.exists()
    assert (
        "tracking.wandb.mode = offline needs the `wandb` package" in result.stderr
        and "`tracking` extra" in result.stderr
    )
