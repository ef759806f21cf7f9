"""A delta-compressed link end to end: trainer ranks hand their FSDP shards to a real weights
service, which encodes each version against the previous one before storing it, and a real
rollout instance receives every version in place into its standby copy and serves it exactly;
after each switch the standby copy catches up, so the next version goes as a delta again."""

from __future__ import annotations

import uuid

import pytest
import torch
from transformers import AutoConfig

from rlmesh.common.v1 import common_pb2
from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.tp_layout import ModelShape, fsdp_rows
from rlmesh.transfer.shards import LocalShard, SharedMemorySlot, layout_to_proto, shard_specs, write_payload
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.waiting import wait_for

WORLD = 2
CHANGED_FRACTION = 0.02


async def hand_off(stub, shape: ModelShape, tensors: dict[str, torch.Tensor], version: int) -> None:
    """Every FSDP rank's rows of `tensors`, through shared memory, as the trainer ranks send them."""
    for rank in range(WORLD):
        shards = {}
        for name, full in tensors.items():
            start, end = fsdp_rows(full.shape[0], WORLD, rank)
            shards[name] = LocalShard(full[start:end], tuple(full.shape), start, end)
        specs, total = shard_specs(shards)
        slot = SharedMemorySlot(f"rlmesh-test-{uuid.uuid4().hex[:8]}", total)
        try:
            header = weights_pb2.ShardsHeader(
                version=version,
                rank=rank,
                world_size=WORLD,
                layout=layout_to_proto(shape),
                shards=specs,
                total_bytes=total,
                shm_path=str(slot.path),
            )
            header.payload_crc32 = write_payload(shards, specs, slot.tensor)
            await stub.UploadShards([weights_pb2.UploadShardsRequest(header=header)], timeout=10)
        finally:
            slot.close()


def changed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, values in tensors.items():
        mask = torch.rand(values.shape, generator=generator) < CHANGED_FRACTION
        out[name] = torch.where(mask, values + 0.01, values)
    return out


def served_parameters_equal(engine, tensors: dict[str, torch.Tensor]) -> bool:
    """The served copy holds exactly `tensors` (one rank: the HF names; the vocabulary padded)."""
    for name, param in engine._group.runner.active.named_parameters():
        want = tensors[name]
        if not torch.equal(param[: want.shape[0]], want):
            return False
    return True


@pytest.fixture
async def delta_mesh(model_dir):
    mesh = await build_mesh(model_dir, "tcp", weights_settings={"compression": "delta", "delta_full_every": 8})
    yield mesh
    await stop_mesh(mesh)


async def test_versions_from_trainer_shards_go_as_sparse_deltas_encoded_before_they_are_stored(
    delta_mesh, model_dir, channel_to
):
    stub = weights_pb2_grpc.WeightsServiceStub(channel_to(delta_mesh.weights_address))
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    engine = delta_mesh.rollouts[0].engine
    store = delta_mesh.weights.store
    tensors = trainable_tensors(load_causal_lm(model_dir))

    versions = {}
    for version in (1, 2, 3):
        tensors = versions[version] = changed(tensors, seed=version)
        await hand_off(stub, shape, tensors, version)
        await wait_for(lambda version=version: store.latest is not None and store.latest.version == version)
        if version > 1:
            # The link's encoding is complete as soon as the version is stored: its push only sends.
            encoded = store.latest.encodings[(1, 0, "delta", version - 1)]
            assert len(encoded._blobs) == len(encoded._ranges)
        await wait_for(lambda version=version: engine.weight_version == version, timeout=20)
        assert served_parameters_equal(engine, tensors)
        status = await stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=5)
        (link,) = status.instances
        assert link.compression == common_pb2.COMPRESSION_DELTA and not link.last_error
        assert link.last_version_latency_ms > 0
        if version > 1:
            # 2 % of the fp32 values changed: indices and values of those, about 8x fewer bytes.
            assert link.compression_ratio > 5, (version, link.compression_ratio)
