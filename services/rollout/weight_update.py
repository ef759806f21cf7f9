"""The rollout side of a weight push: validate the manifest, receive into the standby buffer,
verify every bucket, stage into the standby model and switch between decode steps."""

from __future__ import annotations

import asyncio
import time

import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.payload import PayloadError, corrupted_buckets, torch_dtype, unpack, validate_manifest
from rlmesh.transfer.base import ReceiveBuffer, TransferError, finish_in_thread
from services.rollout.engine import Engine

log = structlog.get_logger()


class WeightUpdater:
    """At most one version is pending; a newer Begin supersedes an uncommitted older one, and
    nothing reaches the engine before every bucket's checksum matched."""

    def __init__(self, engine: Engine, buffer: ReceiveBuffer, transfer_session: str = "") -> None:
        self.engine = engine
        self.buffer = buffer
        self.transfer_session = transfer_session
        self._pending: common_pb2.WeightManifest | None = None
        self._received = 0
        self._lock = asyncio.Lock()

    def begin(self, manifest: common_pb2.WeightManifest, mooncake: bool) -> tuple[str, int, int]:
        if self._lock.locked():
            raise FailedPrecondition("a commit is in progress; retry after it")
        try:
            validate_manifest(manifest)
        except PayloadError as exc:
            raise InvalidArgument(f"manifest: {exc}") from exc
        if manifest.version <= self.engine.weight_version:
            raise FailedPrecondition(
                f"version {manifest.version} is not newer than the served version {self.engine.weight_version}"
            )
        expected = {spec.name: spec for spec in self.engine.parameter_specs()}
        offered = {spec.name: spec for spec in manifest.tensors}
        if expected.keys() != offered.keys():
            missing = sorted(expected.keys() - offered.keys())[:5]
            unknown = sorted(offered.keys() - expected.keys())[:5]
            raise InvalidArgument(f"manifest tensors do not match the model: missing {missing}, unknown {unknown}")
        for name, spec in offered.items():
            want = expected[name]
            if tuple(spec.shape) != want.shape or torch_dtype(spec.dtype) != want.dtype:
                raise InvalidArgument(
                    f"{name}: {list(spec.shape)} {torch_dtype(spec.dtype)} does not match the model's {list(want.shape)} {want.dtype}"
                )
        if mooncake and not self.transfer_session:
            raise FailedPrecondition("this instance runs no Mooncake endpoint; use the gRPC backend")
        self.buffer.ensure(manifest.total_bytes)
        self._pending = manifest
        self._received = 0
        return (self.transfer_session if mooncake else "", self.buffer.address if mooncake else 0, self.buffer.tensor.numel())

    def receive(self, version: int, offset: int, data: bytes) -> int:
        pending = self._require_pending(version)
        try:
            self.buffer.write(offset, data, pending.total_bytes)
        except TransferError as exc:
            raise InvalidArgument(str(exc)) from exc
        self._received += len(data)
        return self._received

    async def commit(self, version: int) -> float:
        """Returns milliseconds spent verifying and loading."""
        async with self._lock:
            manifest = self._require_pending(version)
            started = time.perf_counter()
            bad = await finish_in_thread(corrupted_buckets, manifest, self.buffer.tensor)
            if bad:
                self._pending = None
                raise FailedPrecondition(f"version {version}: buckets {bad[:8]} failed their crc32 check; nothing was loaded")
            tensors = unpack(manifest, self.buffer.tensor)
            await finish_in_thread(self.engine.stage_weights, version, tensors)
            await self.engine.commit_staged(version)
            self._pending = None
            elapsed = (time.perf_counter() - started) * 1000
            log.info("weight version committed", weight_version=version, load_ms=round(elapsed, 2))
            return elapsed

    def _require_pending(self, version: int) -> common_pb2.WeightManifest:
        if self._pending is None or self._pending.version != version:
            pending = self._pending.version if self._pending else None
            raise FailedPrecondition(f"version {version} was not begun (pending: {pending})")
        return self._pending
