"""A publish that does not wait: the command ends once the shards are packed, the next step's
forwards, backwards and optimizer step run while the upload is in flight, the version uploaded is
the policy as it was packed, an unreachable weights service gets the same bytes again, and a
refused upload fails the delivery for whoever waits for it; a version the weights service lost
before its announcement is handed over again."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlmesh.models.random_init import scaled_config, write_random_model
from rlmesh.transfer.shards import shard_views
from rlmesh.weights.v1 import weights_pb2
from services.trainer.config import TrainerConfig
from services.trainer.publishing import VersionPublisher
from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.commands import CollectiveFailure, OptimizerStep, Publish, RankGroup, Train, retry_delays
from services.trainer.ranks.distributed import TorchThread
from services.trainer.ranks.handoff import ShardHandoff, mesh_tag
from services.trainer.ranks.policy import ShardedPolicy


class HeldStub:
    """Stands in for the weights service's stub: each upload waits until released, and may be
    answered UNAVAILABLE first (a restarting service) or refused."""

    def __init__(self, unavailable: int = 0, refuse: bool = False) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.unavailable = unavailable
        self.refuse = refuse
        self.payloads: list[tuple[weights_pb2.ShardsHeader, bytes]] = []

    async def UploadShards(self, requests, timeout=None, metadata=None):
        import grpc

        assert timeout is not None, "every RPC carries a deadline"
        parts = [r async for r in requests]
        self.started.set()
        await self.release.wait()
        header = parts[0].header
        if self.unavailable:
            self.unavailable -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "restarting"
            )
        if self.refuse:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "bad layout"
            )
        self.payloads.append((header, b"".join(p.chunk.data for p in parts[1:])))
        return weights_pb2.UploadShardsResponse(version=header.version, ranks_received=1, complete=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def samples(count: int) -> list[TrainingSample]:
    generator = torch.Generator().manual_seed(0)
    return [
        TrainingSample(
            torch.randint(3, 60, (6,), generator=generator).tolist(),
            torch.randint(3, 60, (5,), generator=generator).tolist(),
            [-4.0] * 5,
            1.0 if i % 2 else -1.0,
        )
        for i in range(count)
    ]


@pytest.fixture
async def group(tmp_path, rank):
    model_dir = write_random_model(tmp_path / "model", scaled_config("qwen2"))
    config = TrainerConfig(model_dir=str(model_dir), output_dir=str(tmp_path / "out"))
    thread = TorchThread()
    policy = await thread.run(ShardedPolicy, config, rank)
    stub = HeldStub()
    handoff = ShardHandoff(stub, policy.shape, 0, 1, "stream", mesh_tag(str(tmp_path)), 5.0, policy.weights_dtype)
    group = RankGroup(rank, policy, handoff, thread, tmp_path / "checkpoints", publish_timeout=2.0)
    yield group, stub
    if group.delivery is not None and not group.delivery.done():
        stub.release.set()
        await asyncio.gather(group.delivery, return_exceptions=True)
    handoff.close()
    thread.close()


async def test_the_next_step_trains_while_the_version_uploads_and_the_upload_is_the_packed_policy(group):
    group, stub = group
    before = {name: local(p) for name, p in group.policy.model.named_parameters()}
    delivery = await group.lead(Publish(7, wait=False))
    await asyncio.wait_for(stub.started.wait(), 10)
    # The upload is held: a training step runs to its end meanwhile.
    await group.lead(Train(samples(4)))
    await group.lead(OptimizerStep())
    assert not delivery.done()
    assert any(not torch.equal(before[n], local(p)) for n, p in group.policy.model.named_parameters())
    stub.release.set()
    result = await asyncio.wait_for(delivery, 10)
    [(header, payload)] = stub.payloads
    assert result.version == header.version == 7 and result.rank_bytes == [header.total_bytes]
    # Version 7 carries the policy as it was when packed, not as the optimizer step left it.
    uploaded = shard_views(header, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert uploaded.keys() == before.keys()
    for name, tensor in uploaded.items():
        assert torch.equal(tensor, before[name].to(tensor.dtype)), name


async def test_an_unreachable_weights_service_gets_the_same_bytes_again(group):
    group, stub = group
    stub.unavailable = 2
    stub.release.set()
    result = await asyncio.wait_for(group.lead(Publish(3)), 20)
    assert result.version == 3 and [h.version for h, _ in stub.payloads] == [3]


async def test_a_refused_upload_fails_the_delivery_and_the_group_goes_on(group):
    group, stub = group
    stub.refuse = True
    stub.release.set()
    delivery = await group.lead(Publish(4, wait=False))
    with pytest.raises(CollectiveFailure, match="publishing version 4: .*INVALID_ARGUMENT"):
        await asyncio.wait_for(delivery, 10)
    assert await group.delivered() is None
    stub.refuse = False
    assert (await group.lead(Publish(5))).version == 5


class LosingWeightsManager:
    """Stands in for the manager as the trainer's MeshClient sees it, beside a weights service that
    restarted after the upload: the first announcement is refused as not held, and the weights
    service then holds nothing until the version is handed over again."""

    def __init__(self, stub: HeldStub) -> None:
        self.stub = stub
        self.announced: list[int] = []

    async def announce(self, version: int) -> None:
        import grpc

        if not self.announced and len(self.stub.payloads) < 2:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"version {version} is not held by the weights service",
            )
        self.announced.append(version)

    async def stored_version(self) -> int:
        return self.stub.payloads[-1][0].version if len(self.stub.payloads) >= 2 else -1


async def test_a_version_the_weights_service_lost_before_its_announcement_is_handed_over_again(group):
    group, stub = group
    stub.release.set()
    manager = LosingWeightsManager(stub)
    publisher = VersionPublisher(group, manager, lambda step, figures: None)
    result = await asyncio.wait_for(publisher.publish(6), 20)
    assert result.version == 6 and manager.announced == [6] and publisher.published_version == 6
    assert [h.version for h, _ in stub.payloads] == [6, 6]


def test_retries_fit_within_the_publish_timeout_and_back_off():
    assert retry_delays(0.1) == []
    assert retry_delays(2.0) == [0.5, 1.0]
    delays = retry_delays(300.0)
    assert sum(delays) <= 300.0 and delays[:5] == [0.5, 1.0, 2.0, 4.0, 8.0] and set(delays[4:]) == {8.0}
