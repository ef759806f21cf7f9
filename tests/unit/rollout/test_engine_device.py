"""Where and in which dtype the torch engine serves (`engine.device`, `engine.dtype`; the job fields
`rollout.engine.device` and `model.dtype` reach them, see test_job.py): a GPU asked for where there is
none is refused with a message naming it, and a dtype other than the folder's is served and
expected of pushes."""

import pytest
import torch

from rlmesh.config import ConfigError
from rlmesh.job import load_job
from rlmesh.models.random_init import scaled_config, write_random_model
from services.rollout.config import EngineConfig
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.torch.device import engine_device, serving_dtype
from services.rollout.torch.engine import TorchEngine

cuda_absent = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without a GPU")


@cuda_absent
def test_a_cuda_engine_on_a_host_without_a_gpu_is_refused_with_a_message(model_dir):
    with pytest.raises(ValueError, match="engine device cuda: torch .* sees no CUDA device"):
        TorchEngine(model_dir, device="cuda")


def test_device_and_dtype_values_are_checked():
    with pytest.raises(ValueError, match="must be cpu or cuda, got 'tpu'"):
        engine_device("tpu", 1)
    with pytest.raises(ValueError, match="auto, bfloat16 or float32, got 'int8'"):
        serving_dtype("int8")
    assert engine_device("cpu", 2) == torch.device("cpu") and serving_dtype("auto") is None
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        EngineConfig(model_dir="m", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="applies to the torch engine"):
        EngineConfig(kind="synthetic", device="cuda")


def test_the_job_refuses_a_gpu_rollout_split_over_ranks_or_on_vllm():
    with pytest.raises(ConfigError, match="rollout.engine: .*tensor_parallel_size must be 1"):
        load_job(None, {"rollout.engine.device": "cuda", "rollout.engine.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="vLLM picks its device itself"):
        load_job(None, {"rollout.engine.device": "cuda", "rollout.engine.kind": "vllm"})
    with pytest.raises(ConfigError, match="rollout.engine.device"):
        load_job(None, {"rollout.engine.device": "gpu"})


@cuda_absent
def test_up_refuses_a_gpu_mesh_on_a_host_without_one(tmp_path, model_dir, capsys, monkeypatch):
    from rlmesh.cli import main as cli

    monkeypatch.setattr("rlmesh.logging.configure_logging", lambda *args, **kwargs: None)
    assert (
        cli.main(
            [
                "up",
                "--set",
                "trainer.distributed_backend=nccl",
                "--model-dir",
                str(model_dir),
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "trainer.distributed_backend = nccl, but torch" in capsys.readouterr().err
    assert (
        cli.main(
            ["up", "--set", "rollout.engine.device=cuda", "--model-dir", str(model_dir), "--output-dir", str(tmp_path)]
        )
        == 2
    )
    assert "rollout.engine.device = cuda, but torch" in capsys.readouterr().err


async def test_an_engine_serves_in_the_dtype_asked_for_whatever_the_folder_holds(tmp_path):
    folder = write_random_model(tmp_path / "bf16", scaled_config("qwen2"), dtype=torch.bfloat16)
    for dtype, expected in (("auto", torch.bfloat16), ("float32", torch.float32)):
        engine = TorchEngine(folder, max_batch_size=2, dtype=dtype)
        await engine.start()
        try:
            assert {spec.dtype for spec in engine.parameter_specs()} == {expected}
            assert {spec.dtype for spec in engine.rank_parameter_specs()} == {expected}
            assert {p.dtype for p in engine._group.runner.active.parameters()} == {expected}
            tokens = [
                t
                async for chunk in engine.generate(EngineRequest("r", [5, 6, 7], Sampling(temperature=0, max_tokens=4)))
                for t in chunk.token_ids
            ]
            assert len(tokens) == 4
        finally:
            await engine.stop()
