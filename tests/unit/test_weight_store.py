"""The weights service's store: only complete, verified, newer versions become the latest, and a
buffer a push still reads is never reused for the next upload."""

import pytest
import torch

from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.payload import pack
from services.weights.store import WeightStore


def upload(store: WeightStore, version: int, value: float = 1.0):
    manifest, payload = pack({"w": torch.full((64,), value)}, version, bucket_bytes=64)
    pending = store.begin_upload(manifest)
    data = payload.numpy().tobytes()
    for offset in range(0, len(data), 100):
        pending.write(offset, data[offset:offset + 100])
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


def test_a_buffer_being_pushed_is_not_reused():
    store = WeightStore()
    first = upload(store, 1, value=1.0)
    reader = store.acquire()
    upload(store, 2, value=2.0)
    upload(store, 3, value=3.0)
    assert reader is first
    assert torch.equal(first.payload[:256].view(torch.float32), torch.full((64,), 1.0))
    store.release(reader)
    upload(store, 4, value=4.0)
    assert store.latest.version == 4
