"""The plain gRPC backend: the payload streams to the instance in 1 MiB messages, for links where
no transfer engine runs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.payload import stream_chunks
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import call_options
from rlmesh.transfer.base import TransferError, WeightSender

class GrpcStreamSender(WeightSender):
    backend = rollout_pb2.TRANSFER_BACKEND_GRPC

    async def send(
        self,
        manifest: common_pb2.WeightManifest,
        payload: torch.Tensor,
        stub: rollout_pb2_grpc.RolloutServiceStub,
        begin: rollout_pb2.BeginWeightUpdateResponse,
        timeout: float,
    ) -> None:
        async def requests() -> AsyncIterator[rollout_pb2.PushWeightChunksRequest]:
            for offset, data in stream_chunks(payload, manifest.total_bytes):
                yield rollout_pb2.PushWeightChunksRequest(version=manifest.version, offset=offset, data=data)

        reply = await stub.PushWeightChunks(requests(), **call_options(timeout))
        if reply.received_bytes != manifest.total_bytes:
            raise TransferError(f"instance received {reply.received_bytes} of {manifest.total_bytes} bytes")
