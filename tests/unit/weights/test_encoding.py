"""Encoded payloads: what a receiver decodes from the frames is the payload, bit for bit for
lossless modes, and matches the manifest's checksums for lossy ones."""

import numpy as np
import pytest
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.transfer.base import raw_frames
from rlmesh.transfer.codecs import BucketCodec
from rlmesh.transfer.payload import bucket_checksums, corrupted_buckets, pack
from services.weights.encoding import EncodedPayload
from services.weights.store import RankPayload


def rank_payload(version: int, tensors: dict[str, torch.Tensor]) -> RankPayload:
    return RankPayload(*pack(tensors, version, bucket_bytes=4096))


def receive(encoded_frames, out: np.ndarray, mode: str, dtype: torch.dtype) -> None:
    codecs = {}
    for offset, raw_bytes, code, _base_version, data in encoded_frames:
        target = out[offset : offset + raw_bytes]
        if code == common_pb2.COMPRESSION_NONE:
            target[:] = np.frombuffer(data, dtype=np.uint8)
            continue
        name = {
            common_pb2.COMPRESSION_ZSTD: "zstd",
            common_pb2.COMPRESSION_DELTA: "delta",
            common_pb2.COMPRESSION_INT8: "int8",
        }[code]
        codec = codecs.setdefault(name, BucketCodec(name, dtype))
        codec.decode(data, target, target if name == "delta" else None)


@pytest.fixture
def versions():
    generator = torch.Generator().manual_seed(0)
    old = {f"w{i}": (torch.randn(64, 64, generator=generator) * 0.02).bfloat16() for i in range(4)}
    new = {name: tensor.clone() for name, tensor in old.items()}
    flat = new["w1"].view(-1)
    flat[::50] += 0.001
    return rank_payload(1, old), rank_payload(2, new)


def test_raw_frames_are_the_payload(versions):
    _, new = versions
    out = np.zeros(new.manifest.total_bytes, dtype=np.uint8)
    receive(raw_frames(new.manifest, new.payload), out, "none", torch.bfloat16)
    assert corrupted_buckets(new.manifest, torch.from_numpy(out)) == []


def test_zstd_and_delta_frames_reconstruct_the_new_version_exactly(versions):
    old, new = versions
    out = np.zeros(new.manifest.total_bytes, dtype=np.uint8)
    zstd = EncodedPayload(new, "zstd")
    receive(zstd.frames(), out, "zstd", torch.bfloat16)
    assert corrupted_buckets(new.manifest, torch.from_numpy(out)) == []
    assert zstd.report.ratio > 1.2
    held = old.payload.numpy().copy()
    delta = EncodedPayload(new, "delta", old, base_version=1)
    frames = list(delta.frames())
    assert {f[3] for f in frames} == {1}
    receive(frames, held, "delta", torch.bfloat16)
    assert corrupted_buckets(new.manifest, torch.from_numpy(held)) == []
    assert delta.report.ratio > 5 * zstd.report.ratio


def test_a_lossy_manifest_carries_the_checksums_of_what_the_receiver_decodes(versions):
    _, new = versions
    encoded = EncodedPayload(new, "int8")
    manifest = encoded.lossy_manifest()
    out = np.zeros(new.manifest.total_bytes, dtype=np.uint8)
    receive(encoded.frames(), out, "int8", torch.bfloat16)
    assert list(manifest.bucket_crc32) == bucket_checksums(torch.from_numpy(out), manifest.bucket_bytes)
    assert list(manifest.bucket_crc32) != list(new.manifest.bucket_crc32)
    assert 0 < encoded.report.max_abs_error < 1e-3
    assert 0 < encoded.report.relative_rms_error < 0.02


def test_delta_needs_a_base():
    with pytest.raises(ValueError, match="base"):
        EncodedPayload(rank_payload(1, {"w": torch.ones(4)}), "delta")
