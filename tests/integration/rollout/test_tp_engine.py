"""The torch engine split over two tensor-parallel processes (gloo on loopback): the same greedy
tokens and logprobs as one process for the same weights, with KV heads split or replicated,
through continuous batching and after a version staged from full tensors; Llama and Qwen3 models
(row-parallel o_proj bias, q/k norms, head_dim apart from hidden / heads) decode as HF does; the
configuration refuses layouts that do not split."""

import asyncio

import pytest
import pytest_asyncio
import torch

from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
from rlmesh.models.random_init import scaled_config, write_random_model
from rlmesh.models.tokenizer import load_tokenizer
from services.rollout.config import EngineConfig
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.torch.engine import TorchEngine
from tests.support.engines import engine_output

module_loop = pytest.mark.asyncio(loop_scope="module")

TEXTS = ["1234=", "98765432=", "50=", "7=", "314159="]


async def greedy_batch(engine, prompts, tag, max_tokens=20):
    """All but the last prompt start together; the last joins a batch already decoding."""

    async def late(prompt):
        while engine.generated_tokens == start:
            await asyncio.sleep(0.001)
        return await engine_output(
            engine, EngineRequest(f"{tag}-late", prompt, Sampling(temperature=0, max_tokens=max_tokens))
        )

    start = engine.generated_tokens
    return await asyncio.gather(
        *[
            engine_output(engine, EngineRequest(f"{tag}-{i}", p, Sampling(temperature=0, max_tokens=max_tokens)))
            for i, p in enumerate(prompts[:-1])
        ],
        late(prompts[-1]),
    )


def assert_same(results, expected):
    for (tokens, logprobs, versions, _), (want_tokens, want_logprobs, want_versions, _) in zip(
        results, expected, strict=True
    ):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        assert versions == want_versions


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_dir):
    single = TorchEngine(model_dir, max_batch_size=32, seed=1)
    split = TorchEngine(model_dir, max_batch_size=32, seed=1, tensor_parallel_size=2)
    await single.start()
    await split.start()
    yield single, split
    await split.stop()
    await single.stop()


def prompt_ids(model_dir):
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.encode(t).ids for t in TEXTS]


@module_loop
async def test_two_ranks_decode_the_same_greedy_tokens_as_one(engines, model_dir):
    single, split = engines
    assert (single.tensor_parallel_size, split.tensor_parallel_size) == (1, 2)
    prompts = prompt_ids(model_dir)
    expected = [
        await engine_output(single, EngineRequest(f"alone-{i}", p, Sampling(temperature=0, max_tokens=20)))
        for i, p in enumerate(prompts)
    ]
    assert_same(await greedy_batch(split, prompts, "split"), expected)
    # Each rank received only its own tensors: half the heads, half the MLP, half the padded vocabulary.
    shapes = {spec.name: spec.shape for spec in split.rank_parameter_specs()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((8 + 2 * 4) * 16 // 2, 128)
    assert shapes["model.embed_tokens.weight"] == (32, 128)


@module_loop
async def test_a_version_staged_from_full_tensors_reaches_every_rank(engines, model_dir):
    single, split = engines
    generator = torch.Generator().manual_seed(7)
    weights = {
        name: t * (1 + 0.2 * torch.randn(t.shape, generator=generator))
        for name, t in trainable_tensors(load_causal_lm(model_dir)).items()
    }
    for engine in engines:
        await asyncio.to_thread(engine.stage_weights, 1, weights)
        await engine.commit_staged(1)
    prompts = prompt_ids(model_dir)
    expected = await greedy_batch(single, prompts, "single-v1")
    assert {v for r in expected for v in r[2]} == {1}
    assert_same(await greedy_batch(split, prompts, "split-v1"), expected)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory):
    """Fewer KV heads than ranks: both ranks hold a copy of the one KV head."""
    return create_default_model(tmp_path_factory.mktemp("kv1"), TinyModelSpec(kv_heads=1, warmup_iterations=15))


@module_loop
async def test_ranks_beyond_the_kv_heads_replicate_them(one_kv_head_model):
    single = TorchEngine(one_kv_head_model, max_batch_size=8)
    split = TorchEngine(one_kv_head_model, max_batch_size=8, tensor_parallel_size=2)
    await single.start()
    await split.start()
    try:
        prompts = prompt_ids(one_kv_head_model)
        expected = [
            await engine_output(single, EngineRequest(f"a{i}", p, Sampling(temperature=0, max_tokens=12)))
            for i, p in enumerate(prompts)
        ]
        assert_same(await greedy_batch(split, prompts, "kv1", max_tokens=12), expected)
    finally:
        await split.stop()
        await single.stop()


def test_the_configuration_refuses_layouts_that_do_not_split(model_dir):
    with pytest.raises(ValueError, match="8 attention heads do not split over 3 ranks"):
        EngineConfig(model_dir=str(model_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="only the torch engine"):
        EngineConfig(kind="vllm", model_dir=str(model_dir), tensor_parallel_size=2)
    assert EngineConfig(model_dir=str(model_dir), tensor_parallel_size=2).tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("family", "settings"),
    [
        ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
        ("qwen3", {"tie_word_embeddings": False, "attention_bias": True}),
    ],
)
@module_loop
async def test_other_families_decode_on_two_ranks_as_hf_does(family, settings, tmp_path):
    """The combinations tests/integration/trainer/test_model_families.py leaves out: biases on all four
    attention projections (o_proj's added once, after the row-parallel sum)."""
    model_dir = write_random_model(tmp_path / family, scaled_config(family, **settings), seed=5)
    model = load_causal_lm(model_dir)
    # The engine stops on a request's stop tokens only, and these requests name none.
    model.generation_config.eos_token_id = None
    split = TorchEngine(model_dir, max_batch_size=8, tensor_parallel_size=2)
    await split.start()
    try:
        prompts = prompt_ids(model_dir)
        results = await greedy_batch(split, prompts, family, max_tokens=12)
    finally:
        await split.stop()
    for prompt, (tokens, logprobs, _, _) in zip(prompts, results):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
        assert tokens == want
        with torch.no_grad():
            reference = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        assert logprobs == pytest.approx(
            reference.gather(1, torch.tensor(tokens)[:, None]).flatten().tolist(), abs=1e-4
        )
