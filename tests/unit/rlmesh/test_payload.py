"""Weight payloads: pack/unpack is exact, manifests are validated, corruption is found per bucket."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.transfer.payload import PayloadError, corrupted_buckets, pack, unpack, validate_manifest

shapes = st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=3)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=50)
@given(st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=6), st.integers(min_value=1, max_value=64))
def test_pack_unpack_round_trip(specs, bucket_bytes):
    tensors = {f"t{i}": torch.randn(shape).to(dtype) for i, (shape, dtype) in enumerate(specs)}
    manifest, payload = pack(tensors, version=3, bucket_bytes=bucket_bytes)
    validate_manifest(manifest)
    assert corrupted_buckets(manifest, payload) == []
    restored = unpack(manifest, payload)
    assert restored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert restored[name].dtype == tensor.dtype
        assert torch.equal(restored[name], tensor)


def test_a_flipped_byte_is_found_in_its_bucket():
    manifest, payload = pack({"w": torch.arange(64, dtype=torch.float32)}, version=1, bucket_bytes=32)
    payload[100] ^= 0xFF
    assert corrupted_buckets(manifest, payload) == [3]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: setattr(m, "total_bytes", m.total_bytes + 1), "total_bytes"),
        (lambda m: setattr(m.tensors[1], "offset", 0), "offset"),
        (lambda m: setattr(m.tensors[0], "nbytes", 3), "nbytes"),
        (lambda m: m.bucket_crc32.append(0), "checksums"),
        (lambda m: setattr(m.tensors[1], "name", "a"), "twice"),
        (lambda m: setattr(m, "bucket_bytes", 0), "bucket_bytes"),
    ],
)
def test_inconsistent_manifests_are_refused(mutate, message):
    manifest, _ = pack({"a": torch.ones(4), "b": torch.ones(2, 2)}, version=1, bucket_bytes=8)
    mutate(manifest)
    with pytest.raises(PayloadError, match=message):
        validate_manifest(manifest)
