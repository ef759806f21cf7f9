"""One trainer rank's FSDP shards of a weight version as a flat payload, handed to the weights
service through a shared-memory file on the same host (or streamed in chunks across hosts)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlmesh.models.tp_layout import ModelShape, fsdp_rows
from rlmesh.transfer.payload import DTYPE_CODES, aligned, crc32, torch_dtype
from rlmesh.weights.v1 import weights_pb2

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class LocalShard:
    """The rows [row_start, row_end) of dim 0 of a parameter of shape `full_shape` that one rank holds."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    row_start: int
    row_end: int


def layout_to_proto(shape: ModelShape) -> weights_pb2.ModelLayout:
    return weights_pb2.ModelLayout(
        family=shape.family,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        num_hidden_layers=shape.num_layers,
        tie_word_embeddings=shape.tie_word_embeddings,
        attention_bias=shape.attention_bias,
    )


def layout_from_proto(layout: weights_pb2.ModelLayout) -> ModelShape:
    """Raises ValueError naming the field when the layout is incomplete or inconsistent."""
    return ModelShape(
        hidden_size=layout.hidden_size,
        num_heads=layout.num_attention_heads,
        num_kv_heads=layout.num_key_value_heads,
        head_dim=layout.head_dim,
        intermediate_size=layout.intermediate_size,
        vocab_size=layout.vocab_size,
        num_layers=layout.num_hidden_layers,
        tie_word_embeddings=layout.tie_word_embeddings,
        attention_bias=layout.attention_bias,
        family=layout.family,
    )


def shard_specs(
    shards: Mapping[str, LocalShard], dtype: torch.dtype | None = None
) -> tuple[list[weights_pb2.ShardSpec], int]:
    """Where each shard lies in the payload, and the payload's size; each shard is laid out in
    `dtype` (None: its own)."""
    specs, end = [], 0
    for name, shard in shards.items():
        stored = dtype or shard.tensor.dtype
        if stored not in DTYPE_CODES:
            raise ValueError(f"{name}: dtype {stored} is not supported")
        nbytes = shard.tensor.numel() * torch.empty(0, dtype=stored).element_size()
        offset = aligned(end)
        specs.append(
            weights_pb2.ShardSpec(
                name=name,
                dtype=DTYPE_CODES[stored],
                full_shape=list(shard.full_shape),
                row_start=shard.row_start,
                row_end=shard.row_end,
                offset=offset,
                nbytes=nbytes,
            )
        )
        end = offset + nbytes
    return specs, end


def write_payload(shards: Mapping[str, LocalShard], specs: list[weights_pb2.ShardSpec], target: torch.Tensor) -> int:
    """Copies the shards into `target` (uint8) at their offsets, each cast to its spec's dtype;
    returns the payload's crc32."""
    for spec, shard in zip(specs, shards.values()):
        if spec.nbytes:
            target[spec.offset : spec.offset + spec.nbytes].copy_(as_bytes(shard.tensor, torch_dtype(spec.dtype)))
    return crc32(target[: payload_bytes(specs)].numpy())


def as_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` cast to `dtype` (no copy if it is already), flat, as uint8 on its device."""
    return tensor.detach().to(dtype).contiguous().view(-1).view(torch.uint8)


def payload_bytes(specs: list[weights_pb2.ShardSpec]) -> int:
    return specs[-1].offset + specs[-1].nbytes if specs else 0


def validate_header(header: weights_pb2.ShardsHeader) -> ModelShape:
    """Raises ValueError unless the header describes `rank`'s FSDP rows of every parameter, laid
    out in order in a payload of total_bytes."""
    if header.version < 0:
        raise ValueError(f"version must be >= 0, got {header.version}")
    if header.world_size < 1 or header.rank >= header.world_size:
        raise ValueError(f"rank {header.rank} is outside a world of {header.world_size}")
    try:
        shape = layout_from_proto(header.layout)
    except ValueError as exc:
        raise ValueError(f"layout: {exc}") from exc
    end, names = 0, set()
    for spec in header.shards:
        if spec.name in names:
            raise ValueError(f"shard {spec.name} appears twice")
        names.add(spec.name)
        if spec.dtype not in DTYPE_CODES.values():
            raise ValueError(f"{spec.name}: unsupported dtype {spec.dtype}")
        if not spec.full_shape or any(d < 0 for d in spec.full_shape):
            raise ValueError(f"{spec.name}: bad full shape {list(spec.full_shape)}")
        expected_rows = fsdp_rows(spec.full_shape[0], header.world_size, header.rank)
        if (spec.row_start, spec.row_end) != expected_rows:
            raise ValueError(
                f"{spec.name}: rows [{spec.row_start}, {spec.row_end}) but FSDP rank {header.rank} of "
                f"{header.world_size} holds [{expected_rows[0]}, {expected_rows[1]})"
            )
        row_elements = int(np.prod(spec.full_shape[1:], dtype=np.int64)) if len(spec.full_shape) > 1 else 1
        expected = (
            (spec.row_end - spec.row_start)
            * row_elements
            * torch.empty(0, dtype=torch_dtype(spec.dtype)).element_size()
        )
        if spec.nbytes != expected:
            raise ValueError(f"{spec.name}: nbytes {spec.nbytes} does not match its rows and dtype ({expected})")
        if spec.offset != aligned(end):
            raise ValueError(f"{spec.name}: offset {spec.offset}, expected {aligned(end)}")
        end = spec.offset + spec.nbytes
    if end != header.total_bytes:
        raise ValueError(f"shards end at byte {end} but total_bytes is {header.total_bytes}")
    return shape


def shard_views(header: weights_pb2.ShardsHeader, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each shard as a tensor view into the payload (no copy)."""
    views = {}
    for spec in header.shards:
        rows = spec.row_end - spec.row_start
        raw = payload[spec.offset : spec.offset + spec.nbytes]
        views[spec.name] = raw.view(torch_dtype(spec.dtype)).view(rows, *spec.full_shape[1:])
    return views


class SharedMemorySlot:
    """A /dev/shm file mapped once and reused for many versions, so handing shards to the weights
    service on the same host costs one memcpy on each side and no socket."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.path = SHM_DIR / name
        self.nbytes = max(nbytes, 1)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor.zero_()

    def close(self) -> None:
        del self.tensor
        self._map.close()
        self.path.unlink(missing_ok=True)


def read_shared_memory(path: str, total_bytes: int, target: torch.Tensor) -> None:
    """Copies `total_bytes` from a shared-memory file into `target`; the file must lie under /dev/shm."""
    resolved = Path(path).resolve()
    if resolved.parent != SHM_DIR:
        raise ValueError(f"shm_path {path} is not a file directly under {SHM_DIR}")
    if not resolved.is_file():
        raise ValueError(f"shm_path {path} does not exist (is the trainer on another host? stream chunks instead)")
    if resolved.stat().st_size < total_bytes:
        raise ValueError(f"shm_path {path} holds {resolved.stat().st_size} bytes, fewer than total_bytes {total_bytes}")
    if total_bytes == 0:
        return
    with resolved.open("rb") as file, mmap.mmap(file.fileno(), total_bytes, access=mmap.ACCESS_READ) as mapped:
        source = np.frombuffer(mapped, dtype=np.uint8, count=total_bytes)
        target.numpy()[:total_bytes] = source
        # The mapping cannot close while an array still exports it.
        del source
