"""The sender interface every transfer backend implements, and the receive buffer they fill."""

from __future__ import annotations

import abc
import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import Any

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.payload import bucket_ranges


async def finish_in_thread(fn: Callable[..., Any], *args: Any, executor: Executor | None = None) -> Any:
    """Runs blocking buffer work in a thread (of `executor`, default the loop's). If the caller is
    cancelled, it still waits for the thread: the thread keeps reading or writing the buffer, which
    must not be reused before then."""
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(
        asyncio.to_thread(fn, *args) if executor is None else loop.run_in_executor(executor, fn, *args)
    )
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


def background_thread() -> None:
    """Puts the calling thread in SCHED_IDLE: it runs only when no other thread of its process
    group (on Linux, its session's autogroup) wants the CPU, and yields the moment one wakes. A
    tensor-parallel decode step waits on its peers dozens of times; a transfer thread that is
    merely niced still delays those wake-ups, one that is idle-class does not."""
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


class TransferError(RuntimeError):
    """A payload could not be delivered; the receiver keeps serving its old version."""


class Superseded(TransferError):
    """A push stopped because a newer version arrived; the receiver keeps its old version."""


Frame = tuple[int, int, int, int, "bytes | memoryview"]
"""One bucket on the wire: (offset, raw length, compression code, base version, encoded bytes)."""


def raw_frames(manifest: common_pb2.WeightManifest, payload: torch.Tensor) -> Iterator[Frame]:
    """A payload's buckets as they are: views, no copy."""
    data = memoryview(payload.numpy())
    for start, end in bucket_ranges(manifest.total_bytes, manifest.bucket_bytes):
        yield start, end - start, common_pb2.COMPRESSION_NONE, -1, data[start:end]


class WeightSender(abc.ABC):
    """Moves one tensor-parallel rank's payload into the buffer that rank opened in
    BeginWeightUpdate. Every backend gets the same inputs: the raw payload (for backends that
    write memory directly) and its buckets as frames, encoded for the link (for streams)."""

    backend: rollout_pb2.TransferBackend.ValueType
    carries_compression: bool = True
    """False when the backend writes raw bytes into registered memory (Mooncake)."""
    proves_commit: bool = False
    """True when nothing authenticates the writes themselves (Mooncake): the commit must then carry
    each rank's proof of the bytes, which `send_rank` returns."""

    @abc.abstractmethod
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
        """Returns the rank's commit proof when the backend `proves_commit` (else empty). Raises
        TransferError if the rank did not get every byte; stops early (TransferError) once
        `cancelled()` is true, leaving the rank on its old version."""

    def close(self) -> None:  # noqa: B027 - optional: backends that hold nothing (gRPC, Mooncake) keep this no-op
        """Releases transport resources."""


class ReceiveBuffer:
    """A standby byte buffer allocated once, touched once so later transfers do not pay page
    faults (a cold buffer measured 8x slower here), and grown only when a version is larger.
    `pinned`: page-locked, so copies from it to a GPU run asynchronously at full bus speed."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned
        self.tensor = torch.zeros(0, dtype=torch.uint8)

    def ensure(self, nbytes: int) -> bool:
        """Makes room for `nbytes`; True when the buffer was reallocated."""
        if self.tensor.numel() >= nbytes:
            return False
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return True

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def open_writes(self) -> None:
        """Lets a transfer engine write into the buffer (no-op: only a receiving thread writes here)."""

    def close_writes(self) -> None:
        """Takes the buffer out of a transfer engine's reach again."""
