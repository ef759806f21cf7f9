"""A rank payload encoded for one link mode, bucket by bucket on a thread of its own: sending starts
with the first encoded bucket (encode and send overlap), and every instance that needs the same
bytes (same version, layout, rank, mode and delta base) reuses the same encoding."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial

import numpy as np

from rlmesh.common.v1 import common_pb2
from rlmesh.transfer.base import Frame
from rlmesh.transfer.codecs import BucketCodec, CompressionMode, CompressionReport
from rlmesh.transfer.payload import bucket_ranges, crc32
from rlmesh.transfer.receiver import CODE_OF_MODE, payload_dtype
from services.weights.store import RankPayload


class EncodedPayload:
    """Encodes lazily on first use; readers iterate `frames()` and wait only for buckets not yet
    encoded. `base` is the same rank's payload of the version the receiver holds (delta)."""

    def __init__(
        self, rank: RankPayload, mode: CompressionMode, base: RankPayload | None = None, base_version: int = -1
    ) -> None:
        if mode == "delta" and base is None:
            raise ValueError("a delta encoding needs the base version's payload")
        self.rank = rank
        self.mode = mode
        self.base = base
        self.base_version = base_version if mode == "delta" else -1
        self.code = CODE_OF_MODE[mode]
        self.report = CompressionReport(mode)
        self._codec = BucketCodec(mode, payload_dtype(rank.manifest))
        self._ranges = bucket_ranges(rank.manifest.total_bytes, rank.manifest.bucket_bytes)
        self._blobs: list[bytes] = []
        self._decoded_crc32: list[int] = []
        self._error: Exception | None = None
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def _encode_all(self) -> None:
        data = self.rank.payload.numpy()
        previous = self.base.payload.numpy() if self.base is not None else None
        try:
            for start, end in self._ranges:
                started = time.perf_counter()
                bucket = self._codec.encode(data[start:end], previous[start:end] if previous is not None else None)
                if not self._codec.lossless:
                    self._decoded_crc32.append(self._crc_of_decoded(bucket.data, end - start))
                with self._ready:
                    self.report.add(bucket, time.perf_counter() - started)
                    self._blobs.append(bucket.data)
                    self._ready.notify_all()
        except Exception as exc:  # handed to every reader, which raises it in its own thread
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def _crc_of_decoded(self, blob: bytes, nbytes: int) -> int:
        scratch = np.empty(nbytes, dtype=np.uint8)
        self._codec.decode(blob, scratch)
        return crc32(scratch)

    def lossy_manifest(self) -> common_pb2.WeightManifest:
        """The manifest with each bucket's crc32 of what the receiver will decode (lossy modes
        change the bytes, and decoding is deterministic). Waits for the whole encoding."""
        self.wait()
        manifest = common_pb2.WeightManifest()
        manifest.CopyFrom(self.rank.manifest)
        del manifest.bucket_crc32[:]
        manifest.bucket_crc32.extend(self._decoded_crc32)
        return manifest

    def start(self) -> None:
        """Starts encoding, if not yet started."""
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._encode_all, name=f"encode-v{self.rank.manifest.version}", daemon=True
                )
                self._thread.start()

    def wait(self) -> None:
        """Blocks until every bucket is encoded."""
        for _ in self.frames():
            pass

    def _encoded_or_failed(self, index: int) -> bool:
        """Whether bucket `index` is encoded, or the encoding failed (called holding `_ready`)."""
        return len(self._blobs) > index or self._error is not None

    def frames(self) -> Iterator[Frame]:
        self.start()
        for index, (start, end) in enumerate(self._ranges):
            with self._ready:
                self._ready.wait_for(partial(self._encoded_or_failed, index))
                if len(self._blobs) <= index:
                    raise RuntimeError(f"encoding version {self.rank.manifest.version} failed: {self._error}")
                blob = self._blobs[index]
            yield start, end - start, self.code, self.base_version, blob
