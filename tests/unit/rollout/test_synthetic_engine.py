"""The synthetic engine in a job (`rollout.engine.kind = synthetic`, benchmarks only): a trainer of
the job's model embeds its tokens, so with a model folder they stay within the model's vocabulary."""

from transformers import Qwen2Config

from rlmesh.job import Job
from rlmesh.settings.rollout import SyntheticConfig
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.synthetic_engine import SyntheticEngine
from tests.support.engines import engine_output


def test_a_job_takes_the_synthetic_engine_but_never_by_default():
    assert Job().rollout.engine.kind == "torch"
    job = Job.model_validate({"rollout": {"engine": {"kind": "synthetic", "synthetic": {"mean_tokens": 8}}}})
    assert job.rollout.engine.kind == "synthetic"
    assert job.rollout.engine.synthetic.mean_tokens == 8


async def test_with_a_model_folder_its_tokens_stay_within_the_model_s_vocabulary(tmp_path):
    Qwen2Config(
        vocab_size=14, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path)
    engine = SyntheticEngine(
        SyntheticConfig(length="fixed", mean_tokens=400, min_step_seconds=1e-4), model_dir=tmp_path
    )
    assert engine.vocab_size == 14
    assert SyntheticEngine(SyntheticConfig()).vocab_size == SyntheticConfig().vocab_size
    await engine.start()
    try:
        tokens, _, _, _ = await engine_output(engine, EngineRequest("r", [1, 2, 3], Sampling(max_tokens=400)))
    finally:
        await engine.stop()
    assert len(tokens) == 400
    assert max(tokens) < 14
