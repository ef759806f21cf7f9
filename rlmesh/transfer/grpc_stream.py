"""The plain gRPC backend: each rank's buckets stream to the instance as PushWeightChunks
messages (raw buckets in 1 MiB pieces, the fastest size measured on loopback; an encoded bucket
in one message), for links where neither a transfer engine nor a raw TCP port is reachable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options
from rlmesh.transfer.base import Frame, Superseded, TransferError, WeightSender
from rlmesh.transfer.payload import STREAM_CHUNK_BYTES


class GrpcStreamSender(WeightSender):
    backend = rollout_pb2.TRANSFER_BACKEND_GRPC

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
        version, rank = manifest.version, endpoint.tp_rank
        source = iter(frames)

        async def requests() -> AsyncIterator[rollout_pb2.PushWeightChunksRequest]:
            while True:
                # Frames may wait on encoding: pull them off the event loop.
                frame = await asyncio.to_thread(next, source, None)
                if frame is None:
                    return
                if cancelled():
                    raise Superseded(f"push of version {version} was superseded")
                offset, raw_bytes, compression, base_version, data = frame
                pieces = range(0, raw_bytes, STREAM_CHUNK_BYTES) if compression == common_pb2.COMPRESSION_NONE else [0]
                for start in pieces:
                    piece = (
                        bytes(data[start : start + STREAM_CHUNK_BYTES])
                        if compression == common_pb2.COMPRESSION_NONE
                        else bytes(data)
                    )
                    yield rollout_pb2.PushWeightChunksRequest(
                        version=version,
                        offset=offset + start,
                        data=piece,
                        tp_rank=rank,
                        compression=compression,
                        raw_bytes=len(piece) if compression == common_pb2.COMPRESSION_NONE else raw_bytes,
                        base_version=base_version,
                    )

        reply = await stub.PushWeightChunks(requests(), **call_options(timeout))
        if reply.received_bytes != manifest.total_bytes:
            raise TransferError(f"rank {rank} received {reply.received_bytes} of {manifest.total_bytes} bytes")
        return b""
