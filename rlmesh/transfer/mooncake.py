"""The Mooncake transfer engine backend: the rollout registers its standby buffer while a push is
open and the weights service writes into it directly (TCP here, RDMA on clusters; P2P handshake,
no etcd), then proves the bytes it wrote in the commit (rlmesh.transfer.auth)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.auth import sender_session
from rlmesh.transfer.base import Frame, ReceiveBuffer, Superseded, TransferError, WeightSender, finish_in_thread
from rlmesh.transfer.payload import bucket_ranges

# Mooncake logs every connection at INFO; keep service logs readable (it reads this at import).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
# A write to a peer that vanished fails after this many seconds instead of blocking its thread.
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")


class MooncakeEndpoint:
    """One transfer engine per process, with the memory regions it has registered."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise TransferError(f"Mooncake transfer engine failed to initialize on {host} ({protocol})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def register(self, tensor: torch.Tensor) -> None:
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self._registered.get(address) == nbytes:
            return
        if address in self._registered:
            self.engine.unregister_memory(address)
        if self.engine.register_memory(address, nbytes) != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {address:#x}")
        self._registered[address] = nbytes

    def unregister(self, tensor: torch.Tensor) -> None:
        if self._registered.pop(tensor.data_ptr(), None) is not None:
            self.engine.unregister_memory(tensor.data_ptr())

    def write(self, session: str, local: int, remote: int, ranges: list[tuple[int, int]]) -> None:
        sources = [local + start for start, _ in ranges]
        targets = [remote + start for start, _ in ranges]
        lengths = [end - start for start, end in ranges]
        status = self.engine.batch_transfer_sync_write(session, sources, targets, lengths)
        if status != 0:
            raise TransferError(f"Mooncake write to {session} failed with status {status}")


class MooncakeReceiveBuffer(ReceiveBuffer):
    """A standby buffer registered with this process's transfer engine only while a Mooncake push
    is open (from BeginWeightUpdate until its commit starts checking): the engine refuses writes to
    memory it has not registered, so the served copy and a version being checked are out of any
    remote writer's reach. Registering costs microseconds with the TCP protocol (measured here)."""

    def __init__(self, endpoint: MooncakeEndpoint, pinned: bool = False) -> None:
        super().__init__(pinned)
        self.endpoint = endpoint

    def ensure(self, nbytes: int) -> bool:
        old = self.tensor
        grown = super().ensure(nbytes)
        if grown:
            self.endpoint.unregister(old)
        return grown

    def open_writes(self) -> None:
        self.endpoint.register(self.tensor)

    def close_writes(self) -> None:
        self.endpoint.unregister(self.tensor)


class MooncakeSender(WeightSender):
    backend = rollout_pb2.TRANSFER_BACKEND_MOONCAKE
    carries_compression = False
    proves_commit = True

    BUCKETS_PER_WRITE = 8
    """Buckets per batched write: large enough to keep the engine's lanes busy, small enough that
    a superseded push stops soon."""

    def __init__(self, endpoint: MooncakeEndpoint) -> None:
        self.endpoint = endpoint

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
        if not endpoint.transfer_session or not endpoint.buffer_address:
            raise TransferError(f"rank {endpoint.tp_rank} offered no Mooncake session or buffer")
        if endpoint.buffer_bytes < manifest.total_bytes:
            raise TransferError(
                f"rank {endpoint.tp_rank}'s buffer holds {endpoint.buffer_bytes} of {manifest.total_bytes} bytes"
            )
        session = sender_session(endpoint, manifest.version)
        self.endpoint.register(payload)
        ranges = bucket_ranges(manifest.total_bytes, manifest.bucket_bytes)
        data = memoryview(payload.numpy())
        tags: list[bytes] = []
        for start in range(0, len(ranges), self.BUCKETS_PER_WRITE):
            if cancelled():
                raise Superseded(f"push of version {manifest.version} was superseded")
            batch = ranges[start : start + self.BUCKETS_PER_WRITE]
            # Bounded by MC_TRANSFER_TIMEOUT inside the engine: an asyncio timeout could not stop
            # the thread, and the payload must stay untouched until it ends. The batch's tags are
            # computed while it is written.
            _, batch_tags = await asyncio.gather(
                finish_in_thread(
                    self.endpoint.write, endpoint.transfer_session, payload.data_ptr(), endpoint.buffer_address, batch
                ),
                finish_in_thread(session.bucket_tags, data, batch, start),
            )
            tags += batch_tags
        return session.commit_proof(tags)
