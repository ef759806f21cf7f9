"""The rollout side of a weight push: check each payload against what its rank expects, route
bytes to the rank that owns them (straight into its standby copy), verify every bucket of every
rank and switch between two decode steps. A partially received version is never served."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.transfer.auth import UnprovenPayload
from rlmesh.transfer.base import TransferError, finish_in_thread
from rlmesh.transfer.payload import PayloadError, name_mismatch, torch_dtype, validate_manifest
from services.rollout.engine import Engine, ParameterSpec, TensorParallelEngine, WeightLayout
from services.rollout.torch.rank import RankHandle, RankPort, RankWeights

log = structlog.get_logger()

Backend = Literal["mooncake", "grpc", "tcp"]
VERIFY_TIMEOUT_SECONDS = 30.0
"""How long a commit waits for buckets still being checked."""
PAUSE_LIMIT_SECONDS = 30.0
"""In pause mode, the longest a push that neither commits nor fails holds generation."""


@dataclass(frozen=True, slots=True)
class _Pending:
    version: int
    layout: WeightLayout
    ranks: Sequence[RankHandle]
    """The ranks receiving this version: every rank, or rank 0 alone for full tensors."""


class WeightUpdater:
    """At most one version is pending; a newer Begin supersedes an uncommitted older one, and
    nothing reaches the engine's served copy before every bucket of every rank matched its
    checksum. Tensor-parallel payloads land in each rank's standby copy, bucket by bucket; full
    tensors are received by rank 0 and handed to the engine, which cuts them.

    In pause mode the engine is held from a Begin until its commit returns, whether it switched or
    failed; a Begin that supersedes a pending one keeps the hold. A push whose sender vanished
    sends nothing more, so the hold also ends `pause_limit` seconds after the last Begin: the
    instance never stays paused, and always resumes on the version it serves."""

    def __init__(
        self,
        engine: Engine,
        ranks: Sequence[RankHandle],
        backends: frozenset[Backend],
        owns_ranks: bool = False,
        verify_timeout: float = VERIFY_TIMEOUT_SECONDS,
        pause_limit: float = PAUSE_LIMIT_SECONDS,
    ) -> None:
        """`ranks[0]` receives in this process (a RankWeights); `owns_ranks`: close them with the updater."""
        self.engine = engine
        self.ranks = ranks
        self.local: RankWeights = ranks[0]
        self.backends = backends
        self.owns_ranks = owns_ranks
        self.verify_timeout = verify_timeout
        self.transfer_session = self.local.session
        self.pause_limit = pause_limit
        self._pending: _Pending | None = None
        self._busy = asyncio.Lock()
        self._hold_expiry: asyncio.Task[None] | None = None

    async def begin(
        self,
        manifest: common_pb2.WeightManifest | None,
        rank_manifests: Sequence[common_pb2.WeightManifest],
        backend: Backend,
        keep_base: bool = False,
    ) -> list[RankPort]:
        """Arms the receiving ranks; returns where each receives its payload. `keep_base`: the link
        sends deltas, so once this version is served the ranks keep a copy of it to apply the next to."""
        if self._busy.locked():
            raise FailedPrecondition("another weight update is beginning or committing; retry after it")
        async with self._busy:
            if backend not in self.backends:
                raise FailedPrecondition(
                    f"this instance offers no {backend} endpoint (offered: {', '.join(sorted(self.backends))})"
                )
            if rank_manifests:
                manifests, layout = self._check_rank_manifests(rank_manifests), WeightLayout.TENSOR_PARALLEL
            else:
                manifests, layout = [self._check_full_manifest(manifest)], WeightLayout.FULL
            version = manifests[0].version
            served = self.engine.weight_version
            if version <= served:
                raise FailedPrecondition(f"version {version} is not newer than the served version {served}")
            self._pending = None
            ranks = self.ranks[: len(manifests)]
            load = layout is WeightLayout.TENSOR_PARALLEL
            # The transfer engine's writes authenticate nothing: its commit must prove the bytes.
            proven_at_commit = backend == "mooncake"
            await self._hold()
            try:
                ports = await asyncio.gather(
                    *(
                        finish_in_thread(rank.prepare, m, load, served, keep_base, proven_at_commit)
                        for rank, m in zip(ranks, manifests)
                    )
                )
            except TransferError as exc:
                await self._release()
                raise FailedPrecondition(f"version {version}: {exc}") from exc
            except BaseException:
                await self._release()
                raise
            self._pending = _Pending(version, layout, ranks)
            self._limit_hold(version)
            log.info(
                "weight update begun", weight_version=version, layout=layout.name, ranks=len(ranks), backend=backend
            )
            return list(ports)

    async def receive(
        self, tp_rank: int, version: int, offset: int, data: bytes, compression: int, raw_bytes: int, base_version: int
    ) -> None:
        """Writes one chunk (gRPC backend) into the buffer of the rank it belongs to."""
        pending = self._require_pending(version)
        if tp_rank >= len(pending.ranks):
            raise InvalidArgument(
                f"tp_rank {tp_rank} is outside the {len(pending.ranks)} rank(s) receiving version {version}"
            )
        try:
            await finish_in_thread(
                pending.ranks[tp_rank].write, version, offset, data, compression, raw_bytes, base_version
            )
        except TransferError as exc:
            raise InvalidArgument(str(exc)) from exc

    async def commit(self, version: int, rank_proofs: Sequence[bytes] = ()) -> float:
        """Returns milliseconds spent verifying, loading and switching. `rank_proofs`: per rank, the
        proof of the bytes a Mooncake push wrote; UnprovenPayload if one does not match its buffer."""
        async with self._busy:
            pending = self._require_pending(version)
            if rank_proofs and len(rank_proofs) != len(pending.ranks):
                raise InvalidArgument(
                    f"{len(rank_proofs)} rank_proofs for the {len(pending.ranks)} rank(s) receiving version {version}"
                )
            proofs = list(rank_proofs) or [b""] * len(pending.ranks)
            started = time.perf_counter()
            await self._hold()
            try:
                try:
                    await self._load(pending, proofs)
                finally:
                    self._pending = None
                await self.engine.commit_staged(version)
            finally:
                # Switched or not, the push is over: generation resumes on whatever is served.
                await self._release()
            elapsed = (time.perf_counter() - started) * 1000
            log.info(
                "weight version committed", weight_version=version, load_ms=round(elapsed, 2), ranks=len(pending.ranks)
            )
            return elapsed

    async def _load(self, pending: _Pending, proofs: list[bytes]) -> None:
        """Checks every bucket of every rank, then makes the version the engine's staged one."""
        version, served = pending.version, self.engine.weight_version
        try:
            bad = await asyncio.gather(
                *(
                    finish_in_thread(rank.verify, version, self.verify_timeout, proof)
                    for rank, proof in zip(pending.ranks, proofs)
                )
            )
            failed = {rank: buckets for rank, buckets in enumerate(bad) if buckets}
            if failed:
                detail = "; ".join(f"rank {rank} buckets {buckets[:8]}" for rank, buckets in failed.items())
                raise FailedPrecondition(
                    f"version {version}: {detail} missing or failed their crc32 check; nothing was loaded, "
                    f"version {served} is still served"
                )
            if pending.layout is WeightLayout.TENSOR_PARALLEL:
                await asyncio.gather(*(finish_in_thread(rank.finish, version) for rank in pending.ranks))
                self.engine.mark_staged(version)
            else:
                await finish_in_thread(self.engine.stage_weights, version, self.local.tensors())
        except UnprovenPayload as exc:
            log.warning("weight commit refused: its bytes are not proven", weight_version=version, error=str(exc))
            raise UnprovenPayload(
                f"version {version}: {exc}; nothing was loaded, version {served} is still served"
            ) from exc
        except TransferError as exc:
            raise FailedPrecondition(f"version {version}: {exc}; version {served} is still served") from exc

    def close(self) -> None:
        if self._hold_expiry is not None:
            self._hold_expiry.cancel()
        if self.owns_ranks:
            for rank in self.ranks:
                rank.close()

    async def _hold(self) -> None:
        """pause mode: stops decoding (after the step in progress) until `_release`."""
        if self.engine.update_mode != "pause":
            return
        if self._hold_expiry is not None:
            self._hold_expiry.cancel()
            self._hold_expiry = None
        if not self.engine.held_for_update:
            await self.engine.hold_for_update()
            log.info("generation held for a weight update", weight_version=self.engine.weight_version)

    async def _release(self) -> None:
        if self.engine.held_for_update:
            await self.engine.release_update_hold()
            log.info("generation resumed after a weight update", weight_version=self.engine.weight_version)

    def _limit_hold(self, version: int) -> None:
        if self.engine.update_mode == "pause":
            self._hold_expiry = asyncio.create_task(self._expire_hold(version))

    async def _expire_hold(self, version: int) -> None:
        """Ends the hold of a push that neither committed nor failed within the pause limit. Runs
        between Begins and commits (under the same lock), and is cancelled by the next one."""
        await asyncio.sleep(self.pause_limit)
        async with self._busy:
            self._hold_expiry = None
            await self._release()
            log.warning(
                "weight push neither committed nor failed: generation resumed on the served version",
                weight_version=version,
                served_version=self.engine.weight_version,
                pause_limit_s=self.pause_limit,
            )

    def _check_full_manifest(self, manifest: common_pb2.WeightManifest | None) -> common_pb2.WeightManifest:
        if manifest is None:
            raise InvalidArgument("manifest or rank_manifests is required")
        _validate(manifest, "manifest")
        if manifest.tensor_parallel_size:
            raise InvalidArgument(
                f"manifest holds rank {manifest.tensor_parallel_rank} of {manifest.tensor_parallel_size} "
                "tensor-parallel ranks; full tensors go in `manifest`, rank payloads in `rank_manifests`"
            )
        _match(manifest, self.engine.parameter_specs(), "manifest")
        return manifest

    def _check_rank_manifests(self, manifests: Sequence[common_pb2.WeightManifest]) -> list[common_pb2.WeightManifest]:
        if not isinstance(self.engine, TensorParallelEngine):
            raise InvalidArgument(
                "this engine loads full tensors (WEIGHT_LAYOUT_FULL): send `manifest`, not rank_manifests"
            )
        tp = self.engine.tensor_parallel_size
        if len(manifests) != tp:
            raise InvalidArgument(f"{len(manifests)} rank manifests for {tp} tensor-parallel rank(s)")
        expected = self.engine.rank_parameter_specs()
        for rank, manifest in enumerate(manifests):
            label = f"rank {rank} manifest"
            _validate(manifest, label)
            if manifest.tensor_parallel_size and (manifest.tensor_parallel_size, manifest.tensor_parallel_rank) != (
                tp,
                rank,
            ):
                raise InvalidArgument(
                    f"{label} is the payload of rank {manifest.tensor_parallel_rank} of "
                    f"{manifest.tensor_parallel_size}, not of rank {rank} of {tp}"
                )
            _match(manifest, expected, label)
        versions = sorted({m.version for m in manifests})
        if len(versions) > 1:
            raise InvalidArgument(f"rank manifests disagree on the version: {versions}")
        return list(manifests)

    def _require_pending(self, version: int) -> _Pending:
        if self._pending is None or self._pending.version != version:
            pending = self._pending.version if self._pending else None
            raise FailedPrecondition(f"version {version} was not begun (pending: {pending})")
        return self._pending


def _validate(manifest: common_pb2.WeightManifest, label: str) -> None:
    try:
        validate_manifest(manifest)
    except PayloadError as exc:
        raise InvalidArgument(f"{label}: {exc}") from exc


def _match(manifest: common_pb2.WeightManifest, specs: list[ParameterSpec], label: str) -> None:
    """Raises InvalidArgument unless the payload carries exactly these tensors (names, shapes, dtypes)."""
    expected = {spec.name: spec for spec in specs}
    offered = {spec.name: spec for spec in manifest.tensors}
    mismatch = name_mismatch(expected, offered)
    if mismatch:
        raise InvalidArgument(f"{label}: tensors do not match the model: {mismatch}")
    for name, spec in offered.items():
        want = expected[name]
        if tuple(spec.shape) != want.shape or torch_dtype(spec.dtype) != want.dtype:
            raise InvalidArgument(
                f"{label}: {name} is {list(spec.shape)} {torch_dtype(spec.dtype)}, the model expects "
                f"{list(want.shape)} {want.dtype}"
            )
