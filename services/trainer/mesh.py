"""The trainer's view of the mesh from rank 0: submit prompts, stream rollouts, announce versions
(manager), the latest stored version (weights service). Every call carries a deadline."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.tp_layout import ModelShape
from rlmesh.payload import pack, stream_chunks
from rlmesh.rpc import call_options, open_channel
from rlmesh.shards import LocalShard, layout_to_proto, shard_specs, write_payload
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc


class MeshClient:
    def __init__(self, manager_address: str, weights_address: str, rpc_timeout: float) -> None:
        self.rpc_timeout = rpc_timeout
        self._manager_channel = open_channel(manager_address)
        self._weights_channel = open_channel(weights_address)
        self.manager = manager_pb2_grpc.ManagerServiceStub(self._manager_channel)
        self.weights = weights_pb2_grpc.WeightsServiceStub(self._weights_channel)

    async def manager_status(self) -> manager_pb2.GetStatusResponse:
        return await self.manager.GetStatus(manager_pb2.GetStatusRequest(), **call_options(self.rpc_timeout))

    async def stored_version(self) -> int:
        """The newest version the weights service holds, -1 if none."""
        status = await self.weights.GetStatus(weights_pb2.GetStatusRequest(), **call_options(self.rpc_timeout))
        return status.latest_version

    async def cancel(self, batch_id: str) -> None:
        await self.manager.CancelBatch(manager_pb2.CancelBatchRequest(batch_id=batch_id), **call_options(self.rpc_timeout))

    async def submit(self, batch_id: str, policy_version: int, prompts: list[tuple[str, list[int]]], n: int, sampling: common_pb2.SamplingParams) -> None:
        await self.manager.SubmitPrompts(
            manager_pb2.SubmitPromptsRequest(
                batch_id=batch_id,
                policy_version=policy_version,
                prompts=[manager_pb2.Prompt(prompt_id=pid, token_ids=ids, n=n) for pid, ids in prompts],
                sampling=sampling,
            ),
            **call_options(self.rpc_timeout),
        )

    async def rollouts(self, batch_id: str, micro_batch_groups: int, min_groups: int, max_tokens: int, timeout: float) -> AsyncIterator[list[manager_pb2.Group]]:
        stream = self.manager.StreamRollouts(
            manager_pb2.StreamRolloutsRequest(
                batch_id=batch_id, micro_batch_groups=micro_batch_groups, min_groups=min_groups, max_tokens=max_tokens
            ),
            **call_options(timeout),
        )
        async for reply in stream:
            yield list(reply.groups)

    async def report_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> manager_pb2.StageBalance:
        reply = await self.manager.ReportTrainingStep(
            manager_pb2.ReportTrainingStepRequest(batch_id=batch_id, step_seconds=step_seconds, wait_seconds=wait_seconds),
            **call_options(self.rpc_timeout),
        )
        return reply.stage_balance

    async def announce(self, version: int) -> None:
        """Tells the manager a version is published (after every trainer rank uploaded its shards)."""
        await self.manager.PublishVersion(manager_pb2.PublishVersionRequest(version=version), **call_options(self.rpc_timeout))

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor], shape: ModelShape | None = None) -> float:
        """Uploads whole tensors (HF names, tied ones once) from one process, then announces the
        version; returns the seconds spent. With `shape` they go as the one rank of a one-rank
        world through UploadShards (what tensor-parallel rollout instances need); without it
        through the legacy UploadWeights. The trainer never does this (its ranks hand over their
        FSDP shards, see handoff.py); tests and tools that publish a model without a trainer do."""
        started = time.perf_counter()
        if shape is not None:
            shards = {name: LocalShard(t.detach(), tuple(t.shape), 0, t.shape[0]) for name, t in tensors.items()}
            specs, total = shard_specs(shards)
            payload = torch.empty(max(total, 1), dtype=torch.uint8)
            header = weights_pb2.ShardsHeader(version=version, rank=0, world_size=1, layout=layout_to_proto(shape),
                                              shards=specs, total_bytes=total, payload_crc32=write_payload(shards, specs, payload))

            async def shard_parts() -> AsyncIterator[weights_pb2.UploadShardsRequest]:
                yield weights_pb2.UploadShardsRequest(header=header)
                for offset, data in stream_chunks(payload, total):
                    yield weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

            await self.weights.UploadShards(shard_parts(), **call_options(max(self.rpc_timeout, 60.0)))
        else:
            manifest, payload = pack(tensors, version)

            async def parts() -> AsyncIterator[weights_pb2.UploadWeightsRequest]:
                yield weights_pb2.UploadWeightsRequest(manifest=manifest)
                for offset, data in stream_chunks(payload, manifest.total_bytes):
                    yield weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

            await self.weights.UploadWeights(parts(), **call_options(max(self.rpc_timeout, 60.0)))
        await self.announce(version)
        return time.perf_counter() - started

    async def close(self) -> None:
        await self._manager_channel.close()
        await self._weights_channel.close()

