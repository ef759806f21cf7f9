"""The receiving end of one tensor-parallel rank's weight payload: the pre-faulted buffer each
version lands in, which every backend fills, decoding of compressed buckets, a crc32 check of each
bucket as it lands (and, for a push proven at commit, its tag under the push session), and the
version whose exact bytes the buffer holds (a delta's base)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.transfer.auth import PushSession, UnprovenPayload
from rlmesh.transfer.base import ReceiveBuffer, TransferError, background_thread
from rlmesh.transfer.codecs import BucketCodec
from rlmesh.transfer.payload import PayloadError, bucket_ranges, crc32, torch_dtype, unpack, validate_manifest

MODE_OF_CODE = {
    common_pb2.COMPRESSION_UNSPECIFIED: "none",
    common_pb2.COMPRESSION_NONE: "none",
    common_pb2.COMPRESSION_ZSTD: "zstd",
    common_pb2.COMPRESSION_DELTA: "delta",
    common_pb2.COMPRESSION_INT8: "int8",
    common_pb2.COMPRESSION_FP8: "fp8",
}
CODE_OF_MODE = {mode: code for code, mode in MODE_OF_CODE.items() if code != common_pb2.COMPRESSION_UNSPECIFIED}


def payload_dtype(manifest: common_pb2.WeightManifest) -> torch.dtype:
    """The one element type of a payload's tensors (codecs work per element size)."""
    dtypes = {spec.dtype for spec in manifest.tensors}
    if len(dtypes) > 1:
        raise PayloadError(f"payload mixes dtypes {sorted(dtypes)}; one dtype per payload")
    return torch_dtype(dtypes.pop()) if dtypes else torch.float32


class RankReceiver:
    """Receives one version at a time into a buffer the caller names for each version (a rollout
    rank's standby model copy, whose parameters are views into it).

    Each bucket is checked once all its bytes landed: by the backend's thread when it says so
    (TCP, compressed buckets), else on a verifier thread, so checking overlaps receiving. A
    failed or abandoned transfer leaves `held_version` at -1: the buffer then holds no version."""

    def __init__(self, rank: int, accept_lossy: bool = False, background: bool = False) -> None:
        """`background`: check (and, through a TcpListener, receive) on idle-class threads."""
        self.rank = rank
        self.accept_lossy = accept_lossy
        self.background = background
        self.buffer: ReceiveBuffer | None = None
        self.held_version = -1
        """The version whose bytes `buffer` holds, all checked; -1 while none (or one in flight)."""
        self.session: PushSession | None = None
        """The push session of the version being received: only its holder may write."""
        self._tags: list[bytes] | None = None
        """Each checked bucket's tag under the session, when its commit must prove the bytes."""
        self._base = -1
        self._lock = threading.Lock()
        self._manifest: common_pb2.WeightManifest | None = None
        self._ranges: list[tuple[int, int]] = []
        self._written: list[int] = []
        self._verified: list[bool] = []
        self._bad: set[int] = set()
        self._codecs: dict[str, BucketCodec] = {}
        self._checks: queue.Queue[tuple[common_pb2.WeightManifest, int] | None] = queue.Queue()
        self._all_checked = threading.Condition(self._lock)
        self._verifier = threading.Thread(target=self._verify_loop, name=f"verify-rank{rank}", daemon=True)
        self._verifier.start()

    @property
    def manifest(self) -> common_pb2.WeightManifest | None:
        return self._manifest

    def prepare(
        self,
        manifest: common_pb2.WeightManifest,
        buffer: ReceiveBuffer,
        base_version: int,
        secret: bytes,
        proven_at_commit: bool = False,
    ) -> None:
        """Arms `buffer` (at least the payload's size) for a version validated by the caller
        against the model; `base_version` is the version the buffer holds, which a delta may be
        applied to (-1: none). From here until the version is verified the buffer holds none.
        `secret`: the push session's, which writers must prove; `proven_at_commit`: a transfer
        engine writes the buffer (open to it until the commit) and the commit proves the bytes."""
        try:
            validate_manifest(manifest)
            dtype = payload_dtype(manifest)
        except PayloadError as exc:
            raise TransferError(f"rank {self.rank} manifest: {exc}") from exc
        if buffer.tensor.numel() < manifest.total_bytes:
            raise TransferError(
                f"rank {self.rank}: a {buffer.tensor.numel()}-byte buffer cannot hold {manifest.total_bytes} bytes"
            )
        session = PushSession(secret, manifest.version, self.rank)
        ranges = bucket_ranges(manifest.total_bytes, manifest.bucket_bytes)
        with self._lock:
            if self.buffer is not None:
                self.buffer.close_writes()
            if proven_at_commit:
                buffer.open_writes()
            self.buffer, self.session = buffer, session
            self._tags = [b""] * len(ranges) if proven_at_commit else None
            self._base, self.held_version = base_version, -1
            self._manifest = manifest
            self._dtype = dtype
            self._ranges = ranges
            self._written = [0] * len(self._ranges)
            self._verified = [False] * len(self._ranges)
            self._bad = set()

    def progress(self) -> tuple[int, int]:
        """(buckets of the version being received that landed and passed their check, all its buckets)."""
        with self._lock:
            return sum(self._verified) - len(self._bad), len(self._verified)

    def write(
        self,
        version: int,
        offset: int,
        data: bytes | memoryview,
        compression: int = common_pb2.COMPRESSION_NONE,
        raw_bytes: int = 0,
        base_version: int = -1,
    ) -> None:
        """Places (and decodes) bytes at `offset`. Compressed data must be one whole bucket."""
        mode = MODE_OF_CODE.get(compression)
        if mode is None:
            raise TransferError(f"unknown compression {compression}")
        raw_bytes = raw_bytes or len(data)
        manifest, target = self._region(version, offset, raw_bytes)
        if mode == "none":
            if len(data) != raw_bytes:
                raise TransferError(f"raw chunk of {len(data)} bytes declares {raw_bytes}")
            target[:] = np.frombuffer(data, dtype=np.uint8)
            self.landed(version, offset, raw_bytes)
        else:
            self._decode(mode, manifest, offset, raw_bytes, data, target, base_version)
            # Checked at once, while the decoded bucket is still in the CPU cache: a second pass
            # from memory would cost as much as the decoding of a sparse delta.
            self.landed(version, offset, raw_bytes, check_now=True)

    def view(self, version: int, offset: int, nbytes: int) -> memoryview:
        """Where raw bytes of a bucket go, for backends that write straight into the buffer."""
        return memoryview(self._region(version, offset, nbytes)[1])

    def _region(self, version: int, offset: int, nbytes: int) -> tuple[common_pb2.WeightManifest, np.ndarray]:
        manifest = self._expect(version)
        if offset < 0 or offset + nbytes > manifest.total_bytes:
            raise TransferError(
                f"bytes [{offset}, {offset + nbytes}) are outside the payload of {manifest.total_bytes} bytes"
            )
        assert self.buffer is not None
        return manifest, self.buffer.tensor.numpy()[offset : offset + nbytes]

    def landed(self, version: int, offset: int, nbytes: int, check_now: bool = False) -> None:
        """Counts bytes written at `offset`; a bucket whose bytes are all there is checked, on the
        verifier thread or, with `check_now`, on the calling one."""
        manifest = self._expect(version)
        bucket = offset // manifest.bucket_bytes
        start, end = self._ranges[bucket]
        if offset + nbytes > end:
            raise TransferError(f"bytes [{offset}, {offset + nbytes}) cross the end of bucket {bucket} at {end}")
        with self._lock:
            self._written[bucket] += nbytes
            full = self._written[bucket] == end - start
        if full and check_now:
            self._check(manifest, bucket)
        elif full:
            self._checks.put((manifest, bucket))

    def wait_verified(self, version: int, timeout: float, proof: bytes = b"") -> list[int]:
        """Blocks until every bucket was checked; returns the buckets that are missing or bad.
        Backends that write without telling (Mooncake) are checked here in full, after their
        engine lost access to the buffer, and `proof` (the commit's) must match their tags, else
        UnprovenPayload."""
        manifest = self._expect(version)
        with self._lock:
            if self._tags is not None and self.buffer is not None:
                self.buffer.close_writes()
            unannounced = [i for i, written in enumerate(self._written) if written == 0]
            # A bucket written in part (or twice) never gets its check: it is bad now, not after the timeout.
            for bucket, (start, end) in enumerate(self._ranges):
                if self._written[bucket] not in (0, end - start) and not self._verified[bucket]:
                    self._verified[bucket] = True
                    self._bad.add(bucket)
        for bucket in unannounced:
            start, end = self._ranges[bucket]
            self.landed(version, start, end - start)
        with self._all_checked:
            if not self._all_checked.wait_for(lambda: all(self._verified) or self._manifest is not manifest, timeout):
                raise TransferError(f"rank {self.rank}: buckets of version {version} still unchecked after {timeout} s")
            if self._manifest is not manifest:
                raise TransferError(f"rank {self.rank}: version {version} was superseded while it was checked")
            bad = sorted(self._bad)
            session, tags = self.session, self._tags
            if not bad and tags is not None and session is not None and not session.proves(tags, proof):
                if not proof:
                    raise UnprovenPayload(
                        f"rank {self.rank}: the commit carries no proof of the bytes this push wrote; "
                        "Mooncake pushes send one per rank (CommitWeightUpdateRequest.rank_proofs)"
                    )
                raise UnprovenPayload(
                    f"rank {self.rank}: the commit's proof does not match the bytes in the standby buffer: "
                    "they are not all the push session's"
                )
            self.held_version = manifest.version if not bad else -1
            return bad

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held version's tensors, as views into the buffer."""
        if self._manifest is None or self.buffer is None:
            raise TransferError(f"rank {self.rank} holds no payload")
        return unpack(self._manifest, self.buffer.tensor)

    def _expect(self, version: int) -> common_pb2.WeightManifest:
        manifest = self._manifest
        if manifest is None or manifest.version != version:
            raise TransferError(
                f"rank {self.rank} expects version {manifest.version if manifest else None}, not {version}"
            )
        return manifest

    def _decode(
        self,
        mode: str,
        manifest: common_pb2.WeightManifest,
        offset: int,
        raw_bytes: int,
        data: bytes | memoryview,
        target: np.ndarray,
        base_version: int,
    ) -> None:
        if mode in ("int8", "fp8") and not self.accept_lossy:
            raise TransferError(f"{mode} is lossy and this engine does not serve quantized weights")
        if offset % manifest.bucket_bytes:
            raise TransferError(f"compressed data must start at a bucket boundary, not at {offset}")
        previous = None
        if mode == "delta":
            if base_version < 0 or base_version != self._base:
                raise TransferError(f"delta against version {base_version}, but rank {self.rank} held {self._base}")
            # XOR in place: the buffer's bytes of the base become those of the new version.
            previous = target
        codec = self._codecs.get(mode)
        if codec is None:
            codec = self._codecs[mode] = BucketCodec(mode, self._dtype)
        try:
            codec.decode(data, target, previous)
        except ValueError as exc:
            raise TransferError(f"rank {self.rank}: bucket at {offset}: {exc}") from exc

    def _verify_loop(self) -> None:
        if self.background:
            background_thread()
        while True:
            item = self._checks.get()
            if item is None:
                return
            self._check(*item)

    def _check(self, manifest: common_pb2.WeightManifest, bucket: int) -> None:
        with self._lock:
            current, buffer, session, tags = manifest is self._manifest, self.buffer, self.session, self._tags
        good = False
        if current and buffer is not None:
            start, end = self._ranges[bucket]
            data = buffer.tensor.numpy()[start:end]
            good = crc32(data) == manifest.bucket_crc32[bucket]
            if good and tags is not None and session is not None:
                tags[bucket] = session.bucket_tag(bucket, memoryview(data))
        with self._all_checked:
            if manifest is not self._manifest:
                return
            self._verified[bucket] = True
            if not good:
                self._bad.add(bucket)
            self._all_checked.notify_all()

    def close(self) -> None:
        self._checks.put(None)
