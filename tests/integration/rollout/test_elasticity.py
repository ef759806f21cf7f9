"""Instances that leave, hang and straggle, as real processes: a SIGTERM drain and a preemption
notice hand every generated token back, a hung instance loses its lease, stragglers move from a
slow instance to a fast one, and a pool left empty fails the trainer's stream with a clear error
while keeping the batch."""

import asyncio
import os
import signal

import grpc
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.forking.forkserver import ForkServer
from rlmesh.launch.processes import wait_started
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.families import check_model_dir
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from services.rollout.synthetic_engine import SyntheticConfig, response_length
from services.trainer.mesh import MeshClient
from tests.support.clients import assert_exactly_once, gather_batch
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.processes import spawn_rollout, suite_warm_fork_server
from tests.support.samples import NO_STOP, prompt_batch
from tests.support.waiting import wait_for

PROMPTS = 32


@pytest.fixture(scope="module")
def forks(model_dir, tmp_path_factory):
    """The rollout processes' fork server, as `rlmesh up` has one: six instances start here, and
    each would otherwise import torch and transformers anew."""
    server = ForkServer(
        ["services.rollout.__main__", "transformers.initialization", check_model_dir(model_dir).modeling_module],
        {**os.environ, "OMP_NUM_THREADS": "1"},
        tmp_path_factory.mktemp("forks") / "forkserver.log",
        suite_warm_fork_server(),
    )
    server.wait_ready()
    yield server
    server.close()


@pytest.fixture(params=[0, 2], ids=["manager relays", "relay shards"])
def relay_shards(request) -> int:
    """The manager relaying every token itself, or two relay shards holding the tokens."""
    return request.param


async def leave_mid_generation(
    model_dir, tmp_path, forks, leave, relay_shards: int = 0
) -> tuple[list, manager_pb2.GetStatusResponse, int]:
    """Runs a batch on an in-process instance plus a real process that `leave` makes go away
    while it generates; returns the samples, the manager's status and the process's exit code."""
    mesh = await build_mesh(model_dir, "grpc", instances=1, relay_shards=relay_shards)
    leaving = spawn_rollout(tmp_path, mesh.manager_address, "leaving", forks, ENGINE__MODEL_DIR=str(model_dir))
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        await wait_started([leaving])
        await wait_for(lambda: "leaving" in mesh.manager.state.instances, timeout=30)
        await hold_mid_generation(
            leaving, mesh.manager.state, lambda: client.submit("b", 0, prompt_batch(model_dir, PROMPTS), 4, NO_STOP)
        )
        collecting = asyncio.create_task(gather_batch(client, "b", micro=8))
        await leave(leaving)
        samples = assert_exactly_once(await collecting, PROMPTS, 4)
        code = await asyncio.to_thread(leaving.process.wait, 30)
        return samples, await client.manager_status(), code
    finally:
        if leaving.process.poll() is None:
            leaving.process.kill()
        await client.close()
        await stop_mesh(mesh)


async def hold_mid_generation(child, state, submit) -> None:
    """Runs `submit` while the instance's engine is paused, then lets it run a step or so at a time
    until its requests have tokens, and leaves it paused. The tiny model finishes a response in well
    under a second, sooner than a signal and a drain may take on a busy machine; a paused engine
    keeps the requests running, and a drain resumes it to hand them back."""
    async with open_channel(child.address) as channel:
        rollout = rollout_pb2_grpc.RolloutServiceStub(channel)

        async def info() -> rollout_pb2.GetInfoResponse:
            return await rollout.GetInfo(rollout_pb2.GetInfoRequest(), timeout=10)

        await rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=10)
        await submit()
        instance = state.instances[child.name]

        async def all_arrived() -> bool:
            return bool(instance.running) and (await info()).running_requests == len(instance.running)

        await wait_for(all_arrived, timeout=30)
        while True:
            await rollout.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=10)
            await rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=10)
            now = await info()
            assert now.running_requests, "the instance finished its requests before it could be paused"
            if now.generated_tokens:
                return


def assert_handed_back_without_loss(samples, status) -> None:
    assert all(len(s.token_ids) == 55 == len(s.logprobs) == len(s.weight_versions) for s in samples)
    continued = [s for s in samples if s.instance_ids == ["leaving", "instance-0"]]
    assert continued, "no request was running on the instance that left"
    # Every token the leaving instance generated reached the manager and was kept.
    assert status.discarded_tokens == 0
    assert status.continued_tokens >= len(continued)


async def test_sigterm_drains_and_every_generated_token_is_kept(model_dir, tmp_path, forks, relay_shards):
    async def terminate(child):
        child.process.send_signal(signal.SIGTERM)

    samples, status, code = await leave_mid_generation(model_dir, tmp_path, forks, terminate, relay_shards)
    assert code == 0
    assert_handed_back_without_loss(samples, status)


async def test_a_preemption_notice_drains_the_instance_and_stops_it(model_dir, tmp_path, forks):
    handed_back = []

    async def notice(child):
        async with open_channel(child.address) as channel:
            reply = await rollout_pb2_grpc.RolloutServiceStub(channel).Drain(
                rollout_pb2.DrainRequest(reason="spot preemption notice"), timeout=30
            )
            handed_back.append(reply.handed_back_requests)

    samples, status, code = await leave_mid_generation(model_dir, tmp_path, forks, notice)
    assert code == 0, "the instance should exit by itself after a drain"
    assert handed_back[0] >= 1
    assert_handed_back_without_loss(samples, status)


async def test_a_hung_instance_loses_its_lease_and_its_requests_continue(model_dir, tmp_path, forks, relay_shards):
    """SIGSTOP: the process keeps its connections open but sends nothing, heartbeats included."""
    mesh = await build_mesh(model_dir, "grpc", instances=1, lease_seconds=2.0, relay_shards=relay_shards)
    hung = spawn_rollout(tmp_path, mesh.manager_address, "hung", forks, ENGINE__MODEL_DIR=str(model_dir))
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        await wait_started([hung])
        await wait_for(lambda: "hung" in mesh.manager.state.instances, timeout=30)
        await hold_mid_generation(
            hung, mesh.manager.state, lambda: client.submit("b", 0, prompt_batch(model_dir, PROMPTS), 4, NO_STOP)
        )
        collecting = asyncio.create_task(gather_batch(client, "b", micro=8))
        hung.process.send_signal(signal.SIGSTOP)
        samples = assert_exactly_once(await collecting, PROMPTS, 4)
        assert all(len(s.token_ids) == 55 for s in samples)
        assert any(s.instance_ids == ["hung", "instance-0"] for s in samples)
        assert "hung" not in mesh.manager.state.instances
    finally:
        hung.process.kill()
        await asyncio.to_thread(hung.process.wait, 30)
        await client.close()
        await stop_mesh(mesh)


async def test_stragglers_move_from_a_slow_instance_to_a_fast_one(model_dir, tmp_path, forks):
    synthetic = SyntheticConfig(
        length="fixed", mean_tokens=60, throughput_tokens_per_second=2000, min_step_seconds=0.01, stream_interval=4
    )
    common = {
        "ENGINE__KIND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__SYNTHETIC__LENGTH": "fixed",
        "ENGINE__SYNTHETIC__MEAN_TOKENS": "60",
        "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": "0.01",
        "ENGINE__SYNTHETIC__STREAM_INTERVAL": "4",
    }
    mesh = await build_mesh(model_dir, "grpc", instances=0)
    fast = spawn_rollout(tmp_path, mesh.manager_address, "fast", forks, **common)
    slow = spawn_rollout(tmp_path, mesh.manager_address, "slow", forks, ENGINE__SYNTHETIC__SPEED="0.1", **common)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        await wait_started([fast, slow])
        await wait_for(lambda: {"fast", "slow"} <= mesh.manager.state.instances.keys(), timeout=30)
        seeded = common_pb2.SamplingParams(temperature=1.0, max_tokens=100, seed=11)
        await client.submit("b", 0, [(f"p{i}", [1, 2, 3]) for i in range(6)], 2, seeded)
        samples = assert_exactly_once(await gather_batch(client, "b", micro=6), 6, 2)
        status = await client.manager_status()
        assert status.migrated_samples >= 1
        moved = [s for s in samples if s.instance_ids == ["slow", "fast"]]
        assert moved, "no sample continued on the fast instance"
        # Continuation counted every token once: each response has exactly the configured length.
        assert all(len(s.token_ids) == response_length(synthetic, 0, 100) for s in samples)
        assert status.discarded_tokens == 0
    finally:
        await client.close()
        for child in (fast, slow):
            child.process.send_signal(signal.SIGTERM)
        for child in (fast, slow):
            await asyncio.to_thread(child.process.wait, 30)
        await stop_mesh(mesh)


async def test_an_empty_pool_fails_the_stream_clearly_and_keeps_the_batch(model_dir, tmp_path, forks):
    mesh = await build_mesh(model_dir, "grpc", instances=0, no_instance_timeout_seconds=1.0)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    joining = None
    try:
        await client.submit("b", 0, prompt_batch(model_dir, 3), 2, NO_STOP)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gather_batch(client, "b", micro=3)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no rollout instance" in caught.value.details() and "6 unfinished samples" in caught.value.details()
        joining = spawn_rollout(tmp_path, mesh.manager_address, "joining", forks, ENGINE__MODEL_DIR=str(model_dir))
        await wait_started([joining])
        assert_exactly_once(await gather_batch(client, "b", micro=3), 3, 2)
    finally:
        await client.close()
        if joining:
            joining.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(joining.process.wait, 30)
        await stop_mesh(mesh)


async def test_micro_batches_on_the_wire_take_what_is_ready(model_dir, channel_to):
    # Two samples at a time: groups complete one after another.
    mesh = await build_mesh(model_dir, "grpc", instances=1, max_batch_size=2)
    engine = mesh.rollouts[0].engine
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    stub = manager_pb2_grpc.ManagerServiceStub(channel_to(mesh.manager_address))
    try:
        await client.submit(
            "b", 0, prompt_batch(model_dir, 6), 2, common_pb2.SamplingParams(temperature=1.0, max_tokens=40)
        )
        await wait_for(lambda: mesh.manager.state.batches["b"].ready, timeout=20, interval=0.005)
        await engine.pause()
        ready = await stub.TakeReadyGroups(manager_pb2.TakeReadyGroupsRequest(batch_id="b"), timeout=5)
        assert 1 <= len(ready.groups) < 6 and ready.remaining_groups == 6 - len(ready.groups)
        after = await stub.TakeReadyGroups(
            manager_pb2.TakeReadyGroupsRequest(batch_id="b", resume_from=len(ready.groups)), timeout=5
        )
        assert list(after.groups) == [] and after.remaining_groups == ready.remaining_groups
        assert after.first_group_index == len(ready.groups)
        # Groups sent but (say) never read come again from the position the reader asks for.
        again = await stub.TakeReadyGroups(manager_pb2.TakeReadyGroupsRequest(batch_id="b"), timeout=5)
        assert list(again.groups) == list(ready.groups) and again.first_group_index == 0
        await engine.resume()
        prompt_tokens = len(prompt_batch(model_dir, 1)[0][1])
        budget = 2 * 2 * (prompt_tokens + 40)  # two groups of two samples
        streamed = []
        async for micro_batch in client.rollouts("b", 4, 1, budget, timeout=30):
            assert 1 <= len(micro_batch) <= 2
            streamed += micro_batch
        # The stream starts at the beginning: the groups taken above come first, once.
        assert streamed[: len(ready.groups)] == list(ready.groups)
        assert sorted(g.prompt_id for g in streamed) == [f"p{i}" for i in range(6)]
        assert "b" not in mesh.manager.state.batches, "the read batch was not acknowledged"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.StreamRollouts(
                manager_pb2.StreamRolloutsRequest(batch_id="b", micro_batch_groups=2, min_groups=3), timeout=5
            ).read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_groups" in caught.value.details()
    finally:
        await client.close()
        await stop_mesh(mesh)
