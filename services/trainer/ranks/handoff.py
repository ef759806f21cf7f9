"""One rank's hand-off of its FSDP shards of a weight version to the weights service, without
ever assembling a full tensor: the rank's local rows of every parameter are packed into a
payload and sent with `UploadShards` (one header; the bytes through a shared-memory file on the
same host, or as chunks after the header across hosts).

Shared memory: two /dev/shm slots per rank, allocated at the first publish, used alternately
and reused for every version. Their names carry the mesh (output folder), the pid and the rank,
so two meshes or runs on one host never share a file; slots of dead processes of the same mesh
are removed at start.

On CUDA, packing only enqueues the shards' copy (cast on the device) into a pinned staging buffer
on a side stream and returns; the bytes reach the slot once that copy is done, off the rank's
torch thread (`ShardHandoff.land`), so training goes on meanwhile."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
import structlog
import torch

from rlmesh.models.tp_layout import ModelShape
from rlmesh.rpc.channels import call_options
from rlmesh.transfer.payload import crc32, stream_chunks, torch_dtype
from rlmesh.transfer.shards import (
    SHM_DIR,
    LocalShard,
    SharedMemorySlot,
    as_bytes,
    layout_to_proto,
    shard_specs,
    write_payload,
)
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc

log = structlog.get_logger()

SLOTS_PER_RANK = 2
SLOT_PREFIX = "rlmesh-trainer"


def mesh_tag(output_dir: str) -> str:
    """A short stable id of a run's output folder (the mesh id of `rlmesh up`)."""
    return hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:10]


def slot_name(tag: str, pid: int, rank: int, index: int) -> str:
    return f"{SLOT_PREFIX}-{tag}-{pid}-r{rank}-{index}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_slots(tag: str, rank: int) -> list[str]:
    """Unlinks this mesh's slots of `rank` left behind by processes that no longer exist."""
    removed = []
    for path in SHM_DIR.glob(f"{SLOT_PREFIX}-{tag}-*-r{rank}-*"):
        try:
            pid = int(path.name.split("-")[3])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class PublishError(RuntimeError):
    """A rank could not hand its shards of a version to the weights service. `retryable`: the
    service was unreachable or too slow (down, restarting), not refusing the shards."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(slots=True)
class PackedShards:
    header: weights_pb2.ShardsHeader
    payload: torch.Tensor
    """uint8; the first header.total_bytes bytes are the payload (once `copied` is None)."""
    pack_seconds: float
    """Enqueueing the copy, waiting for it and writing the slot (and its crc32)."""
    copied: torch.cuda.Event | None = None
    """While not None, the copy from the device to the staging buffer is in flight until this
    event, and neither the payload nor header.payload_crc32 is written yet (`ShardHandoff.land`)."""


class ShardHandoff:
    def __init__(
        self,
        stub: weights_pb2_grpc.WeightsServiceStub,
        shape: ModelShape,
        rank: int,
        world_size: int,
        mode: str,
        mesh: str,
        timeout: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`dtype`: what the shards are cast to in the payload (the version's served dtype)."""
        if mode not in ("shm", "stream"):
            raise ValueError(f"handoff must be 'shm' or 'stream', got {mode!r}")
        self.stub = stub
        self.layout = layout_to_proto(shape)
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.mesh = mesh
        self.timeout = timeout
        self.dtype = dtype
        self._slots: list[SharedMemorySlot] = []
        self._buffer: torch.Tensor | None = None
        self._published = 0
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        """Pinned host memory the device copies go to, reused for every version."""
        self._landing = threading.Lock()
        self._unlanded: PackedShards | None = None
        if mode == "shm":
            removed = remove_stale_slots(mesh, rank)
            if removed:
                log.info("removed shared-memory slots of dead trainer processes", slots=removed)

    def _target(self, nbytes: int) -> tuple[torch.Tensor, str]:
        """Where the next payload goes: the next shared-memory slot, or a reused buffer to stream from."""
        if self.mode == "stream":
            self.close()
            if self._buffer is None or self._buffer.numel() < nbytes:
                # Zeroed: the padding between shards is never written, yet its bytes are checksummed.
                self._buffer = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
            return self._buffer, ""
        if not self._slots or self._slots[0].nbytes < nbytes:
            for slot in self._slots:
                slot.close()
            self._slots = [
                SharedMemorySlot(slot_name(self.mesh, os.getpid(), self.rank, i), nbytes) for i in range(SLOTS_PER_RANK)
            ]
            log.info("shared-memory slots allocated", slots=[str(s.path) for s in self._slots], bytes=nbytes)
        slot = self._slots[self._published % SLOTS_PER_RANK]
        return slot.tensor, str(slot.path)

    def pack(self, version: int, shards: Mapping[str, LocalShard]) -> PackedShards:
        """Copies this rank's shards, cast to `dtype`, into the next slot (the rank's torch thread).
        Shards on a CUDA device are only enqueued for the copy: `land` completes it."""
        started = time.perf_counter()
        # The staging buffer and the slots are reused: the last version's bytes must be out first.
        self._land_pending()
        specs, total = shard_specs(shards, self.dtype)
        target, shm_path = self._target(total)
        self._published += 1
        header = weights_pb2.ShardsHeader(
            version=version,
            rank=self.rank,
            world_size=self.world_size,
            layout=self.layout,
            shards=specs,
            total_bytes=total,
            shm_path=shm_path,
        )
        device = next((shard.tensor.device for shard in shards.values()), torch.device("cpu"))
        if device.type != "cuda":
            header.payload_crc32 = write_payload(shards, specs, target)
            return PackedShards(header, target, time.perf_counter() - started)
        copied = self._enqueue_copy(shards, specs, total, device)
        self._unlanded = PackedShards(header, target, time.perf_counter() - started, copied)
        return self._unlanded

    def _enqueue_copy(
        self, shards: Mapping[str, LocalShard], specs: list[weights_pb2.ShardSpec], total: int, device: torch.device
    ) -> torch.cuda.Event:
        """Casts each shard on the device and copies it to the staging buffer, on a side stream that
        first waits for the compute stream (the last optimizer step); returns the copy's event.
        Whatever changes the shards must wait for that event (`ShardedPolicy.guard_writes`)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if self._staging is None or self._staging.numel() < total:
            self._staging = None  # the old buffer's pinned memory goes before the new one is pinned
            self._staging = torch.zeros(max(total, 1), dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            # The casts' temporaries are allocated on this stream, so their memory is reused only after the copies.
            for spec, shard in zip(specs, shards.values()):
                if spec.nbytes:
                    self._staging[spec.offset : spec.offset + spec.nbytes].copy_(
                        as_bytes(shard.tensor, torch_dtype(spec.dtype)), non_blocking=True
                    )
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return copied

    async def land(self, packed: PackedShards) -> None:
        """Waits for the packed shards' copy from the device, then writes them into their slot or
        buffer and checksums them, all in a worker thread; nothing to do once they are there."""
        if packed.copied is not None:
            await asyncio.to_thread(self.land_now, packed)

    def land_now(self, packed: PackedShards) -> None:
        """`land`, blocking the calling thread (not the rank's torch thread, or nothing overlaps)."""
        with self._landing:
            if packed.copied is None:
                return
            started = time.perf_counter()
            packed.copied.synchronize()
            total = packed.header.total_bytes
            packed.payload[:total].copy_(self._staging[:total])
            packed.header.payload_crc32 = crc32(packed.payload[:total].numpy())
            packed.copied = None
            packed.pack_seconds += time.perf_counter() - started
            if self._unlanded is packed:
                self._unlanded = None

    def _land_pending(self) -> None:
        if self._unlanded is not None:
            self.land_now(self._unlanded)

    async def upload(self, packed: PackedShards) -> weights_pb2.UploadShardsResponse:
        """Hands the packed shards over; returns once the weights service copied them. If the
        weights service cannot open the shared-memory file (another host or container), the
        bytes are streamed instead, now and for every later version."""
        await self.land(packed)
        try:
            return await self._send(packed)
        except grpc.aio.AioRpcError as exc:
            unreadable = (
                packed.header.shm_path
                and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "shm_path" in (exc.details() or "")
            )
            if not unreadable:
                raise self._failed(packed, exc) from exc
            log.warning(
                "the weights service cannot read this rank's shared memory (another host or container?); "
                'streaming the shards instead: set handoff = "stream"',
                error=exc.details(),
            )
        packed.header.shm_path = ""
        try:
            reply = await self._send(packed)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(packed, exc) from exc
        self.mode = "stream"  # the slots go at the next pack, once nothing views them
        return reply

    async def _send(self, packed: PackedShards) -> weights_pb2.UploadShardsResponse:
        header = packed.header

        async def parts() -> AsyncIterator[weights_pb2.UploadShardsRequest]:
            yield weights_pb2.UploadShardsRequest(header=header)
            if not header.shm_path:
                for offset, data in stream_chunks(packed.payload, header.total_bytes):
                    yield weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

        return await self.stub.UploadShards(parts(), **call_options(self.timeout))

    def _failed(self, packed: PackedShards, exc: grpc.aio.AioRpcError) -> PublishError:
        return PublishError(
            f"rank {self.rank}: UploadShards of version {packed.header.version} failed: "
            f"{exc.code().name}: {exc.details()}",
            retryable=exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
        )

    def close(self) -> None:
        """Unmaps and unlinks the slots. A slot something still views keeps its memory until the
        process ends, but its name goes now. Waits for a landing copy into a slot first."""
        with self._landing:
            for slot in self._slots:
                try:
                    slot.close()
                except BufferError:
                    slot.path.unlink(missing_ok=True)
            self._slots = []
