"""Delivered samples whose tokens a relay shard of the manager holds: fetched from that shard, so
the tokens reach the trainer without passing through the manager."""

from __future__ import annotations

import grpc

from rlmesh.manager.v1 import manager_pb2, relay_pb2, relay_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from services.trainer.outage import ManagerOutage

FETCH_BATCH = 1024
"""Samples asked for in one FetchSamples call."""


class RelayedPayloads:
    def __init__(self, rpc_timeout: float, outage_seconds: float) -> None:
        self.rpc_timeout = rpc_timeout
        self.outage_seconds = outage_seconds
        self._channels: dict[str, tuple[grpc.aio.Channel, relay_pb2_grpc.RelayServiceStub]] = {}

    def _stub(self, address: str) -> relay_pb2_grpc.RelayServiceStub:
        if address not in self._channels:
            channel = open_channel(address)
            self._channels[address] = (channel, relay_pb2_grpc.RelayServiceStub(channel))
        return self._channels[address][1]

    async def fill(self, groups: list[manager_pb2.Group]) -> None:
        """Puts each relayed sample's tokens, logprobs and versions in place, checked against the
        count the manager's ledger holds."""
        by_relay: dict[str, list[manager_pb2.Sample]] = {}
        for group in groups:
            for sample in group.samples:
                if sample.HasField("relayed"):
                    by_relay.setdefault(sample.relayed.address, []).append(sample)
        for address, samples in by_relay.items():
            for start in range(0, len(samples), FETCH_BATCH):
                part = samples[start : start + FETCH_BATCH]
                reply = await self._fetch(address, [s.relayed for s in part])
                if len(reply.samples) != len(part):
                    raise RuntimeError(f"relay shard {address} answered {len(reply.samples)} of {len(part)} samples")
                for sample, fetched in zip(part, reply.samples, strict=True):
                    asked = sample.relayed
                    if fetched.request_id != asked.request_id or len(fetched.token_ids) != asked.token_count:
                        raise RuntimeError(
                            f"relay shard {address} answered {fetched.request_id!r} with {len(fetched.token_ids)} "
                            f"tokens for {asked.request_id!r} with {asked.token_count}"
                        )
                    sample.token_ids.extend(fetched.token_ids)
                    sample.logprobs.extend(fetched.logprobs)
                    sample.weight_versions.extend(fetched.weight_versions)
                    sample.ClearField("relayed")

    async def _fetch(self, address: str, payloads: list[manager_pb2.RelayedPayload]) -> relay_pb2.FetchSamplesResponse:
        outage = ManagerOutage(self.outage_seconds)
        while True:
            try:
                return await self._stub(address).FetchSamples(
                    relay_pb2.FetchSamplesRequest(payloads=payloads), **call_options(self.rpc_timeout)
                )
            except grpc.aio.AioRpcError as exc:
                await outage.wait(exc, f"FetchSamples from relay shard {address}")

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
