"""The weights service's pushes under faults, over real TCP links to a real rollout instance: the
uploading trainer never waits on a push, a newer version supersedes a push still sending an older
one, a push the instance refuses is retried until it takes the version, and a lossy link to an
engine serving full-precision weights is refused with the reason."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import pytest
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.base import Frame
from rlmesh.transfer.tcp import TcpSender
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from tests.support.clients import upload_full_tensors
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.tensors import scaled_weights
from tests.support.waiting import wait_for

GATE_SECONDS = 30


class GatedSender(TcpSender):
    """The real TCP sender, whose pushes the test can hold before their first frame leaves and
    whose bytes it can corrupt on the way, push by push (numbered from 0 in the order they start)."""

    def __init__(self, held: Iterable[int] = (), corrupted: Iterable[int] = ()) -> None:
        super().__init__()
        self.versions: list[int] = []
        """The version of each push, in the order they started."""
        self._gates = {push: threading.Event() for push in held}
        self._corrupted = set(corrupted)

    def release(self, push: int) -> None:
        self._gates[push].set()

    async def send_rank(
        self,
        stub: rollout_pb2_grpc.RolloutServiceStub,
        endpoint: rollout_pb2.RankEndpoint,
        manifest: common_pb2.WeightManifest,
        payload: torch.Tensor,
        frames: Iterable[Frame],
        timeout: float,
        cancelled: Callable[[], bool],
    ) -> bytes:
        push = len(self.versions)
        self.versions.append(manifest.version)
        gate = self._gates.get(push)
        corrupt = push in self._corrupted

        def passed_through() -> Iterable[Frame]:
            # Runs on the sending thread: holding it here holds the push, not the service.
            if gate is not None and not gate.wait(GATE_SECONDS):
                raise TimeoutError(f"push {push} was never released")
            for index, (offset, raw_bytes, compression, base_version, data) in enumerate(frames):
                if corrupt and index == 0:
                    data = bytearray(data)
                    data[-1] ^= 0xFF
                yield offset, raw_bytes, compression, base_version, data

        return await super().send_rank(stub, endpoint, manifest, payload, passed_through(), timeout, cancelled)


@pytest.fixture
async def tcp_mesh(model_dir):
    mesh = await build_mesh(model_dir, "tcp")
    yield mesh
    await stop_mesh(mesh)


def gate_pushes(mesh, sender: GatedSender) -> None:
    mesh.weights.pusher.sender.close()
    mesh.weights.pusher.sender = sender


async def push_status(mesh, channel_to) -> weights_pb2.InstancePush:
    """The one instance's push state (empty until the service has listed the instance)."""
    status = await weights_pb2_grpc.WeightsServiceStub(channel_to(mesh.weights_address)).GetStatus(
        weights_pb2.GetStatusRequest(), timeout=5
    )
    assert len(status.instances) <= 1, status
    return status.instances[0] if status.instances else weights_pb2.InstancePush()


async def test_uploads_return_while_pushes_hang_and_a_newer_version_supersedes_the_older(
    tcp_mesh, model_dir, channel_to
):
    rollout = tcp_mesh.rollouts[0]
    sender = GatedSender(held=[0])
    gate_pushes(tcp_mesh, sender)
    weights = weights_pb2_grpc.WeightsServiceStub(channel_to(tcp_mesh.weights_address))
    await upload_full_tensors(weights, 1, scaled_weights(model_dir, 0.5))
    await wait_for(lambda: sender.versions == [1])
    # The trainer's upload of version 2 returns while the push of version 1 is still held.
    await upload_full_tensors(weights, 2, scaled_weights(model_dir, 2.0))
    assert rollout.engine.weight_version == 0
    assert (await push_status(tcp_mesh, channel_to)).pushing_version == 1
    sender.release(0)
    await wait_for(lambda: rollout.engine.weight_version == 2)
    status = await push_status(tcp_mesh, channel_to)
    assert sender.versions == [1, 2], "version 1 was pushed again after version 2 was stored"
    assert (status.committed_version, status.superseded, status.failures, status.last_error) == (2, 1, 0, "")


async def test_a_push_the_instance_refuses_is_retried_until_it_takes_the_version(tcp_mesh, model_dir, channel_to):
    rollout = tcp_mesh.rollouts[0]
    sender = GatedSender(held=[1], corrupted=[0])
    gate_pushes(tcp_mesh, sender)
    weights = weights_pb2_grpc.WeightsServiceStub(channel_to(tcp_mesh.weights_address))
    await upload_full_tensors(weights, 1, scaled_weights(model_dir, 0.5))

    async def first_push_failed() -> bool:
        return (await push_status(tcp_mesh, channel_to)).failures == 1

    await wait_for(first_push_failed)
    status = await push_status(tcp_mesh, channel_to)
    assert "crc32" in status.last_error and status.committed_version == 0
    assert rollout.engine.weight_version == 0, "the instance took a corrupted version"
    # After the backoff the same version goes again, whole this time.
    await wait_for(lambda: sender.versions == [1, 1])
    sender.release(1)
    await wait_for(lambda: rollout.engine.weight_version == 1)
    status = await push_status(tcp_mesh, channel_to)
    assert (status.committed_version, status.failures, status.last_error) == (1, 0, "")


async def test_a_lossy_link_to_an_engine_serving_full_precision_is_refused_with_the_reason(model_dir, channel_to):
    mesh = await build_mesh(model_dir, "tcp", weights_settings={"compression": "int8"})
    try:
        weights = weights_pb2_grpc.WeightsServiceStub(channel_to(mesh.weights_address))
        await upload_full_tensors(weights, 1, scaled_weights(model_dir, 0.5))

        async def refused() -> weights_pb2.InstancePush | None:
            status = await push_status(mesh, channel_to)
            return status if status.failures else None

        status = await wait_for(refused)
        assert "int8 is lossy" in status.last_error and "quantized" in status.last_error
        assert status.committed_version == 0 and mesh.rollouts[0].engine.weight_version == 0
    finally:
        await stop_mesh(mesh)
