"""UploadShards on a real weights service: trainer ranks hand over their FSDP shards through
shared memory or a stream, and bad uploads are refused with the reason."""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch

from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes
from rlmesh.transfer.payload import stream_chunks
from rlmesh.transfer.shards import LocalShard, SharedMemorySlot, layout_to_proto, shard_specs, write_payload
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.waiting import wait_for

SHAPE = ModelShape(
    hidden_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=32,
    vocab_size=14,
    num_layers=2,
    tie_word_embeddings=True,
    attention_bias=True,
)


@pytest.fixture
async def weights(model_dir, channel_to):
    mesh = await build_mesh(model_dir, "tcp", instances=0)
    yield weights_pb2_grpc.WeightsServiceStub(channel_to(mesh.weights_address))
    await stop_mesh(mesh)


def rank_shards(version: int, rank: int, world: int):
    generator = torch.Generator().manual_seed(version)
    shards = {}
    for name, dims in hf_parameter_shapes(SHAPE).items():
        full = torch.randn(dims, generator=generator)
        start, end = fsdp_rows(dims[0], world, rank)
        shards[name] = LocalShard(full[start:end], dims, start, end)
    specs, total = shard_specs(shards)
    return shards, weights_pb2.ShardsHeader(
        version=version, rank=rank, world_size=world, layout=layout_to_proto(SHAPE), shards=specs, total_bytes=total
    )


async def latest_status(stub, version: int) -> weights_pb2.GetStatusResponse | None:
    status = await stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)
    return status if status.latest_version == version else None


async def upload_through_shm(stub, version: int, rank: int, world: int) -> weights_pb2.UploadShardsResponse:
    shards, header = rank_shards(version, rank, world)
    slot = SharedMemorySlot(f"rlmesh-test-{uuid.uuid4().hex[:8]}", header.total_bytes)
    try:
        header.payload_crc32 = write_payload(shards, list(header.shards), slot.tensor)
        header.shm_path = str(slot.path)

        async def parts():
            yield weights_pb2.UploadShardsRequest(header=header)

        return await stub.UploadShards(parts(), timeout=10)
    finally:
        slot.close()


async def test_ranks_hand_over_their_shards_through_shared_memory(weights):
    first = await upload_through_shm(weights, 3, 0, 2)
    assert (first.ranks_received, first.complete) == (1, False)
    assert (await weights.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)).latest_version == -1
    second = await upload_through_shm(weights, 3, 1, 2)
    assert (second.ranks_received, second.complete) == (2, True)
    status = await wait_for(lambda: latest_status(weights, 3))
    model_bytes = sum(torch.Size(d).numel() * 4 for d in hf_parameter_shapes(SHAPE).values())
    assert status.latest_version == 3
    assert model_bytes <= status.latest_bytes < model_bytes + 64 * 2 * len(hf_parameter_shapes(SHAPE))


async def test_a_rank_on_another_host_streams_its_shards(weights):
    shards, header = rank_shards(4, 0, 1)
    payload = torch.zeros(header.total_bytes, dtype=torch.uint8)
    header.payload_crc32 = write_payload(shards, list(header.shards), payload)

    async def parts():
        yield weights_pb2.UploadShardsRequest(header=header)
        for offset, data in stream_chunks(payload, header.total_bytes):
            yield weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

    reply = await weights.UploadShards(parts(), timeout=10)
    assert reply.complete


async def expect_refusal(stub, messages, code: grpc.StatusCode, text: str) -> None:
    async def parts():
        for message in messages:
            yield message

    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.UploadShards(parts(), timeout=10)
    assert failure.value.code() == code
    assert text in failure.value.details()


async def test_bad_uploads_are_refused_with_the_reason(weights, tmp_path):
    _, header = rank_shards(5, 0, 2)
    chunk = weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(offset=0, data=b"x"))
    await expect_refusal(weights, [chunk], grpc.StatusCode.INVALID_ARGUMENT, "must carry the header")
    outside = weights_pb2.ShardsHeader()
    outside.CopyFrom(header)
    outside.shm_path = str(tmp_path / "payload")
    await expect_refusal(
        weights,
        [weights_pb2.UploadShardsRequest(header=outside)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a file directly under /dev/shm",
    )
    missing = weights_pb2.ShardsHeader()
    missing.CopyFrom(header)
    missing.shm_path = "/dev/shm/rlmesh-no-such-file"
    await expect_refusal(
        weights, [weights_pb2.UploadShardsRequest(header=missing)], grpc.StatusCode.INVALID_ARGUMENT, "does not exist"
    )
    shifted = weights_pb2.ShardsHeader()
    shifted.CopyFrom(header)
    shifted.shards[1].row_end -= 1
    await expect_refusal(
        weights,
        [weights_pb2.UploadShardsRequest(header=shifted)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "FSDP rank 0 of 2 holds",
    )
    short = [weights_pb2.UploadShardsRequest(header=header), chunk]
    await expect_refusal(weights, short, grpc.StatusCode.INVALID_ARGUMENT, "ended after 1 of")
    no_layout = weights_pb2.ShardsHeader()
    no_layout.CopyFrom(header)
    no_layout.layout.family = "gpt2"
    await expect_refusal(
        weights,
        [weights_pb2.UploadShardsRequest(header=no_layout)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "no layout rules",
    )
    await upload_through_shm(weights, 6, 0, 1)
    await wait_for(lambda: latest_status(weights, 6))
    await expect_refusal(
        weights, [weights_pb2.UploadShardsRequest(header=header)], grpc.StatusCode.FAILED_PRECONDITION, "not newer"
    )


async def test_an_upload_sent_again_after_a_lost_reply_succeeds_and_stores_nothing_twice(weights):
    """A sender that never heard the reply sends the same shards again: the same answer, once
    the version is stored too; other bytes under the same version are still refused."""
    first = await upload_through_shm(weights, 7, 0, 2)
    again = await upload_through_shm(weights, 7, 0, 2)
    assert (first.ranks_received, first.complete) == (again.ranks_received, again.complete) == (1, False)
    await upload_through_shm(weights, 7, 1, 2)
    await wait_for(lambda: latest_status(weights, 7))
    late = await upload_through_shm(weights, 7, 1, 2)
    assert (late.version, late.ranks_received, late.complete) == (7, 2, True)
    assert (await weights.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)).latest_version == 7
    _, header = rank_shards(7, 1, 2)
    header.payload_crc32 = 12345
    await expect_refusal(
        weights, [weights_pb2.UploadShardsRequest(header=header)], grpc.StatusCode.FAILED_PRECONDITION, "not newer"
    )
