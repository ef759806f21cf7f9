"""What the weights service holds, asked before a version is published: the manager never tells
instances to expect a version nobody can push to them."""

from __future__ import annotations

import grpc

from rlmesh.errors import FailedPrecondition, Unavailable
from rlmesh.rpc import call_options, open_channel
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc


class StoredVersions:
    def __init__(self, weights_address: str, timeout_seconds: float) -> None:
        self.weights_address = weights_address
        self.timeout_seconds = timeout_seconds
        self._channel: grpc.aio.Channel | None = None

    async def latest(self) -> int:
        """The newest version the weights service holds (-1: none); Unavailable when it cannot be asked."""
        if self._channel is None:
            self._channel = open_channel(self.weights_address)
        try:
            status = await weights_pb2_grpc.WeightsServiceStub(self._channel).GetStatus(
                weights_pb2.GetStatusRequest(), **call_options(self.timeout_seconds))
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"cannot ask the weights service at {self.weights_address} which versions it holds: "
                              f"{exc.code().name}: {exc.details()}") from exc
        return status.latest_version

    async def check_held(self, version: int) -> None:
        """Raises FailedPrecondition when the weights service does not hold `version` yet."""
        latest = await self.latest()
        if version > latest:
            held = f"its newest is {latest}" if latest >= 0 else "it holds none yet"
            raise FailedPrecondition(f"version {version} is not held by the weights service at {self.weights_address} ({held}): "
                                     "a version is published only after its weights are uploaded")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
