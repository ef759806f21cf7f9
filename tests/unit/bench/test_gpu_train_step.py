"""The GPU training-step benchmark runs on CPU at a tiny shape, twice in one process (one call per
model shape), with the precision and published dtype the trainer would pick."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.gpu.train_step import measure_grpo_step, synthetic_samples
from rlmesh.models.random_init import scaled_config, write_random_model


def test_synthetic_samples_have_the_asked_shape():
    samples = synthetic_samples(3, 80, 50, torch.Generator().manual_seed(0))
    assert len(samples) == 3
    for sample in samples:
        assert (len(sample.prompt_ids), len(sample.response_ids), len(sample.behaviour_logprobs)) == (40, 40, 40)
        assert all(0 <= t < 50 for t in sample.prompt_ids + sample.response_ids)


def test_a_grpo_step_is_measured_on_cpu_twice_in_one_process(tmp_path):
    float32_dir = write_random_model(tmp_path / "f32", scaled_config("qwen2"))
    bfloat16_dir = write_random_model(tmp_path / "bf16", scaled_config("qwen2"), dtype=torch.bfloat16)
    first = measure_grpo_step(float32_dir, "cpu", samples=4, tokens=24, micro_batch_samples=2, steps=2)
    assert not dist.is_initialized(), "the process group is shut down at the end"
    second = measure_grpo_step(bfloat16_dir, "cpu", samples=3, tokens=16, micro_batch_samples=2, steps=1)
    assert first["precision"] == second["precision"] == "fp32", "auto is fp32 on CPU"
    assert (first["weights_dtype"], second["weights_dtype"]) == ("float32", "bfloat16")
    assert second["publish_bytes"] < first["publish_bytes"], "a bf16 folder's versions are published in bf16"
    for result in (first, second):
        assert result["step_seconds"] > 0 and result["pack_seconds"] > 0
        assert result["peak_memory_gib"] == 0.0 and result["device"] == "cpu"
    assert first["tokens_per_second"] == 4 * 24 / first["step_seconds"]
