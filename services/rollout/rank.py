"""What every tensor-parallel rank holds, in the rollout process (rank 0) and in worker processes
alike: two model copies and its share of the KV cache with the operations of a decode step, and
the receiving end of weight pushes that loads verified tensors into the standby copy."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import torch
import torch.nn.functional as F
from transformers import AutoConfig, DynamicCache, PreTrainedModel

from rlmesh.common.v1 import common_pb2
from rlmesh.models.loading import load_weights
from rlmesh.models.tp_layout import ModelShape, hf_parameter_shapes, shard_full_tensors
from rlmesh.payload import pack_layout, unpack
from rlmesh.transfer.base import ReceiveBuffer, TransferError
from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import TcpListener
from services.rollout.tp_model import Collectives, RankLayout, build_rank_model

log = structlog.get_logger()

SWITCH_TIMEOUT_SECONDS = 30.0
"""How long a rank waits to catch up with a weight switch rank 0 already made."""
_RAW = (common_pb2.COMPRESSION_UNSPECIFIED, common_pb2.COMPRESSION_NONE)


@dataclass(frozen=True, slots=True)
class RankTransfer:
    """The data planes a rank offers for weight pushes; gRPC chunks are always accepted."""

    host: str = "127.0.0.1"
    """Interface the TCP receiver binds."""
    advertise_host: str = ""
    """Host senders are told (default: `host`); also the Mooncake endpoint's."""
    mooncake: bool = False
    mooncake_protocol: str = "tcp"
    tcp: bool = False

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0])


class KvBatch:
    """A rank's KV cache of the running sequences, right-aligned: row i's valid entries are the
    last ones (mask 1), padding is on the left (mask 0). Rows join by merging their prefill cache
    and leave by being dropped, at any decode step."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        """Position of the token each row feeds next."""

    def __len__(self) -> int:
        return self.positions.shape[0]

    def join(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if len(self) == 0:
            self.cache, self.mask, self.positions = cache, mask, positions
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, dim=2), _left_pad(theirs.keys, width, dim=2)])
            mine.values = torch.cat([_left_pad(mine.values, width, dim=2), _left_pad(theirs.values, width, dim=2)])
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(mask, width, dim=1)])
        self.positions = torch.cat([self.positions, positions])

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows)
        self.mask, self.positions = self.mask[index], self.positions[index]
        # Columns that only the departed rows used are dropped too, so the cache shrinks.
        first = int((self.mask.sum(0) > 0).nonzero()[0])
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]


class RankRunner:
    """A rank's active and standby models and its KV cache. Rank 0 calls these operations from its
    decode thread; workers replay the same calls in the same order, so every rank's cache holds
    the same rows and every collective finds its peers. Each returns full last-position logits."""

    def __init__(self, active: PreTrainedModel, standby: PreTrainedModel, version: int) -> None:
        self.active = active
        self.standby = standby
        self.version = version
        self.batch = KvBatch()
        self._switched = threading.Condition()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.active(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.batch.join(out.past_key_values, mask, positions[:, -1] + 1)
        return out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=batch.mask.dtype)], dim=1)
        out = self.active(input_ids=tokens[:, None], attention_mask=batch.mask, position_ids=batch.positions[:, None],
                          past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
        batch.cache = out.past_key_values
        batch.positions = batch.positions + 1
        return out.logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        self.batch.keep(rows)

    def clear(self) -> None:
        self.batch.clear()

    def switch(self, version: int) -> None:
        with self._switched:
            self.active, self.standby = self.standby, self.active
            self.version = version
            self._switched.notify_all()

    def wait_served(self, version: int, timeout: float = SWITCH_TIMEOUT_SECONDS) -> None:
        """Returns once this rank serves `version` or newer: its standby copy is then free."""
        with self._switched:
            if not self._switched.wait_for(lambda: self.version >= version, timeout):
                raise TransferError(f"rank still serves version {self.version}, not {version}, after {timeout} s")


class RankHandle(Protocol):
    """A rank's weight operations, in-process (RankWeights) or in a worker process (tp_group.Worker)."""

    rank: int

    def prepare(self, manifest: common_pb2.WeightManifest, load: bool, after_version: int) -> RankPort: ...

    def write(self, version: int, offset: int, data: bytes, compression: int = ..., raw_bytes: int = ..., base_version: int = ...) -> None: ...

    def verify(self, version: int, timeout: float) -> list[int]: ...

    def finish(self, version: int) -> None: ...

    def stage(self, tensors: Mapping[str, torch.Tensor], after_version: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RankPort:
    """Where one rank receives a version (a RankEndpoint of BeginWeightUpdateResponse)."""

    tp_rank: int
    transfer_session: str
    buffer_address: int
    buffer_bytes: int
    data_address: str
    held_version: int


class _StandbyLoad:
    """One version on its way into a standby model: each tensor is copied as soon as every bucket
    it spans passed its check, the rest when the version is complete."""

    def __init__(self, layout: RankLayout, model: PreTrainedModel, manifest: common_pb2.WeightManifest, buffer: torch.Tensor) -> None:
        self.manifest = manifest
        self.layout = layout
        self.params = dict(model.named_parameters())
        self.tensors = unpack(manifest, buffer)
        self.missing: dict[str, int] = {}
        """Buckets each tensor still waits for."""
        self.by_bucket: dict[int, list[str]] = defaultdict(list)
        self.loaded: set[str] = set()
        size = manifest.bucket_bytes
        for spec in manifest.tensors:
            buckets = range(spec.offset // size, (spec.offset + spec.nbytes - 1) // size + 1)
            self.missing[spec.name] = len(buckets)
            for bucket in buckets:
                self.by_bucket[bucket].append(spec.name)

    def bucket(self, bucket: int) -> None:
        for name in self.by_bucket.pop(bucket, ()):
            self.missing[name] -= 1
            if self.missing[name] == 0:
                self._copy(name)

    def rest(self) -> int:
        """Copies what is left; returns how many tensors were already loaded before."""
        early = len(self.loaded)
        for name in self.missing.keys() - self.loaded:
            self._copy(name)
        return early

    def _copy(self, name: str) -> None:
        self.layout.load(self.params, name, self.tensors[name])
        self.loaded.add(name)


class RankWeights:
    """One rank's receiving end of weight pushes: a receiver over a buffer allocated (and, with
    Mooncake, registered) once, its TCP listener, and the loading of verified tensors into the
    rank's standby model while the rest of the version is still arriving."""

    def __init__(self, rank: int, transfer: RankTransfer, runner: RankRunner | None = None, layout: RankLayout | None = None,
                 expected_bytes: int = 0) -> None:
        self.rank = rank
        self.runner = runner
        self.layout = layout
        buffer = ReceiveBuffer()
        self.session = ""
        if transfer.mooncake:
            from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeReceiveBuffer

            endpoint = MooncakeEndpoint(transfer.advertised_host, transfer.mooncake_protocol)
            buffer, self.session = MooncakeReceiveBuffer(endpoint), endpoint.session
        # Allocated and touched now, so the first push pays neither page faults nor registration.
        buffer.ensure(expected_bytes)
        self.receiver = RankReceiver(rank, buffer)
        self.receiver.on_bucket = self._bucket_verified
        self.tcp = TcpListener(transfer.host, self.receiver, transfer.advertised_host) if transfer.tcp else None
        self._lock = threading.Lock()
        self._load: _StandbyLoad | None = None

    def prepare(self, manifest: common_pb2.WeightManifest, load: bool, after_version: int) -> RankPort:
        """Arms the receiver for a version. With `load`, verified tensors go into the standby model
        as they land, once this rank serves `after_version` (its standby copy is then unused)."""
        if load:
            self.runner.wait_served(after_version)
        with self._lock:
            held = self.receiver.prepare(manifest)
            buffer = self.receiver.buffer
            self._load = _StandbyLoad(self.layout, self.runner.standby, manifest, buffer.tensor) if load else None
        return RankPort(self.rank, self.session, buffer.address if self.session else 0, buffer.tensor.numel(),
                        self.tcp.address if self.tcp else "", held)

    def write(self, version: int, offset: int, data: bytes, compression: int = common_pb2.COMPRESSION_NONE, raw_bytes: int = 0,
              base_version: int = -1) -> None:
        if compression not in _RAW:
            self.receiver.write(version, offset, data, compression, raw_bytes, base_version)
            return
        if raw_bytes and raw_bytes != len(data):
            raise TransferError(f"raw chunk of {len(data)} bytes declares {raw_bytes}")
        manifest = self.receiver.manifest
        if manifest is None:
            raise TransferError(f"rank {self.rank} expects no version, got bytes of version {version}")
        # Raw chunks (gRPC messages) need not follow bucket boundaries; the receiver counts per bucket.
        view, done = memoryview(data), 0
        while done < len(view):
            size = min(len(view) - done, manifest.bucket_bytes - (offset + done) % manifest.bucket_bytes)
            self.receiver.write(version, offset + done, view[done : done + size])
            done += size

    def verify(self, version: int, timeout: float) -> list[int]:
        """Waits for every bucket's check; returns the missing or corrupted ones."""
        return self.receiver.wait_verified(version, timeout)

    def finish(self, version: int) -> None:
        """Loads what the pipelined load has not yet: the standby model then holds `version`."""
        with self._lock:
            load = self._load
            if load is None or load.manifest.version != version or self.receiver.held_version != version:
                raise TransferError(f"rank {self.rank} holds no verified version {version} to load")
            early = load.rest()
            self._load = None
        log.info("standby loaded", tp_rank=self.rank, weight_version=version, tensors=len(load.missing), loaded_while_receiving=early)

    def stage(self, tensors: Mapping[str, torch.Tensor], after_version: int) -> None:
        """Loads this rank's tensors given whole (not through the receiver) into the standby model."""
        self.runner.wait_served(after_version)
        with self._lock:
            self._load = None
            params = dict(self.runner.standby.named_parameters())
            for name, tensor in tensors.items():
                self.layout.load(params, name, tensor)

    def loading(self) -> tuple[int, int]:
        """(tensors already in the standby copy, tensors of the version being received); (0, 0) if none."""
        with self._lock:
            load = self._load
            return (len(load.loaded), len(load.missing)) if load else (0, 0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The verified payload's tensors, as views into the buffer."""
        return self.receiver.tensors()

    def _bucket_verified(self, manifest: common_pb2.WeightManifest, bucket: int) -> None:
        # Runs on the receiver's verifier thread, which must survive whatever happens here.
        try:
            with self._lock:
                if self._load is not None and self._load.manifest is manifest:
                    self._load.bucket(bucket)
        except Exception:
            log.exception("loading a verified bucket failed; the commit will load it again", tp_rank=self.rank, bucket=bucket)

    def close(self) -> None:
        if self.tcp:
            self.tcp.close()
        self.receiver.close()


def build_rank(model_dir: str | Path, collectives: Collectives, transfer: RankTransfer, version: int) -> tuple[RankRunner, RankWeights]:
    """A rank's two model copies, cut from the model folder's full weights, and its receiving end."""
    config = AutoConfig.from_pretrained(model_dir)
    shape = ModelShape.from_hf_config(config)
    layout = RankLayout(shape, collectives.size)
    full = load_weights(model_dir, hf_parameter_shapes(shape).keys())
    tensors = shard_full_tensors(full, shape, collectives.size, collectives.rank)
    del full
    models = []
    for _ in range(2):
        model = build_rank_model(config, collectives)
        layout.check(model)
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            layout.load(params, name, tensor)
        models.append(model)
    runner = RankRunner(models[0], models[1], version)
    expected = pack_layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, version).total_bytes
    return runner, RankWeights(collectives.rank, transfer, runner, layout, expected)
