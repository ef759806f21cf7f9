"""Bucket codecs: lossless modes reproduce the bytes (crc32s included), lossy modes report their
exact error within the quantization bound, the delta schedule resyncs receivers, bad input is named."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.transfer.codecs import HEADER, BucketCodec, CompressionReport, DeltaSchedule
from rlmesh.transfer.payload import bucket_checksums, bucket_ranges, corrupted_buckets, pack

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOSSLESS_MODES = ["none", "zstd", "delta"]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Largest relative rounding error of a value stored in each dtype."""


def sparse_bytes(rng: np.random.Generator, length: int, nonzero_fraction: float) -> np.ndarray:
    data = rng.integers(0, 256, length, dtype=np.uint8)
    data[rng.random(length) >= nonzero_fraction] = 0
    return data


def weights(count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, generator=generator) * 0.02).to(dtype)


def with_changed_fraction(values: torch.Tensor, fraction: float, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    changed = values.clone()
    index = torch.randperm(values.numel(), generator=generator)[: int(values.numel() * fraction)]
    changed[index] = (changed[index].float() + torch.randn(index.numel(), generator=generator) * 1e-3).to(values.dtype)
    return changed


def as_bytes(values: torch.Tensor) -> np.ndarray:
    return values.contiguous().view(torch.uint8).numpy()


@settings(max_examples=60)
@given(
    mode=st.sampled_from(LOSSLESS_MODES),
    dtype=st.sampled_from(FLOAT_DTYPES),
    length=st.integers(min_value=0, max_value=20_000),
    nonzero_fraction=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_lossless_modes_round_trip_exactly(mode, dtype, length, nonzero_fraction, seed):
    rng = np.random.default_rng(seed)
    raw = sparse_bytes(rng, length, nonzero_fraction)
    previous = sparse_bytes(rng, length, nonzero_fraction) if mode == "delta" else None
    codec = BucketCodec(mode, dtype)
    encoded = codec.encode(raw, previous)
    assert encoded.raw_bytes == length
    assert len(encoded.data) <= HEADER.size + length
    out = np.full(length, 0xAB, dtype=np.uint8)
    codec.decode(encoded.data, out, previous)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_decoded_in_place_matches_the_new_versions_checksums(dtype):
    old = {"embed": weights(3000, dtype, seed=1), "proj": weights(5001, dtype, seed=2)}
    new = {name: with_changed_fraction(values, 0.02) for name, values in old.items()}
    bucket_bytes = 4096
    _, old_payload = pack(old, version=1, bucket_bytes=bucket_bytes)
    manifest, new_payload = pack(new, version=2, bucket_bytes=bucket_bytes)
    codec = BucketCodec("delta", dtype)
    received = old_payload.clone()
    before, after, buffer = old_payload.numpy(), new_payload.numpy(), received.numpy()
    for start, end in bucket_ranges(manifest.total_bytes, bucket_bytes):
        blob = codec.encode(after[start:end], before[start:end]).data
        codec.decode(blob, buffer[start:end], buffer[start:end])
    assert corrupted_buckets(manifest, received) == []
    assert bucket_checksums(received, bucket_bytes) == list(manifest.bucket_crc32)


def test_delta_against_the_wrong_base_is_caught_by_the_checksums():
    old, new = weights(4096, torch.bfloat16), with_changed_fraction(weights(4096, torch.bfloat16), 0.02)
    manifest, new_payload = pack({"w": new}, version=2, bucket_bytes=1024)
    codec = BucketCodec("delta", torch.bfloat16)
    received = torch.from_numpy(as_bytes(weights(4096, torch.bfloat16, seed=7)).copy())
    blob = codec.encode(new_payload.numpy(), as_bytes(old)).data
    codec.decode(blob, received.numpy(), received.numpy())
    assert corrupted_buckets(manifest, received) != []


def test_delta_of_two_percent_changed_bf16_compresses_more_than_5x():
    old = weights(1 << 19, torch.bfloat16)
    new = with_changed_fraction(old, 0.02)
    encoded = BucketCodec("delta", torch.bfloat16).encode(as_bytes(new), as_bytes(old))
    assert encoded.raw_bytes / len(encoded.data) > 5


@settings(max_examples=60)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    count=st.integers(min_value=0, max_value=5_000),
    changed_fraction=st.sampled_from([0.0, 0.001, 0.02, 0.05, 0.2]),
    in_place=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_sparse_and_dense_deltas_reproduce_the_new_bucket(dtype, count, changed_fraction, in_place, seed):
    generator = torch.Generator().manual_seed(seed)
    old = (torch.randn(count, generator=generator) * 0.02).to(dtype)
    new = with_changed_fraction(old, changed_fraction, seed)
    codec = BucketCodec("delta", dtype)
    blob = codec.encode(as_bytes(new), as_bytes(old)).data
    changed = (
        int((as_bytes(new).view(np.uint8) != as_bytes(old)).reshape(-1, dtype.itemsize).any(axis=1).sum())
        if count
        else 0
    )
    if count and changed <= 0.05 * count:
        assert blob[0] == 5, "few changed elements go as a sparse delta"
    out = as_bytes(old).copy() if in_place else np.full(as_bytes(old).size, 0xAB, dtype=np.uint8)
    codec.decode(blob, out, out if in_place else as_bytes(old))
    assert np.array_equal(out, as_bytes(new))


def test_a_two_percent_delta_goes_sparse_and_a_dense_change_goes_through_zstd():
    old = weights(1 << 16, torch.bfloat16)
    codec = BucketCodec("delta", torch.bfloat16)
    sparse = codec.encode(as_bytes(with_changed_fraction(old, 0.02)), as_bytes(old))
    dense = codec.encode(as_bytes(with_changed_fraction(old, 0.5)), as_bytes(old))
    assert (sparse.data[0], dense.data[0]) == (5, 2)
    # 4-byte index and 2-byte value per changed element: 6 % of the bucket.
    assert sparse.raw_bytes / len(sparse.data) > 15


def test_corrupt_sparse_deltas_are_named():
    codec = BucketCodec("delta", torch.bfloat16)
    old = as_bytes(weights(256, torch.bfloat16))
    blob = bytearray(codec.encode(as_bytes(with_changed_fraction(weights(256, torch.bfloat16), 0.02)), old).data)
    assert blob[0] == 5
    out = old.copy()
    with pytest.raises(ValueError, match="not whole \\(index, value\\) pairs"):
        codec.decode(bytes(blob[:-1]), out, out)
    blob[HEADER.size : HEADER.size + 4] = (1 << 20).to_bytes(4, "little")
    with pytest.raises(ValueError, match="corrupt blob: index 1048576 is out of bounds"):
        codec.decode(bytes(blob), out, out)
    with pytest.raises(ValueError, match="decoding needs `previous`"):
        codec.decode(bytes(blob), out)


def test_byte_planes_beat_plain_zstd_on_bf16_weights():
    import zstandard

    raw = as_bytes(weights(1 << 18, torch.bfloat16))
    planes = len(BucketCodec("zstd", torch.bfloat16).encode(raw).data)
    plain = len(zstandard.ZstdCompressor(level=1).compress(raw.tobytes()))
    assert planes < plain / 1.1


@pytest.mark.parametrize("mode", ["zstd", "delta"])
def test_incompressible_buckets_are_sent_raw(mode):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 65536, dtype=np.uint8)
    previous = rng.integers(0, 256, raw.size, dtype=np.uint8) if mode == "delta" else None
    codec = BucketCodec(mode, torch.bfloat16)
    encoded = codec.encode(raw, previous)
    assert len(encoded.data) == HEADER.size + raw.size
    assert encoded.data[HEADER.size :] == raw.tobytes()
    out = np.zeros_like(raw)
    codec.decode(encoded.data, out, previous)
    assert np.array_equal(out, raw)


def test_a_bucket_too_small_to_quantize_profitably_is_sent_raw():
    raw = as_bytes(torch.tensor([0.75], dtype=torch.bfloat16))
    codec = BucketCodec("int8", torch.bfloat16)
    encoded = codec.encode(raw)
    assert len(encoded.data) == HEADER.size + raw.size
    assert (encoded.max_abs_error, encoded.sq_error, encoded.sq_value) == (0.0, 0.0, 0.75**2)
    out = np.zeros_like(raw)
    codec.decode(encoded.data, out)
    assert np.array_equal(out, raw)


def quantization_input(dtype: torch.dtype, block: int) -> torch.Tensor:
    """Blocks of very different magnitudes, an all-zero block and a partial last block."""
    generator = torch.Generator().manual_seed(3)
    magnitudes = torch.logspace(-3, 1, 6).repeat_interleave(block)
    values = torch.randn(magnitudes.numel(), generator=generator) * magnitudes
    values[2 * block : 3 * block] = 0
    return torch.cat([values, torch.randn(block // 3, generator=generator)]).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantization_reports_its_actual_error_within_the_bound(mode, dtype):
    block = 64
    original = quantization_input(dtype, block)
    codec = BucketCodec(mode, dtype, block=block)
    encoded = codec.encode(as_bytes(original))
    assert len(encoded.data) < original.numel() * dtype.itemsize
    out = np.zeros(encoded.raw_bytes, dtype=np.uint8)
    codec.decode(encoded.data, out)
    decoded = torch.from_numpy(out).view(dtype).double()
    exact = original.double()
    error = (decoded - exact).abs()
    assert encoded.max_abs_error == pytest.approx(error.max().item(), rel=1e-6)
    assert encoded.sq_error == pytest.approx(error.square().sum().item(), rel=1e-4)
    assert encoded.sq_value == pytest.approx(exact.square().sum().item(), rel=1e-4)
    assert torch.all(decoded[2 * block : 3 * block] == 0)

    padding = -exact.numel() % block
    absmax = torch.nn.functional.pad(exact.abs(), (0, padding)).view(-1, block).amax(dim=1)
    scale = absmax.repeat_interleave(block)[: exact.numel()] / (127 if mode == "int8" else 448)
    if mode == "int8":
        bound = scale / 2
    else:
        # e4m3: 3 mantissa bits for normal values, spacing 2^-9 (in scaled units) for subnormals.
        bound = exact.abs() * 2**-4 + scale * 2**-10
    # Storing the decoded value in the payload dtype rounds it once more (fp16 subnormals: 2^-25).
    bound = (bound + decoded.abs() * HALF_ULP[dtype] + 2**-25) * (1 + 1e-5)
    assert torch.all(error <= bound)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_report_aggregates_relative_rms_over_buckets(mode):
    original = weights(10_000, torch.bfloat16)
    raw = as_bytes(original)
    codec = BucketCodec(mode, torch.bfloat16)
    report = CompressionReport(mode)
    decoded = np.zeros_like(raw)
    for start, end in bucket_ranges(raw.size, 4096):
        encoded = codec.encode(raw[start:end])
        report.add(encoded, seconds=0.5)
        codec.decode(encoded.data, decoded[start:end])
    report.add_decode(0.25)
    exact = original.double()
    error = torch.from_numpy(decoded).view(torch.bfloat16).double() - exact
    expected_rms = (error.square().sum() / exact.square().sum()).sqrt().item()
    assert 0 < report.relative_rms_error == pytest.approx(expected_rms, rel=1e-4)
    assert report.max_abs_error == pytest.approx(error.abs().max().item(), rel=1e-6)
    summary = report.as_dict()
    assert summary["raw_bytes"] == raw.size
    assert summary["ratio"] == pytest.approx(raw.size / report.encoded_bytes)
    assert summary["ratio"] > 1.8
    assert (summary["encode_seconds"], summary["decode_seconds"]) == (2.5, 0.25)
    assert summary["relative_rms_error"] == report.relative_rms_error


def test_lossless_report_has_no_error():
    report = CompressionReport("zstd")
    raw = np.zeros(1000, dtype=np.uint8)
    report.add(BucketCodec("zstd", torch.bfloat16).encode(raw), seconds=0.1)
    assert report.ratio > 10
    assert (report.max_abs_error, report.relative_rms_error) == (0.0, 0.0)
    assert CompressionReport("none").ratio == 1.0


def test_one_codec_serves_several_threads():
    codec = BucketCodec("zstd", torch.bfloat16)
    buckets = [as_bytes(weights(20_000, torch.bfloat16, seed=seed)) for seed in range(8)]
    with ThreadPoolExecutor(4) as pool:
        blobs = list(pool.map(lambda raw: codec.encode(raw).data, buckets))
        outs = [np.zeros_like(raw) for raw in buckets]
        list(pool.map(codec.decode, blobs, outs))
    for raw, out in zip(buckets, outs):
        assert np.array_equal(raw, out)


def test_delta_schedule_sends_full_first_then_every_n_sends():
    schedule = DeltaSchedule(full_every=3)
    holds = None
    decisions = []
    for version in range(1, 9):
        decisions.append(schedule.sends_delta("a", version, base_version=version - 1, receiver_base=holds))
        holds = version
    assert decisions == [False, True, True, False, True, True, False, True]


def test_delta_schedule_sends_full_when_the_receiver_lacks_the_base():
    schedule = DeltaSchedule(full_every=100)
    assert not schedule.sends_delta("a", 1, base_version=None, receiver_base=None)
    assert schedule.sends_delta("a", 2, base_version=1, receiver_base=1)
    assert not schedule.sends_delta("a", 3, base_version=2, receiver_base=1)
    assert schedule.sends_delta("a", 4, base_version=3, receiver_base=3)
    assert not schedule.sends_delta("a", 5, base_version=None, receiver_base=4)
    # Links are independent: a new receiver starts with a full version.
    assert not schedule.sends_delta("b", 6, base_version=5, receiver_base=5)
    assert schedule.sends_delta("a", 6, base_version=5, receiver_base=5)


def test_delta_schedule_with_full_every_one_never_sends_deltas():
    schedule = DeltaSchedule(full_every=1)
    assert not any(schedule.sends_delta("a", version, version - 1, version - 1) for version in range(1, 5))


def encoded_blob(mode: str = "zstd", dtype: torch.dtype = torch.bfloat16, size: int = 512) -> bytes:
    """A blob of `mode` proper (not the raw fallback)."""
    values = weights(size // dtype.itemsize, dtype)
    values[::2] = 0  # compressible whatever the dtype
    blob = BucketCodec(mode, dtype).encode(as_bytes(values)).data
    assert blob[0] != 0
    return blob


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: BucketCodec("lz4", torch.bfloat16), "unknown compression mode 'lz4'"),
        (lambda: BucketCodec("int8", torch.int32), "int8 quantization needs a float32, bfloat16 or float16 payload"),
        (lambda: BucketCodec("fp8", torch.float64), "fp8 quantization needs"),
        (lambda: BucketCodec("zstd", torch.bfloat16, level=23), "zstd level"),
        (lambda: BucketCodec("int8", torch.bfloat16, block=0), "quantization block"),
        (lambda: DeltaSchedule(full_every=0), "full_every"),
        (lambda: DeltaSchedule(3).sends_delta("a", 4, base_version=4, receiver_base=4), "base version 4 must be older"),
    ],
)
def test_bad_configuration_is_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_buckets_and_blobs_are_named():
    codec = BucketCodec("delta", torch.bfloat16)
    raw = as_bytes(weights(256, torch.bfloat16))
    with pytest.raises(ValueError, match="delta encoding needs `previous`"):
        codec.encode(raw)
    with pytest.raises(ValueError, match="previous bucket has 4 bytes, raw has 512"):
        codec.encode(raw, raw[:4].copy())
    with pytest.raises(ValueError, match="raw must be a 1-D uint8 numpy array"):
        codec.encode(np.zeros(4, dtype=np.float32))
    delta_blob = codec.encode(
        with_changed_fraction(weights(256, torch.bfloat16), 0.5).view(torch.uint8).numpy(), raw
    ).data
    assert delta_blob[0] == 2
    with pytest.raises(ValueError, match="decoding needs `previous`"):
        codec.decode(delta_blob, np.zeros(512, dtype=np.uint8))

    zstd = BucketCodec("zstd", torch.bfloat16)
    blob = encoded_blob()
    with pytest.raises(ValueError, match="blob is for a 512-byte bucket but out has 256 bytes"):
        zstd.decode(blob, np.zeros(256, dtype=np.uint8))
    with pytest.raises(ValueError, match="corrupt header: blob has 3 bytes"):
        zstd.decode(blob[:3], np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="corrupt header: unknown tag 9"):
        zstd.decode(bytes([9]) + blob[1:], np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="corrupt blob"):
        zstd.decode(blob[: HEADER.size] + bytes(len(blob) - HEADER.size), np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="blob is int8-encoded but this codec decodes zstd"):
        zstd.decode(encoded_blob("int8"), np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="encoded for 4-byte elements"):
        zstd.decode(encoded_blob(dtype=torch.float32), np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="quantized in blocks of 128 elements, this codec uses 64"):
        BucketCodec("int8", torch.bfloat16, block=64).decode(encoded_blob("int8"), np.zeros(512, dtype=np.uint8))
    with pytest.raises(ValueError, match="inf or NaN"):
        BucketCodec("int8", torch.float32).encode(as_bytes(torch.tensor([1.0, float("nan")] * 64)))
    with pytest.raises(ValueError, match="not a whole number of torch.bfloat16 elements"):
        BucketCodec("fp8", torch.bfloat16).encode(np.zeros(3, dtype=np.uint8))
