"""Per-link compression of weight payload buckets: the weights service encodes each bucket before
sending it and the rollout instance decodes it into its receive buffer.

Blob format (one per bucket, little-endian): a 12-byte header `<BBHQ>` = tag, element size in
bytes, quantization block in elements (0 unless quantized), raw bucket length in bytes; then the
body, by tag:
  0 RAW    the bucket's bytes as they are (used by "none", and by any mode whenever encoding would
           not make the bucket smaller; for delta these are the new bytes, not the XOR).
  1 ZSTD   zstd frame of the byte planes: all most significant bytes of the elements, then the
           next bytes, ..., then any trailing bytes that do not fill an element.
  2 DELTA  like ZSTD, of (bucket XOR the same bucket of the base version).
  3 INT8   float32 scale per block (absmax / 127), then one int8 code per element.
  4 FP8    float32 scale per block (absmax / 448), then one float8_e4m3fn code per element.
  5 SPARSE for delta when few elements changed: the changed elements' indices in the bucket
           (uint32, ascending), then their new values. Decoding writes only those elements, so
           it costs what the change costs, not what the bucket does; encoding skips zstd.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, field
from typing import get_args

import numpy as np
import torch
import zstandard

from rlmesh.settings.weights import CompressionMode

COMPRESSION_MODES: tuple[CompressionMode, ...] = get_args(CompressionMode)

HEADER = struct.Struct("<BBHQ")
"""tag, element size, quantization block, raw bytes: the first bytes of every blob."""

_RAW, _ZSTD, _DELTA, _INT8, _FP8, _SPARSE = range(6)
_TAG_NAMES = {_RAW: "raw", _ZSTD: "zstd", _DELTA: "delta", _INT8: "int8", _FP8: "fp8", _SPARSE: "sparse"}
_ENCODED_TAG = {"zstd": _ZSTD, "delta": _DELTA, "int8": _INT8, "fp8": _FP8}
# A full version on a delta link is zstd-encoded, so one delta codec per link decodes both.
_DECODABLE_TAGS: dict[CompressionMode, frozenset[int]] = {
    "none": frozenset({_RAW}),
    "zstd": frozenset({_RAW, _ZSTD}),
    "delta": frozenset({_RAW, _ZSTD, _DELTA, _SPARSE}),
    "int8": frozenset({_RAW, _INT8}),
    "fp8": frozenset({_RAW, _FP8}),
}
_QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODE_LIMIT = {"int8": 127.0, "fp8": torch.finfo(torch.float8_e4m3fn).max}
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
"""float32 value of each fp8 bit pattern: a table lookup is ~4x faster than torch's conversion."""
_WORD_TYPES = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_MIN_ZSTD_LEVEL = -(1 << 17)
"""ZSTD_minCLevel(): negative levels trade ratio for speed; zstandard does not export the bound."""
SPARSE_MAX_FRACTION = 0.05
"""A delta bucket goes sparse when at most this fraction of its elements changed: 2 % changed bf16
then costs 6 % of the bucket on the wire, and encoding it runs ~10x faster than XOR + zstd."""


@dataclass(frozen=True, slots=True)
class EncodedBucket:
    """One encoded bucket and, for lossy modes, its error, kept as sums so that a relative RMS
    over many buckets can be aggregated."""

    data: bytes
    """The blob to send (header and body)."""
    raw_bytes: int
    """Length of the bucket before encoding."""
    max_abs_error: float = 0.0
    """Largest |decoded - original| over the bucket's elements, in the payload dtype."""
    sq_error: float = 0.0
    """Sum over elements of (decoded - original)^2."""
    sq_value: float = 0.0
    """Sum over elements of original^2 (lossy modes only)."""


@dataclass(frozen=True, slots=True)
class BucketCodec:
    """Encodes and decodes buckets of one payload dtype in one mode. Safe to share between
    threads: each thread gets its own zstd contexts."""

    mode: CompressionMode
    dtype: torch.dtype
    """The dtype of every tensor in the payload: the element size for the byte planes, and what
    quantized values decode back to."""
    level: int = 1
    """zstd compression level."""
    block: int = 128
    """Elements sharing one scale in int8 / fp8."""
    _contexts: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in COMPRESSION_MODES:
            raise ValueError(f"unknown compression mode {self.mode!r}; expected one of {', '.join(COMPRESSION_MODES)}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype.itemsize not in (1, *_WORD_TYPES):
            raise ValueError(f"dtype must be a torch dtype of 1, 2, 4 or 8 bytes, got {self.dtype!r}")
        if not self.lossless and self.dtype not in _QUANTIZABLE_DTYPES:
            raise ValueError(f"{self.mode} quantization needs a float32, bfloat16 or float16 payload, got {self.dtype}")
        if not _MIN_ZSTD_LEVEL <= self.level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(
                f"zstd level must be in [{_MIN_ZSTD_LEVEL}, {zstandard.MAX_COMPRESSION_LEVEL}], got {self.level}"
            )
        if not 1 <= self.block <= 0xFFFF:
            raise ValueError(f"quantization block must be in [1, 65535] elements, got {self.block}")

    @property
    def lossless(self) -> bool:
        return self.mode in ("none", "zstd", "delta")

    def encode(self, raw: np.ndarray, previous: np.ndarray | None = None) -> EncodedBucket:
        """Encodes one bucket. raw: 1-D uint8 bytes of the bucket; previous: the same bucket of
        the version the receiver holds (delta only, same length)."""
        raw = _bucket_bytes(raw, "raw")
        if self.mode == "delta":
            if previous is None:
                raise ValueError(
                    "delta encoding needs `previous`, the same bucket of the receiver's version "
                    "(send a full version with the zstd codec)"
                )
            previous = _bucket_bytes(previous, "previous")
            if previous.size != raw.size:
                raise ValueError(f"previous bucket has {previous.size} bytes, raw has {raw.size}")
        if self.mode == "none" or raw.size == 0:
            return EncodedBucket(self._raw_blob(raw), raw.size)
        if self.mode == "zstd":
            return self._smaller_of(raw, _ZSTD, self._compressor().compress(_split_planes(raw, self.dtype.itemsize)))
        if self.mode == "delta":
            sparse = self._sparse_body(raw, previous)
            if sparse is not None:
                return self._smaller_of(raw, _SPARSE, sparse)
            xor = np.bitwise_xor(raw, previous)
            return self._smaller_of(raw, _DELTA, self._compressor().compress(_split_planes(xor, self.dtype.itemsize)))
        return self._quantize(raw)

    def decode(self, blob: bytes | memoryview, out: np.ndarray, previous: np.ndarray | None = None) -> None:
        """Writes the bucket's bytes into out (1-D uint8, the bucket's length). For delta blobs,
        previous holds the base version's bucket and may be out itself (decoding in place)."""
        out = _bucket_bytes(out, "out")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
        blob = memoryview(blob).cast("B")
        if len(blob) < HEADER.size:
            raise ValueError(f"corrupt header: blob has {len(blob)} bytes, the header alone is {HEADER.size}")
        tag, element_size, block, raw_bytes = HEADER.unpack_from(blob)
        if tag not in _TAG_NAMES:
            raise ValueError(f"corrupt header: unknown tag {tag}")
        if tag not in _DECODABLE_TAGS[self.mode]:
            raise ValueError(f"blob is {_TAG_NAMES[tag]}-encoded but this codec decodes {self.mode}")
        if raw_bytes != out.size:
            raise ValueError(f"blob is for a {raw_bytes}-byte bucket but out has {out.size} bytes")
        if tag != _RAW and element_size != self.dtype.itemsize:
            raise ValueError(
                f"blob was encoded for {element_size}-byte elements, "
                f"this codec's dtype {self.dtype} has {self.dtype.itemsize}"
            )
        body = blob[HEADER.size :]
        if tag == _RAW:
            if len(body) != raw_bytes:
                raise ValueError(f"corrupt blob: raw body has {len(body)} bytes, header says {raw_bytes}")
            out[:] = np.frombuffer(body, dtype=np.uint8)
        elif tag == _ZSTD:
            _join_planes(self._decompress(body, raw_bytes), self.dtype.itemsize, out)
        elif tag == _DELTA:
            if previous is None:
                raise ValueError("blob is a delta: decoding needs `previous`, the same bucket of the base version")
            previous = _bucket_bytes(previous, "previous")
            if previous.size != raw_bytes:
                raise ValueError(f"previous bucket has {previous.size} bytes, blob is for {raw_bytes}")
            xor = np.empty(raw_bytes, dtype=np.uint8)
            _join_planes(self._decompress(body, raw_bytes), self.dtype.itemsize, xor)
            np.bitwise_xor(previous, xor, out=out)
        elif tag == _SPARSE:
            if previous is None:
                raise ValueError(
                    "blob is a sparse delta: decoding needs `previous`, the same bucket of the base version"
                )
            self._apply_sparse(body, _bucket_bytes(previous, "previous"), out)
        else:
            if block != self.block:
                raise ValueError(f"blob was quantized in blocks of {block} elements, this codec uses {self.block}")
            self._dequantize(body, raw_bytes, out)

    def _sparse_body(self, raw: np.ndarray, previous: np.ndarray) -> bytes | None:
        """Indices and new values of the changed elements, or None when too many changed."""
        size = self.dtype.itemsize
        count = raw.size // size
        if size == 1 or raw.size % size or count > 0xFFFFFFFF:
            return None
        words, base = raw.view(_WORD_TYPES[size]), previous.view(_WORD_TYPES[size])
        changed = np.flatnonzero(np.not_equal(words, base))
        if changed.size > SPARSE_MAX_FRACTION * count:
            return None
        return b"".join((changed.astype(np.uint32).tobytes(), words[changed].tobytes()))

    def _apply_sparse(self, body: memoryview, previous: np.ndarray, out: np.ndarray) -> None:
        size = self.dtype.itemsize
        if len(body) % (4 + size) or out.size % size:
            raise ValueError(
                f"corrupt blob: sparse body of {len(body)} bytes is not whole (index, value) pairs of {4 + size} bytes"
            )
        if previous.size != out.size:
            raise ValueError(f"previous bucket has {previous.size} bytes, blob is for {out.size}")
        count = len(body) // (4 + size)
        if previous.ctypes.data != out.ctypes.data:
            out[:] = previous
        try:
            np.put(
                out.view(_WORD_TYPES[size]),
                np.frombuffer(body, dtype=np.uint32, count=count),
                np.frombuffer(body, dtype=_WORD_TYPES[size], offset=4 * count),
            )
        except IndexError as error:
            raise ValueError(f"corrupt blob: {error}") from error

    def _raw_blob(self, raw: np.ndarray) -> bytes:
        return b"".join((HEADER.pack(_RAW, self.dtype.itemsize, 0, raw.size), memoryview(raw)))

    def _smaller_of(self, raw: np.ndarray, tag: int, body: bytes, **errors: float) -> EncodedBucket:
        if len(body) >= raw.size:
            return EncodedBucket(self._raw_blob(raw), raw.size, sq_value=errors.get("sq_value", 0.0))
        block = self.block if tag in (_INT8, _FP8) else 0
        return EncodedBucket(HEADER.pack(tag, self.dtype.itemsize, block, raw.size) + body, raw.size, **errors)

    def _quantize(self, raw: np.ndarray) -> EncodedBucket:
        if raw.size % self.dtype.itemsize:
            raise ValueError(f"bucket of {raw.size} bytes is not a whole number of {self.dtype} elements")
        # torch.from_numpy warns on read-only arrays (e.g. views of received bytes).
        values = torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(self.dtype).float()
        blocks = _padded_blocks(values, self.block)
        scales = blocks.abs().amax(dim=1) / _CODE_LIMIT[self.mode]
        if not torch.isfinite(scales).all():
            raise ValueError(f"bucket holds inf or NaN values: {self.mode} quantization needs finite weights")
        scaled = blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(1)
        if self.mode == "int8":
            codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
        else:
            # Out-of-range values would become NaN in float8_e4m3fn; division rounding can overshoot by an ulp.
            codes = scaled.clamp_(-_CODE_LIMIT["fp8"], _CODE_LIMIT["fp8"]).to(torch.float8_e4m3fn)
        codes = codes.view(-1)[: values.numel()]
        decoded = _scaled_codes(codes, scales, self.block).to(self.dtype).float()
        error = decoded - values
        body = b"".join((scales.numpy().tobytes(), codes.view(torch.uint8).numpy().tobytes()))
        return self._smaller_of(
            raw,
            _ENCODED_TAG[self.mode],
            body,
            max_abs_error=error.abs().max().item(),
            sq_error=torch.dot(error, error).item(),
            sq_value=torch.dot(values, values).item(),
        )

    def _dequantize(self, body: memoryview, raw_bytes: int, out: np.ndarray) -> None:
        if raw_bytes % self.dtype.itemsize:
            raise ValueError(f"corrupt header: {raw_bytes} bytes is not a whole number of {self.dtype} elements")
        count = raw_bytes // self.dtype.itemsize
        block_count = math.ceil(count / self.block)
        if len(body) != 4 * block_count + count:
            raise ValueError(
                f"corrupt blob: quantized body has {len(body)} bytes, "
                f"expected {4 * block_count + count} for {count} elements"
            )
        # One copy makes the body writable and aligned, as torch needs.
        body_bytes = torch.from_numpy(np.frombuffer(body, dtype=np.uint8).copy())
        scales = body_bytes[: 4 * block_count].view(torch.float32)
        codes = body_bytes[4 * block_count :].view(torch.int8 if self.mode == "int8" else torch.float8_e4m3fn)
        torch.from_numpy(out).view(self.dtype).copy_(_scaled_codes(codes, scales, self.block))

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._contexts, "compressor", None)
        if compressor is None:
            # threads=0: compress in the calling thread; the service parallelises over buckets.
            compressor = self._contexts.compressor = zstandard.ZstdCompressor(level=self.level, threads=0)
        return compressor

    def _decompress(self, body: memoryview, raw_bytes: int) -> np.ndarray:
        decompressor = getattr(self._contexts, "decompressor", None)
        if decompressor is None:
            decompressor = self._contexts.decompressor = zstandard.ZstdDecompressor()
        try:
            content_size = zstandard.frame_content_size(body)
            if content_size != raw_bytes:
                raise ValueError(f"corrupt blob: zstd frame holds {content_size} bytes, header says {raw_bytes}")
            return np.frombuffer(decompressor.decompress(body), dtype=np.uint8)
        except zstandard.ZstdError as error:
            raise ValueError(f"corrupt blob: {error}") from error


@dataclass(slots=True)
class DeltaSchedule:
    """Per link, whether the next version goes as a delta or in full: full when the receiver does
    not hold the version the sender deltas against, and at least every `full_every` sends, which
    bounds how long a delta chain gets and lets receivers resync."""

    full_every: int
    _deltas_since_full: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {self.full_every}")

    def sends_delta(self, link: str, version: int, base_version: int | None, receiver_base: int | None) -> bool:
        """Decides how `version` goes to `link` and records the decision. base_version: the version
        the sender can XOR against (None if it holds none); receiver_base: the version the
        receiver's buffer holds (None if nothing)."""
        if base_version is not None and base_version >= version:
            raise ValueError(f"base version {base_version} must be older than version {version}")
        deltas = self._deltas_since_full.get(link)
        if deltas is None or base_version is None or receiver_base != base_version or deltas + 1 >= self.full_every:
            self._deltas_since_full[link] = 0
            return False
        self._deltas_since_full[link] = deltas + 1
        return True

    def forget(self, link: str) -> None:
        """Drops a link that went away; if it comes back its first version goes in full."""
        self._deltas_since_full.pop(link, None)


@dataclass(slots=True)
class CompressionReport:
    """Totals over the buckets of one or more transfers, for logs."""

    mode: CompressionMode
    raw_bytes: int = 0
    encoded_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    max_abs_error: float = 0.0
    sq_error: float = 0.0
    sq_value: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    @property
    def relative_rms_error(self) -> float:
        """RMS of the errors over RMS of the values (0 for lossless modes and all-zero values)."""
        return math.sqrt(self.sq_error / self.sq_value) if self.sq_value else 0.0

    def add(self, bucket: EncodedBucket, seconds: float) -> None:
        """Counts one encoded bucket and the time its encoding took."""
        self.raw_bytes += bucket.raw_bytes
        self.encoded_bytes += len(bucket.data)
        self.encode_seconds += seconds
        self.max_abs_error = max(self.max_abs_error, bucket.max_abs_error)
        self.sq_error += bucket.sq_error
        self.sq_value += bucket.sq_value

    def add_decode(self, seconds: float) -> None:
        self.decode_seconds += seconds

    def as_dict(self) -> dict[str, str | int | float]:
        return {
            "mode": self.mode,
            "raw_bytes": self.raw_bytes,
            "encoded_bytes": self.encoded_bytes,
            "ratio": self.ratio,
            "encode_seconds": self.encode_seconds,
            "decode_seconds": self.decode_seconds,
            "max_abs_error": self.max_abs_error,
            "relative_rms_error": self.relative_rms_error,
        }


def _bucket_bytes(array: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D uint8 numpy array, "
            f"got {getattr(array, 'dtype', type(array).__name__)} with shape {getattr(array, 'shape', None)}"
        )
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    return array


def _split_planes(data: np.ndarray, element_size: int) -> np.ndarray:
    if element_size == 1:
        return data
    count = data.size // element_size
    words = data[: count * element_size].view(_WORD_TYPES[element_size])
    planes = np.empty(data.size, dtype=np.uint8)
    # Shifting whole words is ~4x faster than a strided transpose copy (measured on bf16).
    for plane in range(element_size):
        np.right_shift(
            words, 8 * (element_size - 1 - plane), out=planes[plane * count : (plane + 1) * count], casting="unsafe"
        )
    planes[count * element_size :] = data[count * element_size :]
    return planes


def _join_planes(planes: np.ndarray, element_size: int, out: np.ndarray) -> None:
    if element_size == 1:
        out[:] = planes
        return
    word_type = _WORD_TYPES[element_size]
    count = out.size // element_size
    words = out[: count * element_size].view(word_type)
    np.left_shift(planes[:count], 8 * (element_size - 1), out=words, dtype=word_type)
    for plane in range(1, element_size):
        shifted = np.left_shift(
            planes[plane * count : (plane + 1) * count], 8 * (element_size - 1 - plane), dtype=word_type
        )
        np.bitwise_or(words, shifted, out=words)
    out[count * element_size :] = planes[count * element_size :]


def _padded_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    padding = -values.numel() % block
    return (torch.nn.functional.pad(values, (0, padding)) if padding else values).view(-1, block)


def _scaled_codes(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values of the codes (1-D): the same computation on both sides, so encode reports
    exactly the error decode will have."""
    if codes.dtype == torch.float8_e4m3fn:
        values = torch.from_numpy(np.take(_FP8_VALUES, codes.view(torch.uint8).numpy()))
    else:
        values = codes.float()
    return (_padded_blocks(values, block) * scales.unsqueeze(1)).view(-1)[: codes.numel()]
