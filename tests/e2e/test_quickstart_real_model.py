"""The real-model quickstart (docs/quickstart-real-model.md) at Qwen2.5-0.5B's real shapes: its own
job file, examples/qwen2.5-gsm8k/job.toml, run to completion by `rlmesh up` on CPU. No weights can
be downloaded here, so the model folder has Qwen2.5-0.5B's configuration in bf16 with random weights
and a ChatML character tokenizer; the test overrides only the model path, the device and the
step's size (`make test-large`)."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from rlmesh.launch.ports import free_base_port
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.large]

JOB = REPO_ROOT / "examples" / "qwen2.5-gsm8k" / "job.toml"
QWEN25_HALF_BILLION_PARAMETERS = 494_032_768
SMALL_ON_CPU = {
    # The example job's values are for a GPU; on two shared CPU cores one step of them would take hours.
    "rollout.engine.device": "cpu",
    "algorithm.prompts_per_step": 2,
    "algorithm.group_size": 2,
    "tasks.0.sampling.max_tokens": 8,
    "tasks.0.eval.prompts": 2,
    "tasks.0.eval.samples": 1,
    # At this shape the mesh takes 22 of a 24 GiB machine's memory at its peak (the trainer's fp32
    # weights and Adam states alone are 8 GB); streaming the hand-off spares the 2 GB of /dev/shm slots.
    "trainer.handoff": "stream",
}
STEPS = 2


def run_quickstart(model_dir: Path, output_dir: Path) -> subprocess.CompletedProcess:
    overrides = [arg for key, value in SMALL_ON_CPU.items() for arg in ("--set", f"{key}={value}")]
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--job",
        str(JOB),
        "--model-dir",
        str(model_dir),
        "--output-dir",
        str(output_dir),
        "--base-port",
        str(free_base_port()),
        "--steps",
        str(STEPS),
        *overrides,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=2400, cwd=REPO_ROOT)


def write_model_in_a_child(folder: Path) -> Path:
    """The random-init model folder, written by a process of its own: the test process would keep the
    heap it freed (about 4 GB), and the mesh's trainer, weights service and rollout instance at this
    shape need most of a 24 GiB machine."""
    script = (
        "import sys, torch\n"
        "from rlmesh.models.random_init import real_config, write_random_model\n"
        "write_random_model(sys.argv[1], real_config('qwen2'), seed=11, dtype=torch.bfloat16, chat=True)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(folder)], check=True, timeout=600, cwd=REPO_ROOT)
    return folder


def parameter_count(folder: Path) -> int:
    with safe_open(folder / "model.safetensors", "pt") as tensors:
        return sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())


@pytest.mark.timeout(2700)
def test_the_quickstart_job_trains_qwen25_half_billion_at_its_real_shape(tmp_path):
    started = time.monotonic()
    try:
        model_dir = write_model_in_a_child(tmp_path / "Qwen2.5-0.5B-Instruct")
        written = time.monotonic() - started
        assert parameter_count(model_dir) == QWEN25_HALF_BILLION_PARAMETERS
        result = run_quickstart(model_dir, tmp_path / "run")
        ran = time.monotonic() - started - written
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = {line["step"]: line for line in lines if "reward" in line}
        assert sorted(steps) == list(range(1, STEPS + 1))
        for line in steps.values():
            # Every response scored by the math reward (random weights answer nothing right).
            assert {"task/gsm8k/reward", "task/gsm8k/correct", "task/gsm8k/formatted"} <= set(line)
            assert line["reward_failures"] == 0 and line["trained_groups"] == SMALL_ON_CPU["algorithm.prompts_per_step"]
            assert 0 < line["response_length"] <= SMALL_ON_CPU["tasks.0.sampling.max_tokens"]
        # Each version published in bf16 at the real shape: 2 bytes a parameter from the one rank.
        published = [line["publish_rank_bytes"] for line in lines if "publish_rank_bytes" in line]
        assert published and set(published) == {2 * QWEN25_HALF_BILLION_PARAMETERS}
        evaluations = sorted(line["step"] for line in lines if "eval/gsm8k/sampled_reward" in line)
        assert evaluations[0] == 0 and evaluations[-1] == STEPS
        exported = tmp_path / "run" / "checkpoints" / f"step_{STEPS:06d}"
        assert json.loads((exported / "config.json").read_text())["hidden_size"] == 896
        assert parameter_count(exported) == QWEN25_HALF_BILLION_PARAMETERS
        trained = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert {task for event in trained if event["event"] == "trained" for _, _, task, _ in event["prompts"]} == {
            "gsm8k"
        }
    finally:
        # 1 GB of model, 6 GB of checkpoint; pytest keeps the last runs' temporary folders.
        shutil.rmtree(tmp_path, ignore_errors=True)
    print(
        f"\nquickstart job at Qwen2.5-0.5B's shape: model folder written in {written:.0f} s, rlmesh up ran "
        f"{STEPS} steps in {ran:.0f} s; "
        + "; ".join(
            f"step {step}: reward {line['reward']:.3f}, step_seconds {line['step_seconds']:.0f}"
            for step, line in sorted(steps.items())
        )
    )
