"""Prompts in, groups out through real servers: every sample once, weight versions pushed
through Mooncake and through the gRPC stream, late joiners caught up, drains survived, and
exact-version batches generated wholly by their version while a newer one is pushed."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.payload import pack
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.rollout.main import start as start_rollout
from services.trainer.mesh import MeshClient
from tests.support.clients import gather_batch, upload_full_tensors
from tests.support.credentials import suite_auth_env
from tests.support.meshes import build_mesh, rollout_config, stop_mesh
from tests.support.samples import prompt_batch, sampling
from tests.support.tensors import scaled_weights
from tests.support.waiting import wait_for


async def test_every_prompt_comes_back_once_with_all_its_samples(grpc_mesh, model_dir):
    client = MeshClient(grpc_mesh.manager_address, grpc_mesh.weights_address, rpc_timeout=10)
    try:
        await client.submit("batch-a", 0, prompt_batch(model_dir, 6), 4, sampling(model_dir))
        groups = await gather_batch(client, "batch-a", micro=4)
    finally:
        await client.close()
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(6)]
    for group in groups:
        assert len(group.samples) == 4
        for sample in group.samples:
            assert 1 <= len(sample.token_ids) <= 8
            assert len(sample.token_ids) == len(sample.logprobs) == len(sample.weight_versions)
            assert all(lp <= 0 for lp in sample.logprobs)
            assert sample.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
            assert sample.instance_ids == ["instance-0"]


@pytest.mark.parametrize("backend", ["mooncake", "grpc"])
async def test_a_published_version_reaches_instances_and_late_joiners(model_dir, backend):
    mesh = await build_mesh(model_dir, backend, max_staleness=0)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    late = None
    try:
        await upload_full_tensors(client.weights, 1, scaled_weights(model_dir, 1.0))
        await client.announce(1)
        rollout = mesh.rollouts[0]
        await wait_for(lambda: rollout.engine.weight_version == 1)
        # Samples for policy version 1 only run once the instance serves version 1.
        await client.submit("after-publish", 1, prompt_batch(model_dir, 2), 2, sampling(model_dir))
        groups = await gather_batch(client, "after-publish", micro=2)
        assert {v for g in groups for s in g.samples for v in s.weight_versions} == {1}
        weights = weights_pb2_grpc.WeightsServiceStub(client._weights_channel)
        status = await weights.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)
        assert status.latest_version == 1 and status.backend == backend
        assert [(i.instance_id, i.committed_version) for i in status.instances] == [("instance-0", 1)]
        late = await start_rollout(rollout_config(model_dir, mesh.manager_address, "late", backend == "mooncake"))
        assert late.engine.weight_version == 0
        await wait_for(lambda: late.engine.weight_version == 1)

        async def manager_sees_both_at_version_1() -> bool:
            status = await client.manager_status()
            return {i.instance_id: i.weight_version for i in status.instances} == {"instance-0": 1, "late": 1}

        # The instance reports the switch with an immediate heartbeat; the manager learns it from there.
        await wait_for(manager_sees_both_at_version_1, timeout=5)
        # The same id restarted as a new process starts from the disk version and is caught up again.
        await late.stop()
        late = await start_rollout(rollout_config(model_dir, mesh.manager_address, "late", backend == "mooncake"))
        await wait_for(lambda: late.engine.weight_version == 1)
    finally:
        if late:
            await late.stop()
        await client.close()
        await stop_mesh(mesh)


async def test_a_corrupted_push_leaves_the_instance_on_its_version(grpc_mesh, model_dir, channel_to):
    rollout = grpc_mesh.rollouts[0]
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(rollout.server.address))
    manifest, payload = pack(scaled_weights(model_dir, 0.5), version=7)
    await stub.BeginWeightUpdate(
        rollout_pb2.BeginWeightUpdateRequest(manifest=manifest, backend=rollout_pb2.TRANSFER_BACKEND_GRPC), timeout=5
    )
    payload[10] ^= 0xFF

    async def chunks():
        yield rollout_pb2.PushWeightChunksRequest(version=7, offset=0, data=payload.numpy().tobytes())

    await stub.PushWeightChunks(chunks(), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=7), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "crc32" in caught.value.details()
    info = await stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=5)
    assert info.weight_version == 0 and info.update_mode == "continue"


async def test_a_draining_instance_hands_its_requests_to_another(model_dir):
    mesh = await build_mesh(model_dir, "grpc", instances=2)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        no_stop = common_pb2.SamplingParams(temperature=1.0, max_tokens=55)
        await client.submit("drain", 0, prompt_batch(model_dir, 8), 4, no_stop)
        collecting = asyncio.create_task(gather_batch(client, "drain", micro=8))
        await wait_for(lambda: mesh.rollouts[0].engine.generated_tokens > 0)
        await mesh.rollouts.pop(0).stop()
        groups = await collecting
        assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(8)]
        assert all(len(g.samples) == 4 for g in groups)
        samples = [s for g in groups for s in g.samples]
        assert all(len(s.token_ids) == 55 for s in samples)
        assert {tuple(s.instance_ids) for s in samples} <= {
            ("instance-0",),
            ("instance-1",),
            ("instance-0", "instance-1"),
        }
        continued = [s for s in samples if len(s.instance_ids) == 2]
        assert continued, "no request was running on the drained instance"
        status = await client.manager_status()
        assert status.requeued_samples >= len(continued)
    finally:
        await client.close()
        await stop_mesh(mesh)


async def test_a_killed_instance_is_dropped_and_its_requests_continue(model_dir, tmp_path):
    """kill -9 of a real rollout process mid-generation: its samples continue on the survivor
    from the tokens already generated, long before its 30 s lease would have expired."""
    mesh = await build_mesh(model_dir, "grpc", instances=1, lease_seconds=30)
    port = free_port()
    env = {
        **os.environ,
        "RLMESH_ROLLOUT_SERVER__PORT": str(port),
        "RLMESH_ROLLOUT_INSTANCE_ID": "doomed",
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": mesh.manager_address,
        "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(model_dir),
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        **suite_auth_env("RLMESH_ROLLOUT_", "instance"),
    }
    doomed = subprocess.Popen(
        [sys.executable, "-m", "services.rollout"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        await wait_for(lambda: "doomed" in mesh.manager.state.instances, timeout=60)
        no_stop = common_pb2.SamplingParams(temperature=1.0, max_tokens=55)
        await client.submit("kill", 0, prompt_batch(model_dir, 8), 4, no_stop)
        collecting = asyncio.create_task(gather_batch(client, "kill", micro=8))
        await wait_for(
            lambda: (
                mesh.manager.state.instances.get("doomed")
                and mesh.manager.state.instances["doomed"].generated_tokens > 0
            )
        )
        started = time.monotonic()
        doomed.send_signal(signal.SIGKILL)
        groups = await collecting
        assert time.monotonic() - started < 30
        samples = [s for g in groups for s in g.samples]
        assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(8)]
        assert all(len(s.token_ids) == 55 for s in samples)
        assert any(s.instance_ids == ["doomed", "instance-0"] for s in samples)
        assert "doomed" not in mesh.manager.state.instances
    finally:
        doomed.kill()
        doomed.wait()
        await client.close()
        await stop_mesh(mesh)


async def test_a_prompt_no_instance_accepts_fails_the_batch_with_the_reason(grpc_mesh, model_dir):
    client = MeshClient(grpc_mesh.manager_address, grpc_mesh.weights_address, rpc_timeout=10)
    try:
        await client.submit("bad-tokens", 0, [("p0", [1, 2]), ("p1", [999])], 2, sampling(model_dir))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gather_batch(client, "bad-tokens", micro=2)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'p1'" in caught.value.details() and "vocabulary" in caught.value.details()
        status = await client.manager_status()
        assert status.queued_samples == 0 and status.running_samples == 0
    finally:
        await client.close()


def slow_decoding(engine, seconds: float) -> None:
    """Each decode step of the in-process torch engine takes at least `seconds`, so requests span a push."""
    run = engine._group.run

    def slowed(op, *args):
        if op == "decode":
            time.sleep(seconds)
        return run(op, *args)

    engine._group.run = slowed


async def test_an_exact_version_batch_is_generated_by_its_version_while_a_newer_one_is_pushed(model_dir):
    mesh = await build_mesh(model_dir, "grpc", max_staleness=0)
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    engine = mesh.rollouts[0].engine
    slow_decoding(engine, 0.03)
    no_stop = common_pb2.SamplingParams(temperature=1.0, max_tokens=50)
    try:
        await client.submit("eval-v0", 0, prompt_batch(model_dir, 2), 2, no_stop, exact_version=True)
        evaluating = asyncio.create_task(gather_batch(client, "eval-v0", micro=2))
        await wait_for(lambda: engine.generated_tokens > 0)
        await upload_full_tensors(client.weights, 1, scaled_weights(model_dir, 0.5))
        await client.announce(1)
        # Training goes on: the next step's samples need version 1 (max_staleness 0).
        await client.submit("train-v1", 1, prompt_batch(model_dir, 2), 2, no_stop)
        # Version 1 arrived and waits, staged, for the evaluation samples to end.
        await wait_for(lambda: engine._swap is not None)
        assert engine.weight_version == 0 and not evaluating.done()
        groups = await evaluating
        samples = [s for g in groups for s in g.samples]
        assert len(samples) == 4 and all(len(s.token_ids) == 50 and s.instance_ids == ["instance-0"] for s in samples)
        assert {v for s in samples for v in s.weight_versions} == {0}
        trained = await gather_batch(client, "train-v1", micro=2)
        assert {v for g in trained for s in g.samples for v in s.weight_versions} == {1}
        # Version 0 is served nowhere any more: evaluating it again is skipped, with a status the trainer tells apart.
        await client.submit("eval-v0-again", 0, prompt_batch(model_dir, 1), 1, no_stop, exact_version=True)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gather_batch(client, "eval-v0-again", micro=1)
        assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "version 0 is no longer served by any instance" in caught.value.details()
        status = await client.manager_status()
        assert status.queued_samples == 0 and status.running_samples == 0
    finally:
        await client.close()
        await stop_mesh(mesh)
