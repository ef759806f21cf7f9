"""Pushes the latest version to every registered instance that is behind it: each tensor-parallel
rank of an instance gets only its own payload, encoded for the link, over the configured backend,
all ranks at once; then the instance commits. Failures are retried with backoff, a newer version
supersedes an unfinished push, and the uploading trainer never waits on any of this."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import structlog

from rlmesh.errors import DomainError
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.transfer.base import Frame, Superseded, TransferError, WeightSender, raw_frames
from rlmesh.transfer.codecs import CompressionMode, CompressionReport, DeltaSchedule
from rlmesh.transfer.receiver import CODE_OF_MODE
from services.weights.config import WeightsConfig
from services.weights.encoding import EncodedPayload
from services.weights.store import FULL_LAYOUT, RankPayload, Snapshot, WeightStore

log = structlog.get_logger()


@dataclass(slots=True)
class PushState:
    instance_id: str
    address: str
    incarnation: int
    committed_version: int = -1
    pushing_version: int = 0
    layout_tp: int | None = None
    """The payloads the instance's engine takes: FULL_LAYOUT or its TP size; None until asked."""
    compression: CompressionMode = "none"
    last_push_ms: float = 0.0
    last_push_gbps: float = 0.0
    last_version_latency_ms: float = 0.0
    compression_ratio: float = 1.0
    encode_ms: float = 0.0
    max_abs_error: float = 0.0
    relative_rms_error: float = 0.0
    failures: int = 0
    superseded: int = 0
    last_error: str = ""
    retry_at: float = 0.0

    @property
    def tensor_parallel_size(self) -> int:
        return max(1, self.layout_tp or 0)


@dataclass(slots=True)
class Link:
    """One rank's share of a push: what to send and how."""

    endpoint: rollout_pb2.RankEndpoint
    rank: RankPayload
    frames: Iterable[Frame]
    report: CompressionReport | None


class Pusher:
    def __init__(self, store: WeightStore, sender: WeightSender, config: WeightsConfig) -> None:
        self.store = store
        self.sender = sender
        self.config = config
        self.instances: dict[str, PushState] = {}
        self.deltas = DeltaSchedule(config.delta_full_every)
        self._encodings_lock = threading.Lock()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._wake = asyncio.Event()
        self._manager_channel = open_channel(config.manager_address)
        self._manager = manager_pb2_grpc.ManagerServiceStub(self._manager_channel)

    def trigger(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_seconds)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._reconcile()
            except grpc.aio.AioRpcError as exc:
                log.warning("cannot list instances", code=exc.code().name, error=exc.details())

    async def _reconcile(self) -> None:
        reply = await self._manager.ListInstances(
            manager_pb2.ListInstancesRequest(), **call_options(self.config.rpc_timeout_seconds)
        )
        live = {i.instance_id: i for i in reply.instances}
        for instance_id, state in list(self.instances.items()):
            info = live.get(instance_id)
            # Gone, or registered again as a new process whose state starts over.
            if info is None or info.incarnation != state.incarnation:
                self._forget(instance_id)
        await self._close_unused_channels({i.address for i in live.values()})
        latest = self.store.latest
        now = time.monotonic()
        for instance_id, info in live.items():
            state = self.instances.setdefault(instance_id, PushState(instance_id, info.address, info.incarnation))
            state.committed_version = max(state.committed_version, info.weight_version)
            busy = instance_id in self._tasks
            if latest is None or busy or state.committed_version >= latest.version or now < state.retry_at:
                continue
            snapshot = self.store.acquire()
            assert snapshot is not None
            self._tasks[instance_id] = asyncio.create_task(self._push(state, snapshot))

    def _update_layouts_in_use(self) -> None:
        """The payloads the live instances take are built for each new version as its shards arrive."""
        self.store.layouts_in_use = {
            (s.layout_tp, rank)
            for s in self.instances.values()
            if s.layout_tp is not None
            for rank in range(max(1, s.layout_tp))
        }

    def _forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id)
        self.deltas.forget(instance_id)
        self._update_layouts_in_use()
        task = self._tasks.pop(instance_id, None)
        if task:
            task.cancel()

    async def _close_unused_channels(self, live_addresses: set[str]) -> None:
        for address in self._channels.keys() - live_addresses:
            await self._channels.pop(address).close()

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return rollout_pb2_grpc.RolloutServiceStub(self._channels[address])

    def _superseded(self, version: int) -> bool:
        latest = self.store.latest
        return latest is not None and latest.version > version

    async def _push(self, state: PushState, snapshot: Snapshot) -> None:
        version = snapshot.version
        state.pushing_version = version
        started = time.perf_counter()
        structlog.contextvars.bind_contextvars(instance_id=state.instance_id, weight_version=version)
        base = self.store.acquire_previous()
        try:
            stub = self._stub(state.address)
            timeout = self.config.rpc_timeout_seconds
            info = await stub.GetInfo(rollout_pb2.GetInfoRequest(), **call_options(timeout))
            mode = self._link_mode(state, info)
            takes_ranks = info.weight_layout == rollout_pb2.WEIGHT_LAYOUT_TENSOR_PARALLEL
            state.layout_tp = max(1, info.tensor_parallel_size) if takes_ranks else FULL_LAYOUT
            self._update_layouts_in_use()
            # A version uploaded as full tensors has no layout to cut by: every engine takes full tensors.
            tensor_parallel = takes_ranks and snapshot.shape is not None
            tp = state.layout_tp if tensor_parallel else FULL_LAYOUT
            phases = {"info_ms": time.perf_counter()}
            ranks = [await asyncio.to_thread(snapshot.rank_payload, tp, r) for r in range(max(1, tp))]
            phases["reshard_ms"] = time.perf_counter()
            manifests = [r.manifest for r in ranks]
            if mode in ("int8", "fp8"):
                manifests = await asyncio.to_thread(
                    lambda: [self._encoding(snapshot, tp, i, r, mode).lossy_manifest() for i, r in enumerate(ranks)]
                )
            request = rollout_pb2.BeginWeightUpdateRequest(
                backend=self.sender.backend, link_compression=CODE_OF_MODE[mode]
            )
            if tensor_parallel:
                request.rank_manifests.extend(manifests)
            else:
                request.manifest.CopyFrom(manifests[0])
            begin = await stub.BeginWeightUpdate(request, **call_options(timeout))
            phases["begin_ms"] = time.perf_counter()
            endpoints = list(begin.ranks) or [
                rollout_pb2.RankEndpoint(
                    tp_rank=0,
                    transfer_session=begin.transfer_session,
                    buffer_address=begin.buffer_address,
                    buffer_bytes=begin.buffer_bytes,
                    held_version=-1,
                )
            ]
            if len(endpoints) != len(ranks):
                raise TransferError(f"the instance offered {len(endpoints)} receiving ranks for {len(ranks)} payloads")
            links = await asyncio.to_thread(self._links, state, snapshot, base, tp, ranks, endpoints, mode)
            proofs = await asyncio.gather(
                *(
                    self.sender.send_rank(
                        stub,
                        link.endpoint,
                        link.rank.manifest,
                        link.rank.payload,
                        link.frames,
                        self.config.push_timeout_seconds,
                        lambda: self._superseded(version),
                    )
                    for link in links
                )
            )
            phases["transfer_ms"] = time.perf_counter()
            commit = rollout_pb2.CommitWeightUpdateRequest(
                version=version, rank_proofs=proofs if self.sender.proves_commit else []
            )
            await stub.CommitWeightUpdate(commit, **call_options(self.config.push_timeout_seconds))
            phases["commit_ms"] = time.perf_counter()
            elapsed = time.perf_counter() - started
            payload_bytes = sum(r.manifest.total_bytes for r in ranks)
            state.committed_version = max(state.committed_version, version)
            state.last_push_ms = elapsed * 1000
            state.last_version_latency_ms = (time.monotonic() - snapshot.stored_at) * 1000
            state.last_push_gbps = payload_bytes / elapsed / 1e9
            self._record_compression(state, links)
            state.failures = 0
            state.last_error = ""
            marks = [started, *phases.values()]
            durations = {name: round((end - start) * 1000, 2) for name, start, end in zip(phases, marks, marks[1:])}
            log.info(
                "pushed",
                ms=round(state.last_push_ms, 2),
                gbps=round(state.last_push_gbps, 3),
                ranks=len(ranks),
                **durations,
                compression=state.compression,
                ratio=round(state.compression_ratio, 2),
            )
        except Superseded:
            state.superseded += 1
            log.info("push superseded by a newer version; the instance keeps its old one")
        except (grpc.aio.AioRpcError, TransferError, TimeoutError, DomainError) as exc:
            state.failures += 1
            message = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            state.last_error = message or type(exc).__name__
            backoff = min(30.0, self.config.retry_backoff_seconds * 2 ** (state.failures - 1))
            state.retry_at = time.monotonic() + backoff
            log.warning("push failed; instance keeps its old version", error=state.last_error, retry_in_s=backoff)
        finally:
            state.pushing_version = 0
            self.store.release(snapshot)
            if base is not None:
                self.store.release(base)
            if self._tasks.get(state.instance_id) is asyncio.current_task():
                del self._tasks[state.instance_id]
            self.trigger()

    def _link_mode(self, state: PushState, info: rollout_pb2.GetInfoResponse) -> CompressionMode:
        mode = self.config.link_mode(state.instance_id)
        if not self.sender.carries_compression:
            mode = "none"
        if mode in ("int8", "fp8") and not info.quantized_weights:
            raise TransferError(
                f"link compression {mode} is lossy and instance {state.instance_id} does not serve quantized weights"
            )
        state.compression = mode
        return mode

    def compressed_links(self) -> set[tuple[int, CompressionMode]]:
        """(layout, compression) of every compressed link pushed to so far."""
        return {
            (s.layout_tp, s.compression)
            for s in self.instances.values()
            if s.layout_tp is not None and s.compression != "none"
        }

    def encode_ahead(self, snapshot: Snapshot, base: Snapshot | None, links: set[tuple[int, CompressionMode]]) -> None:
        """Encodes a version about to be stored for these links, once per layout, rank and mode
        (deltas against `base`, the latest version), so their pushes only send. Blocking; the
        ranks encode in parallel."""
        encodings = []
        for tp, mode in links:
            if mode == "delta" and (base is None or base.shape is None):
                continue
            try:
                for rank_index in range(max(1, tp)):
                    rank = snapshot.rank_payload(tp, rank_index)
                    encodings.append(
                        self._encoding(snapshot, tp, rank_index, rank, mode, base if mode == "delta" else None)
                    )
            except DomainError as exc:
                # The push to that link fails with the same reason; the version is stored regardless.
                log.warning("cannot encode ahead for a link", tensor_parallel_size=tp, compression=mode, error=str(exc))
        for encoded in encodings:
            encoded.start()
        for encoded in encodings:
            encoded.wait()

    def _links(
        self,
        state: PushState,
        snapshot: Snapshot,
        base: Snapshot | None,
        tp: int,
        ranks: list[RankPayload],
        endpoints: list[rollout_pb2.RankEndpoint],
        mode: CompressionMode,
    ) -> list[Link]:
        """Chooses each rank's frames. Blocking (may build the base version's payloads)."""
        if mode == "none":
            return [
                Link(endpoint, rank, raw_frames(rank.manifest, rank.payload), None)
                for endpoint, rank in zip(endpoints, ranks)
            ]
        held = {endpoint.held_version for endpoint in endpoints}
        receiver_base = held.pop() if len(held) == 1 else None
        base_version = base.version if base is not None and base.shape is not None else None
        delta = mode == "delta" and self.deltas.sends_delta(
            state.instance_id, snapshot.version, base_version, receiver_base if receiver_base != -1 else None
        )
        links = []
        for rank_index, (endpoint, rank) in enumerate(zip(endpoints, ranks)):
            if delta:
                assert base is not None
                encoded = self._encoding(snapshot, tp, rank_index, rank, "delta", base)
            else:
                # A full version on a delta link goes zstd-encoded.
                encoded = self._encoding(snapshot, tp, rank_index, rank, "zstd" if mode == "delta" else mode)
            links.append(Link(endpoint, rank, encoded.frames(), encoded.report))
        return links

    def _encoding(
        self,
        snapshot: Snapshot,
        tp: int,
        rank_index: int,
        rank: RankPayload,
        mode: CompressionMode,
        base: Snapshot | None = None,
    ) -> EncodedPayload:
        """The shared encoding of one rank's payload (blocking when it must build the base's payload)."""
        base_rank = base.rank_payload(tp, rank_index) if base is not None else None
        key = (tp, rank_index, mode, base.version if base is not None else -1)
        with self._encodings_lock:
            encoded = snapshot.encodings.get(key)
            if encoded is None:
                encoded = snapshot.encodings[key] = EncodedPayload(
                    rank, mode, base_rank, base.version if base is not None else -1
                )
            return encoded

    @staticmethod
    def _record_compression(state: PushState, links: list[Link]) -> None:
        reports = [link.report for link in links if link.report is not None]
        if not reports:
            state.compression_ratio, state.encode_ms, state.max_abs_error, state.relative_rms_error = 1.0, 0.0, 0.0, 0.0
            return
        raw = sum(r.raw_bytes for r in reports)
        encoded = sum(r.encoded_bytes for r in reports)
        state.compression_ratio = raw / encoded if encoded else 1.0
        state.encode_ms = sum(r.encode_seconds for r in reports) * 1000
        state.max_abs_error = max(r.max_abs_error for r in reports)
        state.relative_rms_error = max(r.relative_rms_error for r in reports)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
        await self._manager_channel.close()
        self.sender.close()
