"""The weights service's store: only complete, verified, newer versions become the latest, each
tensor-parallel rank's payload is cut from FSDP shards exactly, and a buffer a push still reads is
never reused for the next upload."""

import pytest
import torch

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes, shard_full_tensors
from rlmesh.transfer.payload import corrupted_buckets, pack, unpack
from rlmesh.transfer.shards import LocalShard, layout_to_proto, shard_specs, write_payload
from rlmesh.weights.v1 import weights_pb2
from services.weights.store import FULL_LAYOUT, WeightStore


def upload(store: WeightStore, version: int, value: float = 1.0):
    manifest, payload = pack({"w": torch.full((64,), value)}, version, bucket_bytes=64)
    pending = store.begin_upload(manifest)
    data = payload.numpy().tobytes()
    for offset in range(0, len(data), 100):
        pending.write(offset, data[offset : offset + 100])
    return store.finish(pending)


def test_versions_only_grow():
    store = WeightStore()
    upload(store, 1)
    with pytest.raises(FailedPrecondition, match="not newer"):
        upload(store, 1)
    assert store.latest.version == 1


def test_incomplete_or_corrupted_uploads_never_become_latest():
    store = WeightStore()
    upload(store, 1)
    manifest, payload = pack({"w": torch.ones(64)}, 2, bucket_bytes=64)
    pending = store.begin_upload(manifest)
    pending.write(0, payload.numpy().tobytes()[:100])
    with pytest.raises(InvalidArgument, match="100 of 256"):
        store.finish(pending)
    pending = store.begin_upload(manifest)
    corrupted = bytearray(payload.numpy().tobytes())
    corrupted[200] ^= 1
    pending.write(0, bytes(corrupted))
    with pytest.raises(InvalidArgument, match="crc32"):
        store.finish(pending)
    with pytest.raises(InvalidArgument, match="in order"):
        store.begin_upload(manifest).write(64, b"x")
    assert store.latest.version == 1


def test_at_most_the_latest_and_its_base_are_held_and_only_the_latest_keeps_encodings():
    store = WeightStore()
    first = upload(store, 1)
    first.encodings["link"] = object()
    second = upload(store, 2)
    assert (store.previous, store.latest) == (first, second) and first.encodings == {}
    store.drop_previous()
    assert store.previous is None and first.payloads == {}, "a version no push reads is released"
    third = upload(store, 3)
    assert (store.previous, store.latest) == (second, third)


def test_a_buffer_being_pushed_is_not_reused():
    store = WeightStore()
    first = upload(store, 1, value=1.0)
    reader = store.acquire()
    upload(store, 2, value=2.0)
    upload(store, 3, value=3.0)
    assert reader is first
    assert torch.equal(first.payloads[(FULL_LAYOUT, 0)].payload[:256].view(torch.float32), torch.full((64,), 1.0))
    store.release(reader)
    upload(store, 4, value=4.0)
    assert store.latest.version == 4


def model_shape() -> ModelShape:
    return ModelShape(
        hidden_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        intermediate_size=8,
        vocab_size=14,
        num_layers=2,
        tie_word_embeddings=True,
        attention_bias=True,
    )


def full_tensors(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(dims, generator=generator) for name, dims in hf_parameter_shapes(shape).items()}


def rank_upload(shape: ModelShape, full: dict[str, torch.Tensor], version: int, rank: int, world: int):
    """What FSDP rank `rank` hands over: its rows of every parameter, nothing more."""
    shards = {}
    for name, tensor in full.items():
        start, end = fsdp_rows(tensor.shape[0], world, rank)
        shards[name] = LocalShard(tensor[start:end], tuple(tensor.shape), start, end)
    specs, total = shard_specs(shards)
    payload = torch.zeros(total, dtype=torch.uint8)
    crc = write_payload(shards, specs, payload)
    header = weights_pb2.ShardsHeader(
        version=version,
        rank=rank,
        world_size=world,
        layout=layout_to_proto(shape),
        shards=specs,
        total_bytes=total,
        payload_crc32=crc,
    )
    return header, payload


def add_rank(store: WeightStore, header, payload):
    """What the service does with one rank's upload: returns the ranks received and the version
    once it is stored."""
    buffer = store.shard_buffer(header)
    buffer[: header.total_bytes].copy_(payload)
    store.check_payload(header, buffer)
    assembly = store.add_shards(header, buffer)
    assembly.apply_rank(header.rank)
    if not assembly.complete:
        return len(assembly.headers), None
    snapshot = store.finish_assembly(assembly)
    store.install(snapshot)
    return len(assembly.headers), snapshot


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("prebuilt", [False, True])
def test_a_version_from_fsdp_ranks_becomes_each_tp_ranks_payload(world, tp, prebuilt):
    """Whether a layout is built as the ranks arrive (in use) or on first ask, the bytes are the same."""
    shape, store = model_shape(), WeightStore(bucket_bytes=256)
    if prebuilt:
        store.layouts_in_use |= {(tp, r) for r in range(tp)} | {(3, 0)}
    full = full_tensors(shape, 0)
    results = [add_rank(store, *rank_upload(shape, full, 5, rank, world)) for rank in range(world)]
    assert [r[0] for r in results] == list(range(1, world + 1))
    assert all(r[1] is None for r in results[:-1]) and results[-1][1] is store.latest
    assert set(store.latest.payloads) == ({(tp, r) for r in range(tp)} if prebuilt else set())
    for rank in range(tp):
        built = store.latest.rank_payload(tp, rank)
        assert built.manifest.tensor_parallel_size == tp and built.manifest.tensor_parallel_rank == rank
        assert corrupted_buckets(built.manifest, built.payload) == []
        expected = shard_full_tensors(full, shape, tp, rank)
        got = unpack(built.manifest, built.payload)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)
    full_payload = store.latest.rank_payload(FULL_LAYOUT, 0)
    assert all(torch.equal(t, full[n]) for n, t in unpack(full_payload.manifest, full_payload.payload).items())


def test_a_version_is_stored_only_when_every_rank_arrived_intact():
    shape, store = model_shape(), WeightStore(bucket_bytes=256)
    full = full_tensors(shape, 1)
    header, payload = rank_upload(shape, full, 3, 0, 2)
    assert add_rank(store, header, payload) == (1, None)
    assert store.latest is None
    with pytest.raises(InvalidArgument, match="already received"):
        store.check_shards(header)
    other, other_payload = rank_upload(shape, full, 3, 1, 2)
    corrupted = other_payload.clone()
    corrupted[0] ^= 1
    with pytest.raises(InvalidArgument, match="crc32"):
        add_rank(store, other, corrupted)
    assert store.latest is None
    assert add_rank(store, other, other_payload)[1].version == 3
    with pytest.raises(FailedPrecondition, match="not newer"):
        store.check_shards(rank_upload(shape, full, 3, 0, 2)[0])


def test_ranks_must_agree_and_cover_their_fsdp_rows():
    shape, store = model_shape(), WeightStore(bucket_bytes=256)
    full = full_tensors(shape, 2)
    add_rank(store, *rank_upload(shape, full, 4, 0, 2))
    with pytest.raises(InvalidArgument, match="disagrees"):
        store.check_shards(rank_upload(shape, full, 4, 1, 3)[0])
    header, _ = rank_upload(shape, full, 4, 1, 2)
    header.shards[0].row_start += 1
    with pytest.raises(InvalidArgument, match="FSDP rank 1 of 2 holds"):
        store.check_shards(header)


def test_a_newer_complete_version_drops_an_older_one_still_assembling():
    shape, store = model_shape(), WeightStore(bucket_bytes=256)
    full = full_tensors(shape, 3)
    add_rank(store, *rank_upload(shape, full, 6, 0, 2))
    for rank in range(2):
        add_rank(store, *rank_upload(shape, full, 7, rank, 2))
    assert store.latest.version == 7
    with pytest.raises(FailedPrecondition, match="not newer"):
        add_rank(store, *rank_upload(shape, full, 6, 1, 2))


def test_tp_sizes_the_model_cannot_split_into_are_refused_with_the_reason():
    shape, store = model_shape(), WeightStore(bucket_bytes=256)
    add_rank(store, *rank_upload(shape, full_tensors(shape, 4), 1, 0, 1))
    with pytest.raises(InvalidArgument, match="4 attention heads do not split over 3 ranks"):
        store.latest.rank_payload(3, 0)
