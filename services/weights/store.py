"""Host-memory store of weight versions: an upload fills a spare buffer and becomes the latest
only when complete and verified; buffers still read by a push are never overwritten."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.payload import PayloadError, corrupted_buckets, validate_manifest, write_bytes


@dataclass(eq=False, slots=True)
class Snapshot:
    """One complete version; `readers` counts pushes still reading its payload."""

    manifest: common_pb2.WeightManifest
    payload: torch.Tensor
    readers: int = 0

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(eq=False, slots=True)
class Upload:
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
class WeightStore:
    max_bytes: int = 64 << 30
    latest: Snapshot | None = None
    _spares: list[torch.Tensor] = field(default_factory=list)
    _retired: list[Snapshot] = field(default_factory=list)

    def begin_upload(self, manifest: common_pb2.WeightManifest) -> Upload:
        try:
            validate_manifest(manifest)
        except PayloadError as exc:
            raise InvalidArgument(f"manifest: {exc}") from exc
        if self.latest is not None and manifest.version <= self.latest.version:
            raise FailedPrecondition(f"version {manifest.version} is not newer than the stored version {self.latest.version}")
        if manifest.total_bytes > self.max_bytes:
            raise InvalidArgument(f"version {manifest.version} declares {manifest.total_bytes} bytes, over the limit of {self.max_bytes}")
        return Upload(manifest, self._buffer(manifest.total_bytes))

    def finish(self, upload: Upload) -> Snapshot:
        manifest = upload.manifest
        if upload.received != manifest.total_bytes:
            self._spares.append(upload.payload)
            raise InvalidArgument(f"upload of version {manifest.version} ended after {upload.received} of {manifest.total_bytes} bytes")
        bad = corrupted_buckets(manifest, upload.payload)
        if bad:
            self._spares.append(upload.payload)
            raise InvalidArgument(f"version {manifest.version}: buckets {bad[:8]} failed their crc32 check")
        if self.latest is not None and manifest.version <= self.latest.version:
            self._spares.append(upload.payload)
            raise FailedPrecondition(f"version {manifest.version} was overtaken by {self.latest.version}")
        if self.latest is not None:
            self._retired.append(self.latest)
        self.latest = Snapshot(manifest, upload.payload)
        self._recycle()
        return self.latest

    def acquire(self) -> Snapshot | None:
        if self.latest is not None:
            self.latest.readers += 1
        return self.latest

    def release(self, snapshot: Snapshot) -> None:
        snapshot.readers -= 1
        self._recycle()

    def _recycle(self) -> None:
        idle = [s for s in self._retired if s.readers == 0]
        self._retired = [s for s in self._retired if s.readers > 0]
        self._spares.extend(s.payload for s in idle)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        for index, spare in enumerate(self._spares):
            if spare.numel() >= nbytes:
                return self._spares.pop(index)[:nbytes]
        # Touch every page now so the transfers that fill it later do not pay the faults.
        return torch.zeros(nbytes, dtype=torch.uint8)
