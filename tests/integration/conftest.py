"""Fixtures of real gRPC servers on loopback port 0, started in-process from each service's own start()."""

from __future__ import annotations

import pytest

from rlmesh.rpc import open_channel
from tests.support import build_mesh, stop_mesh


@pytest.fixture
async def grpc_mesh(model_dir):
    mesh = await build_mesh(model_dir, "grpc")
    yield mesh
    await stop_mesh(mesh)


@pytest.fixture
async def channel_to():
    channels = []

    def open_(address: str):
        channel = open_channel(address)
        channels.append(channel)
        return channel

    yield open_
    for channel in channels:
        await channel.close()
