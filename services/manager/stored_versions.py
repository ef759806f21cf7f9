"""What the weights service holds, asked before a version is published: the manager never tells
instances to expect a version nobody can push to them."""

from __future__ import annotations

import asyncio
import time

import grpc

from rlmesh.errors import FailedPrecondition, Unavailable
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc

POLL_SECONDS = 0.05


class StoredVersions:
    def __init__(self, weights_address: str, timeout_seconds: float, store_wait_seconds: float) -> None:
        self.weights_address = weights_address
        self.timeout_seconds = timeout_seconds
        self.store_wait_seconds = store_wait_seconds
        self._channel: grpc.aio.Channel | None = None

    async def status(self) -> weights_pb2.GetStatusResponse:
        """The weights service's status; Unavailable when it cannot be asked."""
        if self._channel is None:
            self._channel = open_channel(self.weights_address)
        try:
            return await weights_pb2_grpc.WeightsServiceStub(self._channel).GetStatus(
                weights_pb2.GetStatusRequest(), **call_options(self.timeout_seconds)
            )
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(
                f"cannot ask the weights service at {self.weights_address} which versions it holds: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc

    async def check_held(self, version: int) -> None:
        """Returns once the weights service holds `version`, waiting up to store_wait_seconds
        while it is still storing it (every rank arrived; past the wait: Unavailable, so the
        caller calls again); raises FailedPrecondition when it is neither held nor being stored."""
        deadline = time.monotonic() + self.store_wait_seconds
        while True:
            status = await self.status()
            if version <= status.latest_version:
                return
            if version > status.storing_version:
                held = f"its newest is {status.latest_version}" if status.latest_version >= 0 else "it holds none yet"
                raise FailedPrecondition(
                    f"version {version} is not held by the weights service at {self.weights_address} "
                    f"({held}): a version is published only after its weights are uploaded"
                )
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"version {version} is still being stored by the weights service after "
                    f"{self.store_wait_seconds:g} s: call again"
                )
            await asyncio.sleep(POLL_SECONDS)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
