"""The torch engine on a real model: agreement with HF greedy decoding and with the trainer's
log-probabilities, stop and length handling, abort, and the weight switch between decode steps."""

import asyncio

import pytest
import torch

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from services.rollout.engine import EngineRequest, Finish, Sampling
from services.rollout.torch_engine import TorchEngine
from services.trainer.batching import TrainingSample, build_micro_batch, token_logprobs


async def collect(engine, request):
    tokens, logprobs, versions, finish = [], [], [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        finish = chunk.finish
    return tokens, logprobs, versions, finish


@pytest.fixture
async def engine(model_dir):
    engine = TorchEngine(model_dir, max_batch_size=32, seed=1)
    await engine.start()
    yield engine
    await engine.stop()


def prompts(model_dir, texts):
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.encode(t).ids for t in texts], tokenizer.token_to_id(EOS_TOKEN)


async def test_greedy_batch_matches_hf_generate(engine, model_dir):
    ids, eos = prompts(model_dir, ["1234=", "98765432=", "50="])
    results = await asyncio.gather(*[
        collect(engine, EngineRequest(f"r{i}", p, Sampling(temperature=0, max_tokens=10, stop_token_ids=frozenset({eos}))))
        for i, p in enumerate(ids)
    ])
    model = load_causal_lm(model_dir)
    for prompt, (tokens, _, _, finish) in zip(ids, results):
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=eos,
                                  pad_token_id=load_tokenizer(model_dir).token_to_id(PAD_TOKEN))[0, len(prompt):].tolist()
        assert tokens == expected[: len(tokens)]
        assert finish is (Finish.STOP if tokens[-1] == eos else Finish.LENGTH)


async def test_sampling_logprobs_match_the_trainer(engine, model_dir):
    ids, eos = prompts(model_dir, ["31415=", "2718="])
    results = await asyncio.gather(*[
        collect(engine, EngineRequest(f"s{i}", p, Sampling(temperature=0.7, max_tokens=8, stop_token_ids=frozenset({eos}))))
        for i, p in enumerate(ids)
    ])
    samples = [TrainingSample(p, r[0], r[1], 0.0) for p, r in zip(ids, results)]
    batch = build_micro_batch(samples, pad_id=0)
    with torch.no_grad():
        trainer_logprobs = token_logprobs(load_causal_lm(model_dir), batch, temperature=0.7)
    mask = batch.response_mask.bool()
    assert torch.allclose(trainer_logprobs[mask], batch.behaviour_logprobs[mask], atol=1e-4)


async def test_length_limit_and_abort(engine, model_dir):
    ids, _ = prompts(model_dir, ["1111="])
    tokens, logprobs, versions, finish = await collect(engine, EngineRequest("len", ids[0], Sampling(temperature=1.0, max_tokens=3)))
    assert len(tokens) == len(logprobs) == len(versions) == 3 and finish is Finish.LENGTH

    async def abort_soon():
        await asyncio.sleep(0)
        return engine.abort(["long"])

    long_request = EngineRequest("long", ids[0], Sampling(temperature=1.0, max_tokens=50))
    (tokens, _, _, finish), _ = await asyncio.gather(collect(engine, long_request), abort_soon())
    assert finish is Finish.ABORT and len(tokens) < 50


async def test_bad_requests_are_refused(engine, model_dir):
    with pytest.raises(InvalidArgument, match="empty"):
        await collect(engine, EngineRequest("x", [], Sampling()))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        await collect(engine, EngineRequest("x", [10_000], Sampling()))
    with pytest.raises(InvalidArgument, match="positions"):
        await collect(engine, EngineRequest("x", [1], Sampling(max_tokens=10_000)))


async def test_weights_switch_between_decode_steps(engine, model_dir):
    ids, _ = prompts(model_dir, ["123="])
    new_weights = {name: torch.zeros_like(t) for name, t in trainable_tensors(load_causal_lm(model_dir)).items()}
    with pytest.raises(FailedPrecondition):
        await engine.commit_staged(1)
    await asyncio.to_thread(engine.stage_weights, 1, new_weights)
    assert engine.weight_version == 0
    await engine.commit_staged(1)
    assert engine.weight_version == 1
    tokens, logprobs, versions, _ = await collect(engine, EngineRequest("after", ids[0], Sampling(temperature=0, max_tokens=4)))
    assert versions == [1, 1, 1, 1]
    # All-zero weights give uniform logits: every token has probability 1/vocab.
    assert logprobs[0] == pytest.approx(-torch.log(torch.tensor(float(len(new_weights["model.embed_tokens.weight"])))).item(), abs=1e-5)
    with pytest.raises(FailedPrecondition, match="not newer"):
        engine.stage_weights(1, new_weights)


async def test_a_request_running_during_a_switch_reports_both_versions(engine, model_dir):
    ids, _ = prompts(model_dir, ["5555="])
    weights = trainable_tensors(load_causal_lm(model_dir))
    await asyncio.to_thread(engine.stage_weights, 1, weights)
    request = EngineRequest("during", ids[0], Sampling(temperature=1.0, max_tokens=40))
    versions = []
    async for chunk in engine.generate(request):
        versions += chunk.weight_versions
        if len(versions) == 3:
            await engine.commit_staged(1)
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)
