"""The FSDP trainer's pieces that need no process group: packing a rank's shards for the weights
service (shared-memory slots reused and named per mesh and process, or a stream), the thread that
runs a rank's torch work in order, and the settings. The ranks themselves run as real processes
in tests/integration/trainer/test_fsdp_trainer.py."""

from __future__ import annotations

import asyncio
import os
import zlib

import grpc
import pytest
import structlog
import torch

from rlmesh.config import ConfigError, load_config
from rlmesh.launch.processes import torchrun_args
from rlmesh.models.random_init import scaled_config, write_random_model
from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes
from rlmesh.transfer.payload import DTYPE_CODES, STREAM_CHUNK_BYTES, aligned
from rlmesh.transfer.shards import SHM_DIR, LocalShard, read_shared_memory, shard_views, validate_header
from rlmesh.weights.v1 import weights_pb2
from services.trainer.config import TrainerConfig
from services.trainer.ranks.distributed import TorchThread
from services.trainer.ranks.handoff import SLOT_PREFIX, PublishError, ShardHandoff, mesh_tag, slot_name
from services.trainer.ranks.policy import compute_dtype, publish_dtype

SHAPE = ModelShape(
    hidden_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=32,
    vocab_size=14,
    num_layers=2,
    tie_word_embeddings=True,
    attention_bias=True,
)


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(dims, generator=generator) for name, dims in hf_parameter_shapes(SHAPE).items()}


def rank_shards(full: dict[str, torch.Tensor], world: int, rank: int) -> dict[str, LocalShard]:
    shards = {}
    for name, tensor in full.items():
        start, end = fsdp_rows(tensor.shape[0], world, rank)
        shards[name] = LocalShard(tensor[start:end], tuple(tensor.shape), start, end)
    return shards


class RecordingStub:
    """Stands in for the weights service's stub: keeps what an upload sent."""

    def __init__(self) -> None:
        self.requests: list[weights_pb2.UploadShardsRequest] = []

    async def UploadShards(self, requests, timeout=None, metadata=None):
        assert timeout is not None, "every RPC carries a deadline"
        self.requests = [r async for r in requests]
        header = self.requests[0].header
        return weights_pb2.UploadShardsResponse(version=header.version, ranks_received=1, complete=True)


@pytest.fixture
def mesh(tmp_path):
    tag = mesh_tag(str(tmp_path))
    yield tag
    for path in SHM_DIR.glob(f"{SLOT_PREFIX}-{tag}-*"):
        path.unlink()


async def test_a_rank_packs_its_rows_into_two_reused_shared_memory_slots(mesh):
    stub = RecordingStub()
    handoff = ShardHandoff(stub, SHAPE, rank=1, world_size=3, mode="shm", mesh=mesh, timeout=5.0)
    paths = []
    try:
        for version in (1, 2, 3):
            full = full_tensors(version)
            packed = handoff.pack(version, rank_shards(full, 3, 1))
            header = packed.header
            assert validate_header(header) == SHAPE  # the weights service's own checks
            assert (header.version, header.rank, header.world_size) == (version, 1, 3)
            assert os.path.basename(header.shm_path) == slot_name(mesh, os.getpid(), 1, (version - 1) % 2)
            paths.append(header.shm_path)
            reply = await handoff.upload(packed)
            assert reply.complete and len(stub.requests) == 1, "shared memory: the header alone"
            # What the weights service reads from the slot is exactly the rank's rows.
            received = torch.empty(header.total_bytes, dtype=torch.uint8)
            read_shared_memory(header.shm_path, header.total_bytes, received)
            assert zlib.crc32(received.numpy()) == header.payload_crc32
            for name, view in shard_views(header, received).items():
                start, end = fsdp_rows(full[name].shape[0], 3, 1)
                assert torch.equal(view, full[name][start:end]), name
            model_bytes = sum(t.numel() * 4 for t in full.values())
            assert header.total_bytes < model_bytes / 2, "a rank sends only its third of the model"
        assert paths[0] == paths[2] != paths[1], "two slots, used alternately and reused"
    finally:
        handoff.close()
    assert not any(os.path.exists(p) for p in paths), "closing unlinks the slots"


async def test_a_rank_on_another_host_streams_its_shards_after_the_header(mesh):
    stub = RecordingStub()
    # Big enough for several chunks.
    big = ModelShape(
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=14,
        num_layers=2,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    handoff = ShardHandoff(stub, big, rank=0, world_size=1, mode="stream", mesh=mesh, timeout=5.0)
    generator = torch.Generator().manual_seed(0)
    full = {name: torch.randn(dims, generator=generator) for name, dims in hf_parameter_shapes(big).items()}
    packed = handoff.pack(7, rank_shards(full, 1, 0))
    assert packed.header.shm_path == "" and not list(SHM_DIR.glob(f"{SLOT_PREFIX}-{mesh}-*"))
    await handoff.upload(packed)
    header, chunks = stub.requests[0].header, [r.chunk for r in stub.requests[1:]]
    assert header.total_bytes > 2 * STREAM_CHUNK_BYTES and len(chunks) == -(-header.total_bytes // STREAM_CHUNK_BYTES)
    payload = b"".join(c.data for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, header.total_bytes, STREAM_CHUNK_BYTES))
    assert len(payload) == header.total_bytes and zlib.crc32(payload) == header.payload_crc32
    handoff.close()


def payload_as_before(shards: dict[str, LocalShard], dtype: torch.dtype) -> bytes:
    """The payload laid out by hand: each shard's bytes in `dtype` at the next aligned offset."""
    payload = bytearray()
    for shard in shards.values():
        payload += bytes(aligned(len(payload)) - len(payload))
        payload += shard.tensor.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(payload)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_on_cpu_a_float32_version_is_packed_at_once_byte_for_byte(mesh, dtype):
    extra = {} if dtype is None else {"dtype": dtype}
    handoff = ShardHandoff(RecordingStub(), SHAPE, rank=0, world_size=2, mode="stream", mesh=mesh, timeout=5.0, **extra)
    shards = rank_shards(full_tensors(3), 2, 0)
    packed = handoff.pack(3, shards)
    expected = payload_as_before(shards, torch.float32)
    assert packed.copied is None, "on CPU nothing is left in flight"
    assert packed.header.total_bytes == len(expected)
    assert packed.payload[: len(expected)].numpy().tobytes() == expected
    assert packed.header.payload_crc32 == zlib.crc32(expected)
    assert {spec.dtype for spec in packed.header.shards} == {DTYPE_CODES[torch.float32]}


async def test_a_bfloat16_version_carries_the_master_shards_cast_to_bfloat16(mesh):
    stub = RecordingStub()
    handoff = ShardHandoff(
        stub, SHAPE, rank=1, world_size=2, mode="stream", mesh=mesh, timeout=5.0, dtype=torch.bfloat16
    )
    full = full_tensors(4)
    shards = rank_shards(full, 2, 1)
    packed = handoff.pack(4, shards)
    header = packed.header
    assert validate_header(header) == SHAPE
    assert {spec.dtype for spec in header.shards} == {DTYPE_CODES[torch.bfloat16]}
    assert all(shard.tensor.dtype == torch.float32 for shard in shards.values()), "the master shards stay float32"
    expected = payload_as_before(shards, torch.bfloat16)
    assert header.total_bytes == len(expected) < 0.6 * len(payload_as_before(shards, torch.float32))
    await handoff.upload(packed)
    sent = b"".join(r.chunk.data for r in stub.requests[1:])
    assert sent == expected and zlib.crc32(sent) == header.payload_crc32
    for name, view in shard_views(header, torch.frombuffer(bytearray(sent), dtype=torch.uint8)).items():
        start, end = fsdp_rows(full[name].shape[0], 2, 1)
        assert view.dtype == torch.bfloat16 and torch.equal(view, full[name][start:end].to(torch.bfloat16)), name


async def test_the_torch_thread_runs_calls_in_order_with_the_callers_log_context():
    thread = TorchThread()
    order = []
    structlog.contextvars.bind_contextvars(rank=3)
    try:
        results = await asyncio.gather(*(thread.run(lambda i=i: order.append(i) or i) for i in range(20)))
        assert results == list(range(20)) and order == list(range(20))
        assert await thread.run(lambda: structlog.contextvars.get_contextvars()["rank"]) == 3
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        assert await thread.run(lambda: "still serving") == "still serving"
    finally:
        structlog.contextvars.unbind_contextvars("rank")
        thread.close()
    assert not thread._thread.is_alive()


def test_settings_are_checked_and_come_from_the_environment():
    config = load_config(
        TrainerConfig,
        env_prefix="RLMESH_TRAINER_",
        environ={"RLMESH_TRAINER_MODEL_DIR": "m", "RLMESH_TRAINER_HANDOFF": "stream"},
    )
    assert config.handoff == "stream" and config.distributed_backend == "auto"
    with pytest.raises(ConfigError, match="handoff"):
        load_config(TrainerConfig, overrides={"model_dir": "m", "handoff": "socket"})
    with pytest.raises(ConfigError, match="collective_timeout_seconds"):
        load_config(TrainerConfig, overrides={"model_dir": "m", "collective_timeout_seconds": 60})


def test_precision_and_the_published_dtype_are_checked_and_resolved(tmp_path):
    config = TrainerConfig(model_dir="m")
    assert (config.precision, config.weights_dtype) == ("auto", "auto")
    config = load_config(
        TrainerConfig,
        env_prefix="RLMESH_TRAINER_",
        environ={
            "RLMESH_TRAINER_MODEL_DIR": "m",
            "RLMESH_TRAINER_PRECISION": "bf16",
            "RLMESH_TRAINER_WEIGHTS_DTYPE": "bfloat16",
        },
    )
    assert (config.precision, config.weights_dtype) == ("bf16", "bfloat16")
    with pytest.raises(ConfigError, match="precision"):
        load_config(TrainerConfig, overrides={"model_dir": "m", "precision": "fp16"})
    with pytest.raises(ConfigError, match="weights_dtype"):
        load_config(TrainerConfig, overrides={"model_dir": "m", "weights_dtype": "float16"})
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
    float32_dir = write_random_model(tmp_path / "f32", scaled_config("qwen2"))
    bfloat16_dir = write_random_model(tmp_path / "bf16", scaled_config("qwen2"), dtype=torch.bfloat16)
    assert publish_dtype("auto", float32_dir) == torch.float32
    assert publish_dtype("auto", bfloat16_dir) == torch.bfloat16, "a bf16 folder (as Qwen2.5's) is served in bf16"
    assert publish_dtype("float32", bfloat16_dir) == torch.float32
    assert publish_dtype("bfloat16", float32_dir) == torch.bfloat16


def test_torchrun_runs_the_module_on_several_local_ranks():
    assert torchrun_args(2, 29500) == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29500",
    ]


class NoSharedMemoryStub(RecordingStub):
    """A weights service on another host: it cannot open the rank's shared-memory file."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def UploadShards(self, requests, timeout=None, metadata=None):
        self.calls += 1
        requests = [r async for r in requests]
        if requests[0].header.shm_path:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=f"shm_path {requests[0].header.shm_path} does not exist",
            )

        async def again():
            for r in requests:
                yield r

        return await super().UploadShards(again(), timeout=timeout)


async def test_a_rank_whose_shared_memory_the_weights_service_cannot_read_streams_instead(mesh):
    stub = NoSharedMemoryStub()
    handoff = ShardHandoff(stub, SHAPE, rank=0, world_size=2, mode="shm", mesh=mesh, timeout=5.0)
    try:
        packed = handoff.pack(1, rank_shards(full_tensors(1), 2, 0))
        assert packed.header.shm_path
        reply = await handoff.upload(packed)
        assert reply.complete and stub.calls == 2 and handoff.mode == "stream"
        assert stub.requests[0].header.shm_path == "" and len(stub.requests) > 1
        del packed
        # Later versions stream at once, and the slots are gone.
        await handoff.upload(handoff.pack(2, rank_shards(full_tensors(2), 2, 0)))
        assert stub.calls == 3 and not list(SHM_DIR.glob(f"{SLOT_PREFIX}-{mesh}-*"))
    finally:
        handoff.close()
    # Refused for another reason: the rank reports it and keeps handing over through shared memory.
    failing = RecordingStub()
    failing.UploadShards = _always_invalid
    other = ShardHandoff(failing, SHAPE, rank=1, world_size=2, mode="shm", mesh=mesh, timeout=5.0)
    try:
        with pytest.raises(PublishError, match="rank 1: UploadShards of version 3 failed: INVALID_ARGUMENT: rank 1 of"):
            await other.upload(other.pack(3, rank_shards(full_tensors(3), 2, 1)))
        assert other.mode == "shm"
    finally:
        other.close()


async def _always_invalid(requests, timeout=None, metadata=None):
    raise grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="rank 1 of version 3 disagrees with the other ranks",
    )
