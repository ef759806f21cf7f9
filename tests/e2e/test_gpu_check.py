"""The GPU check (`python -m bench.gpu`) run on the CPU at small shapes, so the script that a GPU
machine runs now and then cannot rot between those runs: every section completes, parity holds,
the short job's reward rises, and the critic job logs its critic's figures every step."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_the_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-cpu.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--out", str(out), "--work-dir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["failed"] == []
    assert out.with_suffix(".log").read_text().count("section ") >= 14

    parity = figures["parity"]
    assert parity["holds"]
    assert parity["float32"]["greedy_equal_alone"] == parity["bfloat16"]["greedy_equal_alone"] == parity["prompts"]
    assert parity["float32"]["max_logprob_difference"] <= 1e-4
    assert parity["float32"]["tokens"] > 0

    for name in ("small", "small-deep"):
        step = figures["train_step"][name]
        assert step["step_seconds"] > 0 and step["peak_memory_gib"] == 0
    path = figures["weight_path"]["small"]
    assert len(path["stored_to_served_all"]) == figures["sizes"]["pushes"]
    assert path["stored_to_served_seconds"] > 0 and path["baseline"]["seconds"] > 0
    decode = figures["weight_path"]["small"]
    assert set(decode["decode_tokens_per_second"]) == {"1", "4", "8"}
    assert all(rate > 0 for rate in decode["decode_tokens_per_second"].values())
    during = decode["decode_during_push"]
    assert during["push_window_seconds"] > 0 and during["tokens_per_second_without_push"] > 0

    for batch in ("1", "8"):
        steps = figures["engine_steps"][batch]
        assert steps["engine_tokens_per_second"] > 0 and steps["hf_step_ms"] > 0

    job = figures["short_job"]
    assert job["completed"] and job["steps"] == 30
    assert job["reward_last"] > job["reward_first"]

    critic = figures["critic_job"]
    assert critic["completed"] and critic["steps"] == critic["critic_steps"] == figures["sizes"]["critic_job_steps"]
    assert critic["critic_finite"] and critic["critic"]["critic/value_loss"] >= 0
