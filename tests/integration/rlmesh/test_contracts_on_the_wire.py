"""Every service answers reflection and health (grpcurl sees its RPCs), and refuses bad input
with a status code and a message that says what was wrong."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.servers import GrpcServer
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.trainer.loop import TrainingStatus
from services.trainer.server import TrainerServicer
from tests.support.clients import grpcurl_output
from tests.support.credentials import loopback


@pytest.fixture
async def trainer_server():
    server = GrpcServer(loopback(), [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
        TrainerServicer(TrainingStatus(total_steps=5, output_dir="x")), server.server
    )
    await server.start()
    await server.set_serving(True)
    yield server
    await server.stop()


async def test_grpcurl_lists_rpcs_reflection_and_health_on_every_service(grpc_mesh, trainer_server):
    services = {
        grpc_mesh.manager_address: "rlmesh.manager.v1.ManagerService",
        grpc_mesh.weights_address: "rlmesh.weights.v1.WeightsService",
        grpc_mesh.rollouts[0].server.address: "rlmesh.rollout.v1.RolloutService",
        trainer_server.address: "rlmesh.trainer.v1.TrainerService",
    }
    for address, service in services.items():
        listed = (await grpcurl_output(address, "list")).split()
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(listed)
        methods = await grpcurl_output(address, "list", service)
        assert f"{service}." in methods
        health = await grpcurl_output("-d", "{}", address, "grpc.health.v1.Health/Check")
        assert "SERVING" in health
    status = await grpcurl_output(grpc_mesh.manager_address, "rlmesh.manager.v1.ManagerService/GetStatus")
    assert "instance-0" in status


async def test_health_turns_not_serving_while_draining(trainer_server, channel_to):
    stub = health_pb2_grpc.HealthStub(channel_to(trainer_server.address))
    assert (
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    ).status == health_pb2.HealthCheckResponse.SERVING
    await trainer_server.set_serving(False)
    assert (
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    ).status == health_pb2.HealthCheckResponse.NOT_SERVING


async def expect_status(call, code: grpc.StatusCode, fragment: str):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code
    assert fragment in caught.value.details()


async def test_manager_refuses_bad_requests(grpc_mesh, channel_to):
    stub = manager_pb2_grpc.ManagerServiceStub(channel_to(grpc_mesh.manager_address))
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=1)
    await expect_status(
        stub.SubmitPrompts(
            manager_pb2.SubmitPromptsRequest(
                batch_id="b", prompts=[manager_pb2.Prompt(prompt_id="p", token_ids=[1], n=1)]
            ),
            timeout=5,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling is required",
    )
    await expect_status(
        stub.SubmitPrompts(
            manager_pb2.SubmitPromptsRequest(
                batch_id="b", sampling=sampling, prompts=[manager_pb2.Prompt(prompt_id="p", token_ids=[1], n=0)]
            ),
            timeout=5,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "n must be",
    )
    await expect_status(
        stub.Heartbeat(manager_pb2.HeartbeatRequest(instance_id="ghost"), timeout=5), grpc.StatusCode.NOT_FOUND, "ghost"
    )
    await expect_status(
        stub.RegisterInstance(
            manager_pb2.RegisterInstanceRequest(instance_id="x", address="nowhere", max_batch_size=1), timeout=5
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "host:port",
    )
    knee_past_batch = manager_pb2.RegisterInstanceRequest(
        instance_id="x", address="127.0.0.1:9", max_batch_size=4, saturation_batch_size=5
    )
    await expect_status(
        stub.RegisterInstance(knee_past_batch, timeout=5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "saturation_batch_size (5) must not exceed max_batch_size (4)",
    )
    stream = stub.StreamRollouts(manager_pb2.StreamRolloutsRequest(batch_id="missing", micro_batch_groups=1), timeout=5)
    await expect_status(stream.read(), grpc.StatusCode.NOT_FOUND, "missing")
    # A version the weights service does not hold is never published: instances would wait for it.
    await expect_status(
        stub.PublishVersion(manager_pb2.PublishVersionRequest(version=999999), timeout=5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "version 999999 is not held by the weights service",
    )
    await expect_status(
        stub.PublishVersion(manager_pb2.PublishVersionRequest(version=-1), timeout=5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "older",
    )


async def test_rollout_refuses_bad_requests(grpc_mesh, channel_to):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_mesh.rollouts[0].server.address))
    stream = stub.Generate(
        rollout_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[], sampling=common_pb2.SamplingParams(max_tokens=2)
        ),
        timeout=5,
    )
    await expect_status(stream.read(), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
    manifest = common_pb2.WeightManifest(
        version=5,
        total_bytes=4,
        bucket_bytes=4,
        bucket_crc32=[0],
        tensors=[common_pb2.TensorSpec(name="bogus", dtype=common_pb2.D_TYPE_FLOAT32, shape=[1], offset=0, nbytes=4)],
    )
    await expect_status(
        stub.BeginWeightUpdate(
            rollout_pb2.BeginWeightUpdateRequest(manifest=manifest, backend=rollout_pb2.TRANSFER_BACKEND_GRPC),
            timeout=5,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "bogus",
    )
    await expect_status(
        stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=9), timeout=5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "not begun",
    )
    await expect_status(
        stub.Abort(rollout_pb2.AbortRequest(), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "request_ids"
    )


async def test_weights_refuses_bad_uploads(grpc_mesh, channel_to):
    stub = weights_pb2_grpc.WeightsServiceStub(channel_to(grpc_mesh.weights_address))

    async def chunks_only():
        yield weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=0, data=b"x"))

    await expect_status(stub.UploadWeights(chunks_only(), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "manifest")

    async def short_upload():
        yield weights_pb2.UploadWeightsRequest(
            manifest=common_pb2.WeightManifest(
                version=1,
                total_bytes=8,
                bucket_bytes=8,
                bucket_crc32=[0],
                tensors=[
                    common_pb2.TensorSpec(name="w", dtype=common_pb2.D_TYPE_FLOAT32, shape=[2], offset=0, nbytes=8)
                ],
            )
        )
        yield weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=0, data=b"1234"))

    await expect_status(
        stub.UploadWeights(short_upload(), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "after 4 of 8 bytes"
    )
    status = await stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)
    assert status.latest_version == -1
