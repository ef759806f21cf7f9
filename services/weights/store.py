"""Host-memory store of weight versions. A version arrives as FSDP shards from every trainer rank
(or, for engines that take full tensors, as one legacy upload) and becomes the latest only when
complete and verified; each tensor-parallel rank's payload is cut from the shards on first use,
once per layout, and buffers still read by a push are never overwritten."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.tp_layout import (
    ModelShape,
    apply_copies,
    full_slices,
    hf_parameter_shapes,
    reshard_plan,
    tp_parameter_shapes,
    tp_slices,
)
from rlmesh.transfer.payload import (
    DEFAULT_BUCKET_BYTES,
    PayloadError,
    bucket_checksums,
    bucket_ranges,
    corrupted_buckets,
    crc32,
    name_mismatch,
    pack_layout,
    torch_dtype,
    unpack,
    validate_manifest,
    write_bytes,
)
from rlmesh.transfer.shards import shard_views, validate_header
from rlmesh.weights.v1 import weights_pb2

FULL_LAYOUT = 0
"""The tensor-parallel size that stands for full tensors under their HF names."""
CHECKSUM_THREADS = 2
RECEIVED_MEMORY = 256
"""(version, rank) uploads remembered, so one sent again after a lost reply is recognised."""


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
    stored_at: float = 0.0
    """time.monotonic() when it became the latest version."""
    payloads: dict[tuple[int, int], RankPayload] = field(default_factory=dict)
    encodings: dict[tuple, object] = field(default_factory=dict)
    """Encoded forms of the payloads, shared by the links that send the same bytes."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total_bytes(self) -> int:
        return (
            sum(h.total_bytes for h in self.headers)
            if self.headers
            else sum(p.manifest.total_bytes for p in self.payloads.values())
        )

    def rank_payload(self, tp: int, rank: int) -> RankPayload:
        """Rank `rank`'s payload for an engine split over `tp` ranks (FULL_LAYOUT: full tensors),
        built from the FSDP shards the first time it is asked for. Blocking: call it off the loop."""
        key = (tp, rank)
        with self._lock:
            built = self.payloads.get(key)
            if built is not None:
                return built
            if self.shape is None:
                raise FailedPrecondition(
                    f"version {self.version} was uploaded as full tensors without a model layout; "
                    "tensor-parallel engines need versions uploaded with UploadShards"
                )
            builder = PayloadBuilder(
                self.shape,
                key,
                self.version,
                len(self.headers),
                self.pool,
                self.bucket_bytes,
                torch_dtype(self.headers[0].shards[0].dtype),
            )
            for header, shard in zip(self.headers, self.shards):
                builder.apply(header, shard)
            built = self.payloads[key] = builder.finish()
            return built

    def release_buffers(self) -> None:
        for header, shard in zip(self.headers, self.shards):
            self.pool.give(("shard", header.rank), shard)
        for key, built in self.payloads.items():
            self.pool.give(key, built.payload)
        self.shards, self.payloads, self.encodings = [], {}, {}


class PayloadBuilder:
    """Builds one (tp, rank) payload from FSDP shards, one FSDP rank at a time, so the copies from a
    rank's shards can run as soon as they arrive."""

    def __init__(
        self,
        shape: ModelShape,
        key: tuple[int, int],
        version: int,
        fsdp_world: int,
        pool: BufferPool,
        bucket_bytes: int,
        dtype: torch.dtype,
    ) -> None:
        tp, rank = key
        try:
            targets = tp_parameter_shapes(shape, tp) if tp != FULL_LAYOUT else hf_parameter_shapes(shape)
            slices = tp_slices(shape, tp, rank) if tp != FULL_LAYOUT else full_slices(shape)
        except ValueError as exc:
            raise InvalidArgument(f"cannot split version {version} over {tp} ranks: {exc}") from exc
        self.key = key
        self.manifest = pack_layout({name: (dims, dtype) for name, dims in targets.items()}, version, bucket_bytes)
        self.manifest.tensor_parallel_size = 0 if tp == FULL_LAYOUT else tp
        self.manifest.tensor_parallel_rank = rank
        self.payload = pool.take(key, self.manifest.total_bytes)
        self._outputs = unpack(self.manifest, self.payload)
        rows = hf_parameter_shapes(shape)
        self._copies = reshard_plan(slices, {name: dims[0] for name, dims in rows.items()}, fsdp_world)
        self._fsdp_world = fsdp_world

    def apply(self, header: weights_pb2.ShardsHeader, shard: torch.Tensor) -> None:
        """Copies what this payload needs from FSDP rank `header.rank`'s shards (blocking)."""
        mine = [c for c in self._copies if c.fsdp_rank == header.rank]
        views: list[dict[str, torch.Tensor]] = [{} for _ in range(self._fsdp_world)]
        views[header.rank] = shard_views(header, shard)
        apply_copies(mine, views, self._outputs)

    def finish(self, checksums: list[int] | None = None) -> RankPayload:
        if checksums is None:
            checksums = bucket_checksums(self.payload, self.manifest.bucket_bytes)
        self.manifest.bucket_crc32.extend(checksums)
        return RankPayload(self.manifest, self.payload)


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
    """The ranks of one version received so far, and the payloads of the layouts in use, built
    from each rank's shards as they arrive."""

    version: int
    world_size: int
    shape: ModelShape
    pool: BufferPool
    bucket_bytes: int
    headers: dict[int, weights_pb2.ShardsHeader] = field(default_factory=dict)
    shards: dict[int, torch.Tensor] = field(default_factory=dict)
    builders: dict[tuple[int, int], PayloadBuilder] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def complete(self) -> bool:
        return len(self.headers) == self.world_size

    def prepare(self, layouts: set[tuple[int, int]], dtype: torch.dtype) -> None:
        """Starts a builder for every layout in use that this model can be split into."""
        for key in layouts:
            if key not in self.builders:
                try:
                    self.builders[key] = PayloadBuilder(
                        self.shape, key, self.version, self.world_size, self.pool, self.bucket_bytes, dtype
                    )
                except InvalidArgument:
                    continue

    def apply_rank(self, rank: int) -> None:
        """Copies rank `rank`'s rows into every prepared payload (blocking; ranks may run in parallel)."""
        header, shard = self.headers[rank], self.shards[rank]
        for builder in list(self.builders.values()):
            builder.apply(header, shard)


@dataclass(slots=True)
class WeightStore:
    max_bytes: int = 64 << 30
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    latest: Snapshot | None = None
    previous: Snapshot | None = None
    """The version before the latest, kept as the base for delta-compressed pushes."""
    pool: BufferPool = field(default_factory=BufferPool)
    layouts_in_use: set[tuple[int, int]] = field(default_factory=set)
    """(tp, rank) payloads pushes asked for: built for each new version as its shards arrive."""
    _assemblies: dict[int, Assembly] = field(default_factory=dict)
    _received: OrderedDict[tuple[int, int], int] = field(default_factory=OrderedDict)
    """crc32 of each (version, rank) upload taken, oldest first."""
    _retired: list[Snapshot] = field(default_factory=list)

    # Sharded uploads --------------------------------------------------------------------------

    def earlier_upload(self, header: weights_pb2.ShardsHeader) -> tuple[int, bool] | None:
        """(ranks received, complete) if this very upload (version, rank and crc32) was already
        taken: a sender whose reply was lost sends it again, and must hear it succeeded."""
        if self._received.get((header.version, header.rank)) != header.payload_crc32:
            return None
        assembly = self._assemblies.get(header.version)
        return (len(assembly.headers), False) if assembly is not None else (header.world_size, True)

    def check_shards(self, header: weights_pb2.ShardsHeader) -> ModelShape:
        """Validates a rank's header before its bytes are read."""
        try:
            shape = validate_header(header)
        except ValueError as exc:
            raise InvalidArgument(f"shards header: {exc}") from exc
        if header.total_bytes > self.max_bytes:
            raise InvalidArgument(
                f"rank {header.rank} declares {header.total_bytes} bytes, over the limit of {self.max_bytes}"
            )
        self._check_newer(header.version)
        assembly = self._assemblies.get(header.version)
        if assembly is not None:
            if assembly.world_size != header.world_size or assembly.shape != shape:
                raise InvalidArgument(
                    f"rank {header.rank} of version {header.version} disagrees with the other ranks on the "
                    "world size or the model layout"
                )
            if header.rank in assembly.headers:
                raise InvalidArgument(f"rank {header.rank} of version {header.version} was already received")
        self._check_covers(shape, header)
        return shape

    def shard_buffer(self, header: weights_pb2.ShardsHeader) -> torch.Tensor:
        return self.pool.take(("shard", header.rank), header.total_bytes)

    def add_shards(self, header: weights_pb2.ShardsHeader, payload: torch.Tensor) -> Assembly:
        """Records a rank's bytes (already checked with `check_payload`); the version is installed
        by `install` (after `finish_assembly`) once the assembly is complete and every rank's rows are applied."""
        shape = self.check_shards(header)
        assembly = self._assemblies.get(header.version)
        if assembly is None:
            assembly = self._assemblies[header.version] = Assembly(
                header.version, header.world_size, shape, self.pool, self.bucket_bytes
            )
            assembly.prepare(self.layouts_in_use, torch_dtype(header.shards[0].dtype))
        assembly.headers[header.rank] = header
        assembly.shards[header.rank] = payload
        self._received[(header.version, header.rank)] = header.payload_crc32
        while len(self._received) > RECEIVED_MEMORY:
            self._received.popitem(last=False)
        if assembly.complete:
            del self._assemblies[header.version]
        return assembly

    def check_payload(self, header: weights_pb2.ShardsHeader, payload: torch.Tensor) -> None:
        """Raises unless the rank's bytes match its crc32 (blocking: 1 GiB takes a quarter second)."""
        if crc32(payload[: header.total_bytes].numpy()) != header.payload_crc32:
            self.pool.give(("shard", header.rank), payload)
            raise InvalidArgument(f"rank {header.rank} of version {header.version}: payload crc32 mismatch")

    def finish_assembly(self, assembly: Assembly) -> Snapshot:
        """Checksums the prepared payloads (blocking)."""
        ranks = range(assembly.world_size)
        builders = list(assembly.builders.values())
        jobs = [
            (b, start, end) for b in builders for start, end in bucket_ranges(b.manifest.total_bytes, self.bucket_bytes)
        ]
        with ThreadPoolExecutor(max_workers=CHECKSUM_THREADS) as pool:
            sums = list(pool.map(lambda job: crc32(job[0].payload.numpy()[job[1] : job[2]]), jobs))
        snapshot = Snapshot(
            assembly.version,
            assembly.shape,
            [assembly.headers[r] for r in ranks],
            [assembly.shards[r] for r in ranks],
            self.pool,
            self.bucket_bytes,
        )
        index = 0
        for builder in builders:
            count = len(bucket_ranges(builder.manifest.total_bytes, self.bucket_bytes))
            snapshot.payloads[builder.key] = builder.finish(sums[index : index + count])
            index += count
        return snapshot

    def install(self, snapshot: Snapshot) -> None:
        """Makes a finished version the latest (unless a newer one got there first)."""
        if self.latest is not None and snapshot.version <= self.latest.version:
            snapshot.release_buffers()
            raise FailedPrecondition(f"version {snapshot.version} was overtaken by {self.latest.version}")
        self._install(snapshot)
        # Older versions still assembling can never become the latest.
        for version in [v for v in self._assemblies if v < snapshot.version]:
            stale = self._assemblies.pop(version)
            for rank, shard in stale.shards.items():
                self.pool.give(("shard", rank), shard)
            for builder in stale.builders.values():
                self.pool.give(builder.key, builder.payload)

    def _check_covers(self, shape: ModelShape, header: weights_pb2.ShardsHeader) -> None:
        """Every parameter of the layout, with its full shape, in one dtype shared by every rank."""
        expected = hf_parameter_shapes(shape)
        names = {spec.name: spec for spec in header.shards}
        mismatch = name_mismatch(expected, names)
        if mismatch:
            raise InvalidArgument(
                f"version {header.version} rank {header.rank}: shards do not match the layout: {mismatch}"
            )
        for name, spec in names.items():
            if tuple(spec.full_shape) != expected[name]:
                raise InvalidArgument(
                    f"version {header.version}: {name} has shape {list(spec.full_shape)}, "
                    f"the layout says {list(expected[name])}"
                )
        dtypes = {spec.dtype for spec in header.shards}
        assembly = self._assemblies.get(header.version)
        if assembly is not None:
            dtypes |= {spec.dtype for other in assembly.headers.values() for spec in other.shards[:1]}
        if len(dtypes) != 1:
            raise InvalidArgument(f"version {header.version} mixes dtypes {sorted(dtypes)}; one dtype per version")

    # Legacy uploads of full tensors ----------------------------------------------------------

    def begin_upload(self, manifest: common_pb2.WeightManifest) -> Upload:
        try:
            validate_manifest(manifest)
        except PayloadError as exc:
            raise InvalidArgument(f"manifest: {exc}") from exc
        self._check_newer(manifest.version)
        if manifest.total_bytes > self.max_bytes:
            raise InvalidArgument(
                f"version {manifest.version} declares {manifest.total_bytes} bytes, over the limit of {self.max_bytes}"
            )
        return Upload(manifest, self.pool.take((FULL_LAYOUT, 0), manifest.total_bytes))

    def finish(self, upload: Upload) -> Snapshot:
        manifest = upload.manifest
        if upload.received != manifest.total_bytes:
            self.pool.give((FULL_LAYOUT, 0), upload.payload)
            raise InvalidArgument(
                f"upload of version {manifest.version} ended after {upload.received} of {manifest.total_bytes} bytes"
            )
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

    def drop_previous(self) -> None:
        """Lets the version before the latest go (once no push reads it): called when a newer
        version is about to be stored, which makes the latest the delta base. Holding three
        versions at once would cost a third copy of the model."""
        if self.previous is not None:
            self._retired.append(self.previous)
            self.previous = None
            self._recycle()

    def _install(self, snapshot: Snapshot) -> None:
        snapshot.stored_at = time.monotonic()
        self.drop_previous()
        if self.latest is not None:
            # Only pushes of the latest version start from now on; running ones keep theirs.
            self.latest.encodings = {}
        self.previous, self.latest = self.latest, snapshot
        self._recycle()

    def _recycle(self) -> None:
        idle = [s for s in self._retired if s.readers == 0]
        self._retired = [s for s in self._retired if s.readers > 0]
        for snapshot in idle:
            snapshot.release_buffers()
