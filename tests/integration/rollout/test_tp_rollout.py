"""A rollout instance split over two tensor-parallel processes behind its real gRPC server: each
rank receives only its own payload (TCP, Mooncake, or gRPC chunks routed by rank, raw or XOR
delta against the version it holds; full tensors still go through rank 0), a bad bucket on one
rank leaves the old version served, generation goes on while a version loads, switching every
rank between the same two steps, and a dead rank takes the instance out of the pool."""

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch
from transformers import DynamicCache

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition
from rlmesh.models.loading import copy_into, load_causal_lm
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.transfer.base import raw_frames
from rlmesh.transfer.codecs import BucketCodec
from rlmesh.transfer.grpc_stream import GrpcStreamSender
from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeSender
from rlmesh.transfer.payload import bucket_ranges, pack
from rlmesh.transfer.tcp import TcpSender
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.main import start as start_rollout
from tests.support.credentials import loopback
from tests.support.engines import engine_output, greedy_outputs
from tests.support.tensors import perturbed_weights
from tests.support.tp_instances import (
    TCP,
    TP,
    assert_serves_the_reference,
    begin_update,
    commit_version,
    rank_payloads,
    send_all,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")


def slow_frames(manifest, payload, pause: float):
    for frame in raw_frames(manifest, payload):
        time.sleep(pause)
        yield frame


def delta_frames(manifest, payload, base_manifest, base_payload):
    codec = BucketCodec("delta", torch.float32)
    new, old = payload.numpy(), base_payload.numpy()
    for start, end in bucket_ranges(manifest.total_bytes, manifest.bucket_bytes):
        yield (
            start,
            end - start,
            common_pb2.COMPRESSION_DELTA,
            base_manifest.version,
            codec.encode(new[start:end], old[start:end]).data,
        )


async def test_the_instance_reports_its_layout_and_decodes_like_one_process(instance):
    info = await instance.stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=5)
    assert info.tensor_parallel_size == TP
    assert info.weight_layout == rollout_pb2.WEIGHT_LAYOUT_TENSOR_PARALLEL
    assert not info.quantized_weights and info.transfer_session
    prompt = instance.prompts()[1]
    tokens = []
    request = rollout_pb2.GenerateRequest(
        request_id="grpc", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=16)
    )
    async for reply in instance.stub.Generate(request, timeout=30):
        tokens += reply.chunk.token_ids
    expected, _, _, _ = await engine_output(
        instance.reference, EngineRequest("grpc-reference", prompt, Sampling(temperature=0, max_tokens=16))
    )
    assert tokens == expected


async def test_a_push_over_tcp_then_a_delta_over_grpc_against_the_version_each_rank_holds(instance):
    version = instance.version + 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version)
    reply = await begin_update(instance, payloads, TCP)
    assert all(r.data_address for r in reply.ranks)
    assert len({r.data_address for r in reply.ranks}) == TP
    await send_all(TcpSender(), instance, reply, payloads, raw_frames)
    await commit_version(instance, version, weights, payloads)
    await assert_serves_the_reference(instance, "tcp")

    # The first version of a delta link goes in full; a raw link kept no copy to apply it to.
    version += 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version)
    reply = await begin_update(instance, payloads, TCP, link=common_pb2.COMPRESSION_DELTA)
    assert [r.held_version for r in reply.ranks] == [-1] * TP
    await send_all(TcpSender(), instance, reply, payloads, raw_frames)
    await commit_version(instance, version, weights, payloads)

    version += 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version)
    reply = await begin_update(instance, payloads, rollout_pb2.TRANSFER_BACKEND_GRPC, link=common_pb2.COMPRESSION_DELTA)
    assert [r.held_version for r in reply.ranks] == [version - 1] * TP
    held = instance.held
    await send_all(
        GrpcStreamSender(), instance, reply, payloads, lambda m, p: delta_frames(m, p, *held[m.tensor_parallel_rank])
    )
    await commit_version(instance, version, weights, payloads)
    await assert_serves_the_reference(instance, "delta")


async def test_a_push_over_mooncake_writes_each_rank_buffer(instance):
    version = instance.version + 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version)
    reply = await begin_update(instance, payloads, rollout_pb2.TRANSFER_BACKEND_MOONCAKE)
    sessions = {r.transfer_session for r in reply.ranks}
    assert len(sessions) == TP and all(r.buffer_bytes >= m.total_bytes for r, (m, _) in zip(reply.ranks, payloads))
    assert reply.transfer_session == reply.ranks[0].transfer_session
    proofs = await send_all(MooncakeSender(MooncakeEndpoint()), instance, reply, payloads, raw_frames)
    await commit_version(instance, version, weights, payloads, proofs)
    await assert_serves_the_reference(instance, "mooncake")


async def test_a_corrupted_bucket_on_one_rank_leaves_the_old_version_served(instance):
    prompts = instance.prompts()
    before = await greedy_outputs(instance.engine, prompts, "before")
    version = instance.version + 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version)
    corrupted = payloads[1][1].clone()
    corrupted[70_000] ^= 0xFF
    reply = await begin_update(instance, payloads, TCP)
    await send_all(TcpSender(), instance, reply, [payloads[0], (payloads[1][0], corrupted)], raw_frames)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await instance.stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=version), timeout=30)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank 1 buckets [1]" in caught.value.details() and "crc32" in caught.value.details()
    info = await instance.stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=5)
    assert info.weight_version == instance.version
    assert await greedy_outputs(instance.engine, prompts, "after") == before
    # The same version, sent again intact, is accepted.
    reply = await begin_update(instance, payloads, TCP)
    await send_all(TcpSender(), instance, reply, payloads, raw_frames)
    await commit_version(instance, version, weights, payloads)
    await assert_serves_the_reference(instance, "retried")


async def test_payloads_that_do_not_fit_the_ranks_are_refused(instance):
    version = instance.version + 1
    payloads = rank_payloads(instance.served, instance.model_dir, version)
    full_manifest, _ = pack(instance.served, version)
    cases = [
        (rollout_pb2.BeginWeightUpdateRequest(rank_manifests=[payloads[0][0]], backend=TCP), "1 rank manifests for 2"),
        (
            rollout_pb2.BeginWeightUpdateRequest(rank_manifests=[payloads[1][0], payloads[0][0]], backend=TCP),
            "payload of rank 1 of 2",
        ),
        (
            rollout_pb2.BeginWeightUpdateRequest(rank_manifests=[full_manifest, full_manifest], backend=TCP),
            "tensors do not match",
        ),
        (
            rollout_pb2.BeginWeightUpdateRequest(
                manifest=full_manifest, rank_manifests=[m for m, _ in payloads], backend=TCP
            ),
            "exactly one",
        ),
    ]
    for request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await instance.stub.BeginWeightUpdate(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


async def test_full_tensors_from_an_older_sender_reach_every_rank(instance):
    """The full layout still works: rank 0 receives the whole version and hands each rank its cut."""
    version = instance.version + 1
    weights = perturbed_weights(instance.served, version)
    manifest, payload = pack(weights, version)
    reply = await instance.stub.BeginWeightUpdate(
        rollout_pb2.BeginWeightUpdateRequest(manifest=manifest, backend=rollout_pb2.TRANSFER_BACKEND_GRPC), timeout=10
    )
    assert [r.tp_rank for r in reply.ranks] == [0]
    await GrpcStreamSender().send_rank(
        instance.stub, reply.ranks[0], manifest, payload, raw_frames(manifest, payload), 30, lambda: False
    )
    await commit_version(instance, version, weights, [])
    await assert_serves_the_reference(instance, "full")


@torch.inference_mode()
def switched_greedy(model_dir, weights_by_version, prompt, versions):
    """Greedy decoding in one process where step i runs the weights of versions[i] on the KV cache
    the earlier steps left: what a switch between two decode steps on every rank produces."""
    models = {}
    for version, weights in weights_by_version.items():
        models[version] = load_causal_lm(model_dir)
        copy_into(models[version], weights)
    cache, ids, tokens, logprobs = DynamicCache(), torch.tensor([prompt]), [], []
    for version in versions:
        out = models[version](input_ids=ids, past_key_values=cache, use_cache=True)
        distribution = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(distribution.argmax())
        tokens.append(token)
        logprobs.append(float(distribution[token]))
        cache, ids = out.past_key_values, torch.tensor([[token]])
    return tokens, logprobs


async def test_generation_goes_on_while_a_version_loads_and_every_rank_switches_at_once(instance):
    engine, old, old_weights = instance.engine, instance.version, instance.served
    version = old + 1
    weights = perturbed_weights(instance.served, version)
    payloads = rank_payloads(weights, instance.model_dir, version, bucket_bytes=32 << 10)
    stop = asyncio.Event()
    background: list[list[int]] = []

    async def keep_busy(index: int) -> None:
        prompt = instance.prompts()[index]
        while not stop.is_set():
            _, _, versions, _ = await engine_output(
                engine,
                EngineRequest(f"busy-{index}-{len(background)}", prompt, Sampling(temperature=1.0, max_tokens=40)),
            )
            background.append(versions)

    busy = [asyncio.create_task(keep_busy(i)) for i in range(3)]
    await wait_for(lambda: engine.generated_tokens > 0)
    reply = await begin_update(instance, payloads, TCP)
    before = engine.generated_tokens
    # About 25 buckets per rank, 10 ms apart: the version arrives over a quarter of a second.
    await send_all(TcpSender(), instance, reply, payloads, lambda m, p: slow_frames(m, p, pause=0.01))
    assert engine.generated_tokens - before >= 20, "decoding stalled while the version was arriving"
    rank0 = instance.rollout.servicer.updater.local
    # Rank 0's standby copy filled as buckets landed, before any commit.
    await wait_for(lambda: rank0.loading()[0] == rank0.loading()[1] > 0, timeout=5)
    assert engine.weight_version == old

    # A batch-mate that starts before the probe and outlasts it must decode across the switch;
    # the looping requests above can all sit between two requests at the switching step.
    spanning_started = asyncio.Event()

    async def spanning() -> list[int]:
        seen = []
        request = EngineRequest("spanning", instance.prompts()[3], Sampling(temperature=1.0, max_tokens=62))
        async for chunk in engine.generate(request):
            seen += chunk.weight_versions
            spanning_started.set()
        return seen

    spanning_versions = asyncio.create_task(spanning())
    await asyncio.wait_for(spanning_started.wait(), timeout=10)
    prompt = instance.prompts()[1]
    tokens, logprobs, versions = [], [], []
    committing = None
    request = EngineRequest("probe", prompt, Sampling(temperature=0, max_tokens=60 - len(prompt)))
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        if committing is None and len(tokens) >= 2:
            committing = asyncio.create_task(commit_version(instance, version, weights, payloads))
    await committing
    stop.set()
    await asyncio.gather(*busy)

    switch = versions.index(version)
    assert 2 <= switch < len(versions) and versions == [old] * switch + [version] * (len(versions) - switch)
    for seen in background + [await spanning_versions]:
        assert seen == sorted(seen) and set(seen) <= {old, version}
    assert set(await spanning_versions) == {old, version}, (
        "the batch-mate spanning the probe did not decode across the switch"
    )
    want_tokens, want_logprobs = switched_greedy(
        instance.model_dir, {old: old_weights, version: weights}, prompt, versions
    )
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


async def test_a_dead_rank_takes_the_instance_out_of_the_pool(model_dir):
    """A worker killed mid-generation: its requests end aborted with their tokens (the manager
    continues them elsewhere), the engine refuses new ones and the instance leaves the pool."""
    manager = await start_manager(ManagerConfig(server=loopback()))
    rollout = await start_rollout(
        RolloutConfig(
            server=loopback(),
            instance_id="doomed",
            manager_address=manager.server.address,
            engine=EngineConfig(model_dir=str(model_dir), max_batch_size=8, tensor_parallel_size=TP),
            transfer=TransferConfig(mooncake=False),
            register_timeout_seconds=10,
        )
    )
    try:
        engine = rollout.engine
        prompt = load_tokenizer(model_dir).encode("31415=").ids
        running = asyncio.create_task(
            engine_output(engine, EngineRequest("victim", prompt, Sampling(temperature=1.0, max_tokens=55)))
        )
        await wait_for(lambda: engine.generated_tokens >= 3)
        os.kill(engine._group.workers[0].process.pid, signal.SIGKILL)
        tokens, _, _, _ = await asyncio.wait_for(running, 30)
        assert 3 <= len(tokens) < 55
        await wait_for(lambda: "doomed" not in manager.state.instances, timeout=30)
        assert rollout.stop_requested.is_set()
        with pytest.raises(FailedPrecondition, match="engine failed: tensor-parallel"):
            await engine_output(engine, EngineRequest("after", prompt, Sampling(max_tokens=2)))
    finally:
        await rollout.stop()
        await manager.stop()
