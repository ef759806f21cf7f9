"""The rollout contract on the vLLM engine, through gRPC: the same greedy tokens and logprobs as the
torch engine, sampled logprobs as the trainer computes them, chunk invariants, continuation, abort,
pause and resume, a weight version pushed over the gRPC stream while a request runs, and refusal of
invalid requests (a token outside the vocabulary; top_p < 1, whose logprobs vLLM reports after
truncation)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.models.loading import copy_into, load_causal_lm, trainable_tensors
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.base import raw_frames
from rlmesh.transfer.grpc_stream import GrpcStreamSender
from rlmesh.transfer.payload import pack
from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from tests.support.vllm_rollout import VLLM_ID, PairedInstances

pytestmark = pytest.mark.asyncio(loop_scope="module")

RPC_TIMEOUT = 10
STREAM_TIMEOUT = 60
ATOL = 1e-4
PROMPTS = ["1234=", "98765432=", "50=", "7=", "31415="]
LONG = 500
"""Tokens of the requests that get paused or aborted mid-stream (the model has 512 positions)."""
ATTEMPTS = 8
"""A loaded machine can stall this process long enough for such a request to finish before the
pause or abort reaches it; the scenario is then set up again with new request ids, after a
growing wait (`settle`): once, in a full `make test`, five attempts made back to back all saw the
request's 500 tokens arrive at once."""
LONG_PROMPT = "1234567890" * 13 + "="
"""131 tokens: longer than one 128-token KV block, so vLLM's prefix cache keeps its first block."""


@dataclass
class Response:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    chunks: list[common_pb2.TokenChunk] = field(default_factory=list)

    @property
    def finish(self) -> int:
        return self.chunks[-1].finish_reason if self.chunks else common_pb2.FINISH_REASON_UNSPECIFIED

    def add(self, chunk: common_pb2.TokenChunk) -> None:
        self.chunks.append(chunk)
        self.tokens += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.weight_versions


def params(temperature: float, max_tokens: int, stop: list[int] = (), seed: int = 0) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=temperature, max_tokens=max_tokens, stop_token_ids=list(stop), seed=seed
    )


async def generate(
    stub: rollout_pb2_grpc.RolloutServiceStub,
    request_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams,
    continued: list[int] = (),
    into: Response | None = None,
) -> Response:
    """The whole stream of one request; `into` shows the tokens to a concurrent observer as they come."""
    response = into if into is not None else Response()
    request = rollout_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, continued_token_ids=list(continued)
    )
    async for reply in stub.Generate(request, timeout=STREAM_TIMEOUT):
        response.add(reply.chunk)
    return response


async def info(stub: rollout_pb2_grpc.RolloutServiceStub) -> rollout_pb2.GetInfoResponse:
    return await stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=RPC_TIMEOUT)


async def settle(attempt: int) -> None:
    """Before setting a racing scenario up again: gives whatever stalled the last one time to pass."""
    await asyncio.sleep(attempt + 1)


async def until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.002)


async def push_version(
    stub: rollout_pb2_grpc.RolloutServiceStub, tensors: dict[str, torch.Tensor], version: int
) -> rollout_pb2.CommitWeightUpdateResponse:
    """Begin, the payload over the gRPC stream backend (as the weights service sends it), commit."""
    manifest, payload = pack(tensors, version=version)
    begin = await stub.BeginWeightUpdate(
        rollout_pb2.BeginWeightUpdateRequest(manifest=manifest, backend=rollout_pb2.TRANSFER_BACKEND_GRPC),
        timeout=RPC_TIMEOUT,
    )
    await GrpcStreamSender().send_rank(
        stub, begin.ranks[0], manifest, payload, raw_frames(manifest, payload), RPC_TIMEOUT, lambda: False
    )
    return await stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=version), timeout=RPC_TIMEOUT)


def assert_well_formed(response: Response, request_id: str) -> None:
    """Every chunk carries one logprob and one version per token; only the last one has a finish reason."""
    assert response.chunks, f"{request_id}: no chunk"
    for chunk in response.chunks:
        assert chunk.request_id == request_id
        assert len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.weight_versions)
    assert [c.finish_reason for c in response.chunks[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * (
        len(response.chunks) - 1
    )
    assert response.finish != common_pb2.FINISH_REASON_UNSPECIFIED
    assert all(lp <= 0 for lp in response.logprobs)


async def greedy_on_both(
    instances: PairedInstances, texts: list[str], tag: str, max_tokens: int = 12
) -> list[tuple[Response, Response]]:
    sampling = params(0.0, max_tokens, stop=[instances.eos])
    prompts = [instances.encode(t) for t in texts]
    vllm = [generate(instances.vllm, f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    torch_ = [generate(instances.torch, f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*vllm, *torch_)
    return list(zip(results[: len(prompts)], results[len(prompts) :]))


def assert_same_greedy(pairs: list[tuple[Response, Response]], version: int, eos: int, max_tokens: int = 12) -> None:
    for index, (vllm, torch_) in enumerate(pairs):
        assert vllm.tokens == torch_.tokens, f"prompt {index}: vLLM {vllm.tokens} != torch {torch_.tokens}"
        assert vllm.finish == torch_.finish
        assert vllm.finish == (
            common_pb2.FINISH_REASON_STOP if vllm.tokens[-1] == eos else common_pb2.FINISH_REASON_LENGTH
        )
        if vllm.finish == common_pb2.FINISH_REASON_LENGTH:
            assert len(vllm.tokens) == max_tokens
        assert torch.allclose(torch.tensor(vllm.logprobs), torch.tensor(torch_.logprobs), atol=ATOL), (
            f"prompt {index}: vLLM {vllm.logprobs} vs torch {torch_.logprobs}"
        )
        assert vllm.versions == torch_.versions == [version] * len(vllm.tokens)


async def test_both_instances_serve_the_same_model(instances):
    vllm, torch_ = await info(instances.vllm), await info(instances.torch)
    assert (vllm.engine, torch_.engine) == ("vllm", "torch")
    assert vllm.model == torch_.model == instances.model_dir.name
    assert vllm.weight_version == torch_.weight_version == instances.version
    assert not vllm.paused and vllm.running_requests == 0


async def test_greedy_tokens_and_logprobs_match_the_torch_engine(instances):
    pairs = await greedy_on_both(instances, PROMPTS + [LONG_PROMPT], "greedy")
    assert_same_greedy(pairs, instances.version, instances.eos)
    assert any(v.finish == common_pb2.FINISH_REASON_STOP for v, _ in pairs), "no response reached the stop token"


async def test_sampled_logprobs_match_the_trainer(instances):
    """At temperature 0.7 the logprob vLLM reports for each sampled token is the trainer's:
    log-softmax of the logits divided by the temperature."""
    requests = [
        (f"sampled-{i}-{seed}", instances.encode(text), seed) for i, text in enumerate(PROMPTS) for seed in (0, 11)
    ]
    responses = await asyncio.gather(
        *[
            generate(instances.vllm, request_id, prompt, params(0.7, 12, stop=[instances.eos], seed=seed))
            for request_id, prompt, seed in requests
        ]
    )
    for (request_id, _, _), response in zip(requests, responses):
        assert_well_formed(response, request_id)
    samples = [TrainingSample(prompt, r.tokens, r.logprobs, 0.0) for (_, prompt, _), r in zip(requests, responses)]
    batch = build_micro_batch(samples, pad_id=instances.pad)
    model = load_causal_lm(instances.model_dir)
    if instances.tensors is not None:
        copy_into(model, instances.tensors)
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7)
    mask = batch.response_mask.bool()
    assert torch.allclose(trainer[mask], batch.behaviour_logprobs[mask], atol=ATOL), (
        f"largest difference {(trainer[mask] - batch.behaviour_logprobs[mask]).abs().max():.2e}"
    )


async def test_chunks_carry_one_logprob_and_version_per_token(instances):
    prompt = instances.encode("2468=")
    by_length, by_stop = await asyncio.gather(
        generate(instances.vllm, "chunks-length", prompt, params(1.0, 40, seed=3)),
        generate(instances.vllm, "chunks-stop", prompt, params(0.0, 40, stop=[instances.eos])),
    )
    assert_well_formed(by_length, "chunks-length")
    assert_well_formed(by_stop, "chunks-stop")
    assert by_length.finish == common_pb2.FINISH_REASON_LENGTH and len(by_length.tokens) == 40
    assert by_stop.finish == common_pb2.FINISH_REASON_STOP and by_stop.tokens[-1] == instances.eos
    assert instances.eos not in by_stop.tokens[:-1]
    assert set(by_length.versions) == set(by_stop.versions) == {instances.version}
    reply = await info(instances.vllm)
    assert reply.running_requests == 0 and reply.generated_tokens >= 40 + len(by_stop.tokens)


async def test_continuation_gives_the_rest_of_a_greedy_response(instances):
    prompt = instances.encode("777=")
    full = await generate(instances.vllm, "whole", prompt, params(0.0, 16))
    assert len(full.tokens) == 16
    for k in (1, 6, 15):
        rest = await generate(instances.vllm, f"rest-{k}", prompt, params(0.0, 16), continued=full.tokens[:k])
        assert_well_formed(rest, f"rest-{k}")
        assert rest.tokens == full.tokens[k:]
        assert rest.finish == common_pb2.FINISH_REASON_LENGTH
        assert torch.allclose(torch.tensor(rest.logprobs), torch.tensor(full.logprobs[k:]), atol=ATOL)


async def test_abort_ends_one_request_and_spares_the_other(instances):
    prompt = instances.encode("13=")
    for attempt in range(ATTEMPTS):
        doomed, survivor = Response(), Response()
        running = asyncio.gather(
            generate(instances.vllm, f"doomed-{attempt}", prompt, params(1.0, LONG, seed=5), into=doomed),
            generate(instances.vllm, f"survivor-{attempt}", prompt, params(1.0, LONG, seed=6), into=survivor),
        )
        await until(lambda doomed=doomed: doomed.tokens)
        reply = await instances.vllm.Abort(
            rollout_pb2.AbortRequest(request_ids=[f"doomed-{attempt}", "never-started"]), timeout=RPC_TIMEOUT
        )
        await running
        if reply.aborted == 1:
            break
        assert doomed.finish == common_pb2.FINISH_REASON_LENGTH, "a request that was not aborted ended early"
        await settle(attempt)
    else:
        pytest.fail(f"the request finished before the abort reached it, {ATTEMPTS} times")
    assert_well_formed(doomed, f"doomed-{attempt}")
    assert_well_formed(survivor, f"survivor-{attempt}")
    assert doomed.finish == common_pb2.FINISH_REASON_ABORT and 0 < len(doomed.tokens) < LONG
    assert survivor.finish == common_pb2.FINISH_REASON_LENGTH and len(survivor.tokens) == LONG


async def test_pause_holds_requests_and_resume_finishes_them(instances):
    prompt = instances.encode("99=")
    for attempt in range(ATTEMPTS):
        held = [Response(), Response()]
        running = asyncio.gather(
            *[
                generate(instances.vllm, f"held-{attempt}-{i}", prompt, params(1.0, LONG, seed=7 + i), into=held[i])
                for i in range(2)
            ]
        )
        try:
            await until(lambda held=held: all(r.tokens for r in held))
            reply = await instances.vllm.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=RPC_TIMEOUT)
            if reply.held_requests == 2:
                await asyncio.sleep(0.1)
                before = await info(instances.vllm)
                await asyncio.sleep(0.5)
                after = await info(instances.vllm)
                assert before.paused and after.paused and after.running_requests == 2
                assert after.generated_tokens == before.generated_tokens, "tokens were generated while paused"
                assert all(r.finish == common_pb2.FINISH_REASON_UNSPECIFIED and len(r.tokens) < LONG for r in held)
        finally:
            await instances.vllm.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT)
            await running
        if reply.held_requests == 2:
            break
        await settle(attempt)
    else:
        pytest.fail(f"the requests finished before the pause reached them, {ATTEMPTS} times")
    for i, response in enumerate(held):
        assert_well_formed(response, f"held-{attempt}-{i}")
        assert response.finish == common_pb2.FINISH_REASON_LENGTH and len(response.tokens) == LONG
    assert not (await info(instances.vllm)).paused


async def test_a_new_version_pushed_mid_request_serves_the_torch_engines_tokens(instances):
    """Version v+1 arrives over the gRPC stream while a request runs: the request's tokens before
    the switch carry v, those after carry v+1, and afterwards greedy output matches the torch
    engine holding the same weights, also for a prompt whose first KV block vLLM had cached under v."""
    old, new = instances.version, instances.version + 1
    generator = torch.Generator().manual_seed(new)
    base = instances.tensors or trainable_tensors(load_causal_lm(instances.model_dir))
    tensors = {name: t * (1 + 0.1 * torch.randn(t.shape, generator=generator)) for name, t in base.items()}
    before = await greedy_on_both(instances, PROMPTS[:2] + [LONG_PROMPT], "before")

    prompt = instances.encode("4321=")
    reference = await generate(instances.vllm, "reference", prompt, params(0.0, LONG))
    for attempt in range(ATTEMPTS):
        across = Response()
        running = asyncio.create_task(
            generate(instances.vllm, f"across-{attempt}", prompt, params(0.0, LONG), into=across)
        )
        await until(lambda across=across: across.tokens)
        await instances.vllm.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=RPC_TIMEOUT)
        seen = len(across.tokens)
        running_requests = (await info(instances.vllm)).running_requests
        if running_requests == 1:
            break
        await instances.vllm.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT)
        await running
        await settle(attempt)
    else:
        pytest.fail(
            f"the request finished before the pause reached it, {ATTEMPTS} times (last: {seen} tokens seen, "
            f"{len(across.tokens)} in all, finish {across.finish}, {running_requests} running)"
        )
    try:
        commit = await push_version(instances.vllm, tensors, new)
        assert commit.weight_version == new
        reply = await info(instances.vllm)
        assert reply.weight_version == new and reply.paused
    finally:
        await instances.vllm.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT)
        await running
    assert (await push_version(instances.torch, tensors, new)).weight_version == new
    instances.version, instances.tensors = new, tensors

    assert_well_formed(across, f"across-{attempt}")
    assert across.finish == common_pb2.FINISH_REASON_LENGTH and len(across.tokens) == LONG
    # The client may not have seen every token made before the pause when it counted.
    switched_at = across.versions.count(old)
    assert seen <= switched_at < LONG
    assert across.versions == [old] * switched_at + [new] * (LONG - switched_at)
    assert across.tokens[:switched_at] == reference.tokens[:switched_at]
    after = await greedy_on_both(instances, PROMPTS[:2] + [LONG_PROMPT], "after")
    assert_same_greedy(after, new, instances.eos)
    changed = [
        not torch.allclose(torch.tensor(b.logprobs[:1]), torch.tensor(a.logprobs[:1]), atol=1e-3)
        for (b, _), (a, _) in zip(before, after)
    ]
    assert all(changed), "the new weights did not change the first token's logprob"


async def test_a_token_outside_the_vocabulary_is_refused(instances):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(instances.vllm, "bad", [1, 2, 999], params(1.0, 4))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "bad" in caught.value.details() and "[999]" in caught.value.details() and "vocabulary" in caught.value.details()
    )
    # vLLM's logprobs would be of the top-p truncated distribution, not the one the trainer scores.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(
            instances.vllm, "truncated", [1, 2], common_pb2.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in caught.value.details()
    reply = await info(instances.vllm)
    assert reply.running_requests == 0


def engine_core_pid(pid: int) -> int:
    """The child of the vLLM rollout process that runs vLLM's engine core (it names itself so)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    named = {child: Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode() for child in children}
    [core] = [child for child, cmdline in named.items() if "EngineCore" in cmdline]
    return core


async def test_an_engine_core_that_dies_takes_its_instance_out_of_the_pool_and_the_process_exits(instances):
    """Last in this module: it ends the vLLM instance. vLLM's engine core killed, the next request
    fails saying so (no INTERNAL, no circling), the instance deregisters and its process exits
    for its supervisor to start it again."""
    os.kill(engine_core_pid(instances.process.pid), signal.SIGKILL)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(instances.vllm, "after-death", [1, 2, 3], params(1.0, 4))
    assert caught.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE), (
        caught.value.details()
    )
    deadline = time.monotonic() + 30
    while instances.process.poll() is None or VLLM_ID in instances.manager_state.instances:
        assert time.monotonic() < deadline, "the instance did not leave the pool and exit within 30 s"
        await asyncio.sleep(0.2)
    log = instances.log_path.read_text()
    assert "vLLM's engine core died" in log and "drained" in log
