"""Instance identity on the wire: a takeover of a live instance's id is refused and the instance
keeps its work; a process killed with SIGKILL and restarted under its id at the same address
joins as a new incarnation while the batch finishes with every sample once; a process the
manager did not register refuses the work meant for the one it did."""

import asyncio
import signal
from collections import Counter
from dataclasses import replace

import grpc
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.processes import wait_started
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.trainer.mesh import MeshClient
from tests.support.clients import assert_exactly_once, gather_batch
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.processes import spawn_rollout
from tests.support.samples import NO_STOP, prompt_batch
from tests.support.waiting import wait_for

PROMPTS = 32

BUSY = 2 * PROMPTS
"""Prompts of the batch during which the process is killed: more than both instances' slots hold."""


async def expect_refusal(call, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    for fragment in fragments:
        assert fragment in caught.value.details()
    return caught.value.details()


async def test_a_takeover_of_a_live_id_is_refused_and_the_instance_keeps_its_work(model_dir, channel_to):
    mesh = await build_mesh(model_dir, "grpc", instances=1)
    stub = manager_pb2_grpc.ManagerServiceStub(channel_to(mesh.manager_address))
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    real = mesh.manager.state.instances["instance-0"]
    try:
        elsewhere = manager_pb2.RegisterInstanceRequest(
            instance_id="instance-0", address="127.0.0.1:9", max_batch_size=4
        )
        details = await expect_refusal(
            stub.RegisterInstance(elsewhere, timeout=5),
            grpc.StatusCode.ALREADY_EXISTS,
            f"instance 'instance-0' is registered at {real.address} and its lease is live",
        )
        print(details)
        same_address = manager_pb2.RegisterInstanceRequest(
            instance_id="instance-0", address=real.address, max_batch_size=4
        )
        await expect_refusal(
            stub.RegisterInstance(same_address, timeout=5), grpc.StatusCode.ALREADY_EXISTS, "incarnation token"
        )
        guessed = "0" * 32
        await expect_refusal(
            stub.Heartbeat(manager_pb2.HeartbeatRequest(instance_id="instance-0", draining=True), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED,
            "'instance-0'",
            "no incarnation token",
        )
        await expect_refusal(
            stub.Heartbeat(
                manager_pb2.HeartbeatRequest(instance_id="instance-0", incarnation_token=guessed), timeout=5
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "'instance-0'",
            "another incarnation",
        )
        await expect_refusal(
            stub.DeregisterInstance(manager_pb2.DeregisterInstanceRequest(instance_id="instance-0"), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED,
            "'instance-0'",
        )
        # Nothing of the real instance changed, and it goes on getting all the work.
        assert mesh.manager.state.instances["instance-0"] is real and not real.draining
        await client.submit("b", 0, prompt_batch(model_dir, 4), 2, NO_STOP)
        samples = assert_exactly_once(await gather_batch(client, "b", micro=4), 4, 2)
        assert all(s.instance_ids == ["instance-0"] for s in samples)
        status = await client.manager_status()
        assert [(i.instance_id, i.incarnation) for i in status.instances] == [("instance-0", real.incarnation)]
    finally:
        await client.close()
        await stop_mesh(mesh)


async def test_a_restarted_process_registers_as_a_new_incarnation_and_every_sample_arrives_once(model_dir, tmp_path):
    mesh = await build_mesh(model_dir, "grpc", instances=1, lease_seconds=2.0)
    phoenix = spawn_rollout(tmp_path, mesh.manager_address, "phoenix", ENGINE__MODEL_DIR=str(model_dir))
    port = phoenix.address.rsplit(":", 1)[1]
    reborn = None
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    state = mesh.manager.state
    try:
        await wait_started([phoenix])
        await wait_for(lambda: "phoenix" in state.instances, timeout=30)
        first = state.instances["phoenix"].incarnation
        await client.submit("b1", 0, prompt_batch(model_dir, BUSY), 4, NO_STOP)
        collecting = asyncio.create_task(gather_batch(client, "b1", micro=8))
        # Killed while it generates: requests of its own are running and have tokens.
        await wait_for(
            lambda: (
                "phoenix" in state.instances
                and state.instances["phoenix"].running
                and state.instances["phoenix"].generated_tokens > 0
            ),
            interval=0.01,
        )
        phoenix.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(phoenix.process.wait, 30)
        # The same id at the same address, as an orchestrator restarts a crashed process.
        reborn = replace(
            spawn_rollout(
                tmp_path, mesh.manager_address, "phoenix", ENGINE__MODEL_DIR=str(model_dir), SERVER__PORT=port
            ),
            address=phoenix.address,
        )
        samples = assert_exactly_once(await collecting, BUSY, 4)
        assert all(len(s.token_ids) == 55 == len(s.logprobs) for s in samples)
        continued = [s for s in samples if s.instance_ids[:1] == ["phoenix"] and len(s.instance_ids) > 1]
        assert continued, (
            f"no sample was running on the killed process: {Counter(tuple(s.instance_ids) for s in samples)}"
        )
        await wait_started([reborn])
        await wait_for(
            lambda: "phoenix" in state.instances and state.instances["phoenix"].incarnation > first, timeout=30
        )
        second = state.instances["phoenix"].incarnation
        # The new incarnation gets work of its own, and the next batch also arrives exactly once.
        await client.submit("b2", 0, prompt_batch(model_dir, PROMPTS), 4, NO_STOP)
        samples = assert_exactly_once(await gather_batch(client, "b2", micro=8), PROMPTS, 4)
        assert any("phoenix" in s.instance_ids for s in samples)
        assert state.instances["phoenix"].incarnation == second
        status = await client.manager_status()
        assert status.discarded_tokens == 0
        print(
            f"phoenix: incarnation {first} killed, restarted as incarnation {second}; "
            f"{len(continued)} samples continued from its tokens, {status.continued_tokens} tokens reused"
        )
    finally:
        await client.close()
        for child in (phoenix, reborn):
            if child and child.process.poll() is None:
                child.process.kill()
                await asyncio.to_thread(child.process.wait, 30)
        await stop_mesh(mesh)


async def test_a_process_the_manager_did_not_register_refuses_its_work(model_dir, channel_to):
    """The manager believes another incarnation serves the address (as when a process restarted
    there before the old lease ran out): the process refuses the streams, the manager drops that
    incarnation, the process registers again as a new one and the batch completes once."""
    mesh = await build_mesh(model_dir, "grpc", instances=1)
    rollout = mesh.rollouts[0]
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(rollout.server.address))
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    state = mesh.manager.state
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=3)
    try:
        stale = rollout_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=params, incarnation_token="0" * 32
        )
        await expect_refusal(
            stub.Generate(stale, timeout=5).read(),
            grpc.StatusCode.PERMISSION_DENIED,
            "instance 'instance-0'",
            "another incarnation",
        )
        own = rollout_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=params, incarnation_token=rollout.membership.token
        )
        chunks = [response.chunk async for response in stub.Generate(own, timeout=10)]
        assert sum(len(chunk.token_ids) for chunk in chunks) == 3
        believed = state.instances["instance-0"]
        believed.token = "0" * 32
        await client.submit("b", 0, prompt_batch(model_dir, 4), 2, NO_STOP)
        samples = assert_exactly_once(await gather_batch(client, "b", micro=4), 4, 2)
        assert all(len(s.token_ids) == 55 and s.instance_ids[-1] == "instance-0" for s in samples)
        current = state.instances["instance-0"]
        assert current is not believed and current.incarnation > believed.incarnation
        assert rollout.membership.token == current.token
    finally:
        await client.close()
        await stop_mesh(mesh)
