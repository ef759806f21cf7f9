"""Host-memory store of weight versions. A version arrives as FSDP shards from every trainer rank
(or, for engines that take full tensors, as one legacy upload) and becomes the latest only when
complete and verified; each tensor-parallel rank's payload is cut from the shards on first use,
once per layout, and buffers still read by a push are never overwritten."""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.tp_layout import ModelShape, apply_copies, full_slices, hf_parameter_shapes, reshard_plan, tp_parameter_shapes, tp_slices
from rlmesh.payload import DEFAULT_BUCKET_BYTES, PayloadError, bucket_checksums, corrupted_buckets, pack_layout, torch_dtype, unpack, validate_manifest, write_bytes
from rlmesh.shards import shard_views, validate_header
from rlmesh.weights.v1 import weights_pb2

FULL_LAYOUT = 0
"""The tensor-parallel size that stands for full tensors under their HF names."""


class BufferPool:
    """Pre-faulted uint8 buffers reused by size class: a cold buffer measured 8x slower to fill."""

    def __init__(self) -> None:
        self._free: dict[object, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, key: object, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(key, [])
            for index, buffer in enumerate(free):
                if buffer.numel() >= nbytes:
                    return free.pop(index)[:nbytes]
        # Touch every page now so the copies that fill it later do not pay the faults.
        return torch.zeros(nbytes, dtype=torch.uint8)

    def give(self, key: object, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(buffer)


@dataclass(eq=False, slots=True)
class RankPayload:
    """One tensor-parallel rank's bytes of a version (or the full tensors when tp is FULL_LAYOUT)."""

    manifest: common_pb2.WeightManifest
    payload: torch.Tensor
    build_seconds: float = 0.0


@dataclass(eq=False)
class Snapshot:
    """One complete version. `readers` counts pushes still reading it; its buffers go back to the
    pool only when it is neither the latest, nor the delta base, nor read."""

    version: int
    shape: ModelShape | None
    """None for a legacy upload of full tensors, which serves only the full layout."""
    headers: list[weights_pb2.ShardsHeader]
    shards: list[torch.Tensor]
    pool: BufferPool
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    readers: int = 0
    payloads: dict[tuple[int, int], RankPayload] = field(default_factory=dict)
    encodings: dict[tuple, object] = field(default_factory=dict)
    """Encoded forms of the payloads, shared by the links that send the same bytes."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total_bytes(self) -> int:
        return sum(h.total_bytes for h in self.headers) if self.headers else sum(p.manifest.total_bytes for p in self.payloads.values())

    def rank_payload(self, tp: int, rank: int) -> RankPayload:
        """Rank `rank`'s payload for an engine split over `tp` ranks (FULL_LAYOUT: full tensors),
        built from the FSDP shards the first time it is asked for. Blocking: call it off the loop."""
        key = (tp, rank)
        with self._lock:
            built = self.payloads.get(key)
            if built is not None:
                return built
            if self.shape is None:
                raise FailedPrecondition(f"version {self.version} was uploaded as full tensors without a model layout; "
                                         "tensor-parallel engines need versions uploaded with UploadShards")
            started = time.perf_counter()
            try:
                targets = tp_parameter_shapes(self.shape, tp) if tp != FULL_LAYOUT else hf_parameter_shapes(self.shape)
                slices = tp_slices(self.shape, tp, rank) if tp != FULL_LAYOUT else full_slices(self.shape)
            except ValueError as exc:
                raise InvalidArgument(f"cannot split version {self.version} over {tp} ranks: {exc}") from exc
            dtype = torch_dtype(self.headers[0].shards[0].dtype)
            manifest = pack_layout({name: (dims, dtype) for name, dims in targets.items()}, self.version, self.bucket_bytes)
            manifest.tensor_parallel_size = 0 if tp == FULL_LAYOUT else tp
            manifest.tensor_parallel_rank = rank
            payload = self.pool.take(key, manifest.total_bytes)
            outputs = unpack(manifest, payload)
            rows = {spec.name: spec.full_shape[0] for spec in self.headers[0].shards}
            views = [shard_views(header, shard) for header, shard in zip(self.headers, self.shards)]
            apply_copies(reshard_plan(slices, rows, len(self.headers)), views, outputs)
            manifest.bucket_crc32.extend(bucket_checksums(payload, self.bucket_bytes))
            built = self.payloads[key] = RankPayload(manifest, payload, time.perf_counter() - started)
            return built

    def release_buffers(self) -> None:
        for header, shard in zip(self.headers, self.shards):
            self.pool.give(("shard", header.rank), shard)
        for key, built in self.payloads.items():
            self.pool.give(key, built.payload)
        self.shards, self.payloads, self.encodings = [], {}, {}


@dataclass(eq=False, slots=True)
class Upload:
    """A legacy upload of full tensors, filled chunk by chunk."""

    manifest: common_pb2.WeightManifest
    payload: torch.Tensor
    received: int = 0

    def write(self, offset: int, data: bytes) -> None:
        if not data:
            return
        if offset != self.received:
            raise InvalidArgument(f"chunk at offset {offset}, expected {self.received}: chunks must arrive in order")
        end = offset + len(data)
        if end > self.manifest.total_bytes:
            raise InvalidArgument(f"chunk ends at {end}, past the payload's {self.manifest.total_bytes} bytes")
        write_bytes(self.payload, offset, data)
        self.received = end


@dataclass(slots=True)
class Assembly:
    """The ranks of one version received so far."""

    version: int
    world_size: int
    shape: ModelShape
    headers: dict[int, weights_pb2.ShardsHeader] = field(default_factory=dict)
    shards: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class WeightStore:
    max_bytes: int = 64 << 30
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    latest: Snapshot | None = None
    previous: Snapshot | None = None
    """The version before the latest, kept as the base for delta-compressed pushes."""
    pool: BufferPool = field(default_factory=BufferPool)
    _assemblies: dict[int, Assembly] = field(default_factory=dict)
    _retired: list[Snapshot] = field(default_factory=list)

    # Sharded uploads --------------------------------------------------------------------------

    def check_shards(self, header: weights_pb2.ShardsHeader) -> ModelShape:
        """Validates a rank's header before its bytes are read."""
        try:
            shape = validate_header(header)
        except ValueError as exc:
            raise InvalidArgument(f"shards header: {exc}") from exc
        if header.total_bytes > self.max_bytes:
            raise InvalidArgument(f"rank {header.rank} declares {header.total_bytes} bytes, over the limit of {self.max_bytes}")
        self._check_newer(header.version)
        assembly = self._assemblies.get(header.version)
        if assembly is not None:
            if assembly.world_size != header.world_size or assembly.shape != shape:
                raise InvalidArgument(f"rank {header.rank} of version {header.version} disagrees with the other ranks on the "
                                      "world size or the model layout")
            if header.rank in assembly.headers:
                raise InvalidArgument(f"rank {header.rank} of version {header.version} was already received")
        return shape

    def shard_buffer(self, header: weights_pb2.ShardsHeader) -> torch.Tensor:
        return self.pool.take(("shard", header.rank), header.total_bytes)

    def add_shards(self, header: weights_pb2.ShardsHeader, payload: torch.Tensor) -> tuple[int, Snapshot | None]:
        """Adds a rank's verified bytes; returns the ranks received and the snapshot once complete."""
        shape = self.check_shards(header)
        if zlib.crc32(payload[: header.total_bytes].numpy()) != header.payload_crc32:
            self.pool.give(("shard", header.rank), payload)
            raise InvalidArgument(f"rank {header.rank} of version {header.version}: payload crc32 mismatch")
        assembly = self._assemblies.setdefault(header.version, Assembly(header.version, header.world_size, shape))
        assembly.headers[header.rank] = header
        assembly.shards[header.rank] = payload
        if len(assembly.headers) < assembly.world_size:
            return len(assembly.headers), None
        del self._assemblies[header.version]
        ranks = range(assembly.world_size)
        headers = [assembly.headers[r] for r in ranks]
        self._check_complete(assembly.version, shape, headers)
        snapshot = Snapshot(assembly.version, shape, headers, [assembly.shards[r] for r in ranks], self.pool, self.bucket_bytes)
        self._install(snapshot)
        # Older versions still assembling can never become the latest.
        for version in [v for v in self._assemblies if v < snapshot.version]:
            stale = self._assemblies.pop(version)
            for rank, shard in stale.shards.items():
                self.pool.give(("shard", rank), shard)
        return assembly.world_size, snapshot

    def _check_complete(self, version: int, shape: ModelShape, headers: list[weights_pb2.ShardsHeader]) -> None:
        expected = hf_parameter_shapes(shape)
        dtypes = set()
        for header in headers:
            names = {spec.name: spec for spec in header.shards}
            if names.keys() != expected.keys():
                missing = sorted(expected.keys() - names.keys())[:5]
                unknown = sorted(names.keys() - expected.keys())[:5]
                raise InvalidArgument(f"version {version} rank {header.rank}: shards do not match the layout: missing {missing}, unknown {unknown}")
            for name, spec in names.items():
                if tuple(spec.full_shape) != expected[name]:
                    raise InvalidArgument(f"version {version}: {name} has shape {list(spec.full_shape)}, the layout says {list(expected[name])}")
                dtypes.add(spec.dtype)
        if len(dtypes) != 1:
            raise InvalidArgument(f"version {version} mixes dtypes {sorted(dtypes)}; one dtype per version")

    # Legacy uploads of full tensors ----------------------------------------------------------

    def begin_upload(self, manifest: common_pb2.WeightManifest) -> Upload:
        try:
            validate_manifest(manifest)
        except PayloadError as exc:
            raise InvalidArgument(f"manifest: {exc}") from exc
        self._check_newer(manifest.version)
        if manifest.total_bytes > self.max_bytes:
            raise InvalidArgument(f"version {manifest.version} declares {manifest.total_bytes} bytes, over the limit of {self.max_bytes}")
        return Upload(manifest, self.pool.take((FULL_LAYOUT, 0), manifest.total_bytes))

    def finish(self, upload: Upload) -> Snapshot:
        manifest = upload.manifest
        if upload.received != manifest.total_bytes:
            self.pool.give((FULL_LAYOUT, 0), upload.payload)
            raise InvalidArgument(f"upload of version {manifest.version} ended after {upload.received} of {manifest.total_bytes} bytes")
        bad = corrupted_buckets(manifest, upload.payload)
        if bad:
            self.pool.give((FULL_LAYOUT, 0), upload.payload)
            raise InvalidArgument(f"version {manifest.version}: buckets {bad[:8]} failed their crc32 check")
        self._check_newer(manifest.version)
        snapshot = Snapshot(manifest.version, None, [], [], self.pool, manifest.bucket_bytes)
        snapshot.payloads[(FULL_LAYOUT, 0)] = RankPayload(manifest, upload.payload)
        self._install(snapshot)
        return snapshot

    # Readers ----------------------------------------------------------------------------------

    def acquire(self) -> Snapshot | None:
        if self.latest is not None:
            self.latest.readers += 1
        return self.latest

    def acquire_previous(self) -> Snapshot | None:
        if self.previous is not None:
            self.previous.readers += 1
        return self.previous

    def release(self, snapshot: Snapshot) -> None:
        snapshot.readers -= 1
        self._recycle()

    def _check_newer(self, version: int) -> None:
        if self.latest is not None and version <= self.latest.version:
            raise FailedPrecondition(f"version {version} is not newer than the stored version {self.latest.version}")

    def _install(self, snapshot: Snapshot) -> None:
        if self.previous is not None:
            self._retired.append(self.previous)
        self.previous, self.latest = self.latest, snapshot
        self._recycle()

    def _recycle(self) -> None:
        idle = [s for s in self._retired if s.readers == 0]
        self._retired = [s for s in self._retired if s.readers > 0]
        for snapshot in idle:
            snapshot.release_buffers()
