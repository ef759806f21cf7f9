"""What every tensor-parallel rank holds, in the rollout process (rank 0) and in worker processes
alike: two model copies and its share of the KV cache with the operations of a decode step, and
the receiving end of weight pushes, which land in the standby copy's own memory (on a GPU, in
its pinned host staging buffer, then copied to the device)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from rlmesh.common.v1 import common_pb2
from rlmesh.lifecycle import return_freed_memory
from rlmesh.models.loading import load_weights, serving_config, weights_dtype
from rlmesh.models.tp_layout import ModelShape, hf_parameter_shapes, shard_full_tensors
from rlmesh.transfer.auth import new_secret
from rlmesh.transfer.base import ReceiveBuffer, TransferError, background_thread
from rlmesh.transfer.payload import bucket_ranges, pack_layout, unpack
from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import TcpListener
from services.rollout.torch.tp_model import Collectives, RankLayout, build_rank_model

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

log = structlog.get_logger()

SWITCH_TIMEOUT_SECONDS = 30.0
"""How long a rank waits to catch up with a weight switch rank 0 already made."""
_RAW = (common_pb2.COMPRESSION_UNSPECIFIED, common_pb2.COMPRESSION_NONE)
CPU = torch.device("cpu")
"""Where a rank runs unless it is given a GPU."""


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
    background: bool = True
    """Receiving, checking and catch-up copies run on idle-class threads."""
    catch_up_delay_seconds: float = 1.0
    """On a delta link, how long after a switch the standby copy starts catching up with the
    served one, unless the next version begins first."""

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host


GRPC_ONLY = RankTransfer()
"""The default data planes: weight pushes arrive as gRPC chunks only (no TCP receiver, no Mooncake)."""


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0])


class KvBatch:
    """A rank's KV cache of the running sequences, right-aligned: row i's valid entries are the
    last ones (mask 1), padding is on the left (mask 0). Rows join by merging their prefill cache
    and leave by being dropped, at any decode step."""

    def __init__(self, device: torch.device = CPU) -> None:
        self.device = device
        self.clear()

    def clear(self) -> None:
        # Imported here: transformers' modeling code costs seconds to import, and an instance whose
        # engine builds no model (synthetic) need not pay for it.
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
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
        index = torch.tensor(rows, device=self.device)
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
    the same rows and every collective finds its peers. Each returns full last-position logits, on
    the rank's device; inputs may come from the host."""

    def __init__(
        self,
        active: PreTrainedModel,
        standby: PreTrainedModel,
        version: int,
        device: torch.device = CPU,
    ) -> None:
        self.active = active
        self.standby = standby
        self.version = version
        self.device = device
        self.batch = KvBatch(device)
        self.prefixes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """KV caches of finished turns of sessions, by cache key, per layer (keys, values)."""
        self.on_switch: Callable[[], None] | None = None
        """Called after each switch, before the new version counts as served."""
        self._switched = threading.Condition()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids, mask, positions = (t.to(self.device, non_blocking=True) for t in (ids, mask, positions))
        out = self.active(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.batch.join(out.past_key_values, mask, positions[:, -1] + 1)
        return out.logits[:, -1]

    def save_prefix(self, key: str, row: int) -> None:
        """Keeps a finishing row's KV cache (its valid, right-aligned entries) under `key`."""
        valid = int(self.batch.mask[row].sum())
        self.prefixes[key] = [
            (layer.keys[row : row + 1, :, -valid:].clone(), layer.values[row : row + 1, :, -valid:].clone())
            for layer in self.batch.cache.layers
        ]

    def drop_prefix(self, key: str | None) -> None:
        """Forgets one kept KV cache, or all of them (None)."""
        if key is None:
            self.prefixes.clear()
        else:
            self.prefixes.pop(key, None)

    @torch.inference_mode()
    def prefill_prefixed(self, key: str, suffix: torch.Tensor) -> torch.Tensor:
        """Prefills one sequence whose context begins with the KV cache kept under `key` (taken):
        only `suffix` [1, S] runs through the model; the row then joins the batch."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.prefixes.pop(key)):
            cache.update(keys, values, index)
        kept = cache.get_seq_length()
        suffix = suffix.to(self.device, non_blocking=True)
        width = kept + suffix.shape[1]
        mask = torch.ones(1, width, dtype=torch.long, device=self.device)
        positions = torch.arange(kept, width, device=self.device)[None]
        out = self.active(
            input_ids=suffix,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.batch.join(out.past_key_values, mask, positions[:, -1] + 1)
        return out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        tokens = tokens.to(self.device, non_blocking=True)
        batch.mask = torch.cat(
            [batch.mask, torch.ones(len(batch), 1, dtype=batch.mask.dtype, device=self.device)], dim=1
        )
        out = self.active(
            input_ids=tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
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
            # Before anyone waiting for this version may touch the new standby copy.
            if self.on_switch is not None:
                self.on_switch()
            self._switched.notify_all()

    def wait_served(self, version: int, timeout: float = SWITCH_TIMEOUT_SECONDS) -> None:
        """Returns once this rank serves `version` or newer: its standby copy is then free."""
        with self._switched:
            if not self._switched.wait_for(lambda: self.version >= version, timeout):
                raise TransferError(f"rank still serves version {self.version}, not {version}, after {timeout} s")


class RankHandle(Protocol):
    """A rank's weight operations, in-process (RankWeights) or in a worker process (tp_group.Worker)."""

    rank: int

    def prepare(
        self,
        manifest: common_pb2.WeightManifest,
        load: bool,
        after_version: int,
        keep_base: bool = False,
        proven_at_commit: bool = False,
    ) -> RankPort: ...

    def write(
        self,
        version: int,
        offset: int,
        data: bytes,
        compression: int = ...,
        raw_bytes: int = ...,
        base_version: int = ...,
    ) -> None: ...

    def verify(self, version: int, timeout: float, proof: bytes = b"") -> list[int]: ...

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
    session_secret: bytes


class ModelSlot:
    """A model copy whose parameters are views into one flat buffer laid out as a rank payload.
    On the CPU that buffer is the pre-faulted receive buffer itself: a push lands straight in the
    parameters, and nothing is copied after the transfer. On a GPU a push lands in the pinned host
    buffer, and once every bucket is checked each bucket is copied once into the device buffer the
    parameters view (`upload`), on a stream of its own so decoding on the other copy goes on."""

    def __init__(
        self,
        model: PreTrainedModel,
        layout: RankLayout,
        buffer: ReceiveBuffer,
        device: torch.device = CPU,
    ) -> None:
        self.model = model
        self.layout = layout
        self.buffer = buffer
        self.device_bytes = None if device.type == "cpu" else torch.zeros(0, dtype=torch.uint8, device=device)
        """The parameters' memory on a GPU; None on the CPU, where they view `buffer`."""
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.held_version = -1
        """The version whose checked payload bytes the buffer holds; -1 while none is known."""
        self.manifest: common_pb2.WeightManifest | None = None
        """The payload layout the parameters are laid over."""
        self._params = dict(model.named_parameters())

    def bind(self, manifest: common_pb2.WeightManifest) -> None:
        """Lays the parameters over the buffer where `manifest` places the payload's tensors; if
        they move (another layout, a bigger buffer) the buffer holds no known version any more."""
        moved = self.buffer.ensure(manifest.total_bytes)
        if self.device_bytes is not None and self.device_bytes.numel() < manifest.total_bytes:
            self.device_bytes = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device_bytes.device)
            moved = True
        moved = moved or self.manifest is None or _placements(self.manifest) != _placements(manifest)
        if moved:
            memory = self.buffer.tensor if self.device_bytes is None else self.device_bytes
            with torch.no_grad():
                for name, tensor in unpack(manifest, memory).items():
                    for target, start, end in self.layout.targets[name]:
                        self._params[target].data = tensor[start:end]
            self.held_version = -1
        self.manifest = manifest

    def upload(self) -> None:
        """On a GPU: copies the checked payload from the pinned host buffer into the parameters'
        device memory, one asynchronous copy per bucket, and returns once all have landed."""
        if self.device_bytes is None:
            return
        assert self.manifest is not None
        host, device = self.buffer.tensor, self.device_bytes
        with torch.cuda.stream(self._copies):
            for start, end in bucket_ranges(self.manifest.total_bytes, self.manifest.bucket_bytes):
                device[start:end].copy_(host[start:end], non_blocking=host.is_pinned())
        self._copies.synchronize()

    def copy_from(self, other: ModelSlot) -> None:
        """Makes this copy hold what `other` holds, byte for byte."""
        assert other.manifest is not None
        self.bind(other.manifest)
        size = other.manifest.total_bytes
        # numpy copies on the calling thread, which keeps the copy at that thread's priority.
        np.copyto(self.buffer.tensor[:size].numpy(), other.buffer.tensor[:size].numpy())
        if self.device_bytes is not None:
            with torch.cuda.stream(self._copies):
                self.device_bytes[:size].copy_(other.device_bytes[:size])
            self._copies.synchronize()
        self.held_version = other.held_version


def _placements(manifest: common_pb2.WeightManifest) -> list[tuple]:
    return [(s.name, s.offset, s.dtype, tuple(s.shape)) for s in manifest.tensors]


class RankWeights:
    """One rank's receiving end of weight pushes: its two model copies' buffers (with Mooncake,
    registered once), its TCP listener, and the checks that let a version in. A version lands in
    the standby copy's own memory; on a delta link, after each switch the new standby copy catches
    up with the served one in the background, so it is the base the next delta applies to."""

    def __init__(
        self,
        rank: int,
        transfer: RankTransfer,
        runner: RankRunner | None = None,
        layout: RankLayout | None = None,
        manifest: common_pb2.WeightManifest | None = None,
    ) -> None:
        """`manifest`: the payload layout the models' parameters are laid over at first."""
        self.rank = rank
        self.runner = runner
        self.layout = layout
        self.session = ""
        self._endpoint = None
        if transfer.mooncake:
            from rlmesh.transfer.mooncake import MooncakeEndpoint

            self._endpoint = MooncakeEndpoint(transfer.advertised_host, transfer.mooncake_protocol)
            self.session = self._endpoint.session
        self._slots: dict[int, ModelSlot] = {}
        self._pinned = runner is not None and runner.device.type == "cuda"
        if runner is not None and layout is not None and manifest is not None:
            for model in (runner.active, runner.standby):
                slot = self._slots[id(model)] = ModelSlot(model, layout, self._new_buffer(self._pinned), runner.device)
                slot.bind(manifest)
            runner.on_switch = self._switched
        self._full: ReceiveBuffer | None = None
        """Where full tensors (WEIGHT_LAYOUT_FULL) land before the engine cuts them: made on first use."""
        self.receiver = RankReceiver(rank, background=transfer.background)
        self.tcp = TcpListener(transfer.host, self.receiver, transfer.advertised_host) if transfer.tcp else None
        self._lock = threading.Lock()
        self._receiving: ModelSlot | None = None
        self._keep_base = False
        self._catch_up_delay = transfer.catch_up_delay_seconds
        self._catching_up: threading.Thread | None = None
        self._base_needed = threading.Event()
        self._closed = False

    def _new_buffer(self, pinned: bool = False) -> ReceiveBuffer:
        if self._endpoint is None:
            return ReceiveBuffer(pinned)
        from rlmesh.transfer.mooncake import MooncakeReceiveBuffer

        return MooncakeReceiveBuffer(self._endpoint, pinned)

    @property
    def standby(self) -> ModelSlot:
        return self._slots[id(self.runner.standby)]

    def prepare(
        self,
        manifest: common_pb2.WeightManifest,
        load: bool,
        after_version: int,
        keep_base: bool = False,
        proven_at_commit: bool = False,
    ) -> RankPort:
        """Arms the receiver for a version under a new push session secret. With `load` it lands in
        the standby model itself, once this rank serves `after_version` (its standby copy is then
        unused) and that copy caught up; without, in a separate buffer of full tensors. `keep_base`:
        once the version is served, copy it into the new standby buffer, the base of the next
        delta. `proven_at_commit`: the transfer engine writes it, and the commit proves the bytes."""
        if load:
            self.runner.wait_served(after_version)
            self._wait_caught_up()
        with self._lock:
            self._keep_base = keep_base and load
            if load:
                slot = self._receiving = self.standby
                slot.bind(manifest)
                base, slot.held_version = slot.held_version, -1
                buffer = slot.buffer
            else:
                self._receiving = None
                buffer = self._full = self._full or self._new_buffer()
                buffer.ensure(manifest.total_bytes)
                base = -1
            secret = new_secret()
            self.receiver.prepare(manifest, buffer, base, secret, proven_at_commit)
        return RankPort(
            self.rank,
            self.session,
            buffer.address if self.session else 0,
            buffer.tensor.numel(),
            self.tcp.address if self.tcp else "",
            base,
            secret,
        )

    def write(
        self,
        version: int,
        offset: int,
        data: bytes,
        compression: int = common_pb2.COMPRESSION_NONE,
        raw_bytes: int = 0,
        base_version: int = -1,
    ) -> None:
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

    def verify(self, version: int, timeout: float, proof: bytes = b"") -> list[int]:
        """Waits for every bucket's check; returns the missing or corrupted ones. Raises
        UnprovenPayload when the version's commit must prove its bytes and `proof` does not."""
        return self.receiver.wait_verified(version, timeout, proof)

    def finish(self, version: int) -> None:
        """Records that the standby model holds `version`, every bucket checked: it may switch."""
        with self._lock:
            slot = self._receiving
            manifest = self.receiver.manifest
            if slot is None or manifest is None or manifest.version != version or self.receiver.held_version != version:
                raise TransferError(f"rank {self.rank} holds no verified version {version} in its standby copy")
            slot.upload()
            slot.held_version = version
            self._receiving = None

    def stage(self, tensors: Mapping[str, torch.Tensor], after_version: int) -> None:
        """Copies this rank's tensors given whole (not through the receiver) into the standby model."""
        self.runner.wait_served(after_version)
        self._wait_caught_up()
        with self._lock:
            self._receiving = None
            slot = self.standby
            slot.held_version = -1
            params = dict(slot.model.named_parameters())
            for name, tensor in tensors.items():
                self.layout.load(params, name, tensor)

    def loading(self) -> tuple[int, int]:
        """(buckets of the version being received already checked in place, all its buckets); (0, 0) if none."""
        with self._lock:
            receiving = self._receiving is not None
        return self.receiver.progress() if receiving else (0, 0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The verified payload's tensors, as views into the buffer."""
        return self.receiver.tensors()

    def _switched(self) -> None:
        # On the decode thread, right after a switch: the copy runs elsewhere, at low priority,
        # and only for delta links (it costs a pass over the model's memory, which decoding shares).
        if not self._keep_base:
            return
        self._base_needed.clear()
        self._catching_up = threading.Thread(target=self._catch_up, name=f"catch-up-rank{self.rank}", daemon=True)
        self._catching_up.start()

    def _catch_up(self) -> None:
        if self.receiver.background:
            background_thread()
        # A push goes to every instance at once: copying right after this one switched would take
        # memory bandwidth from the others still receiving (on this host: 0.1 s of a 0.35 s push).
        self._base_needed.wait(self._catch_up_delay)
        with self._lock:
            if self._closed:
                return
            active = self._slots[id(self.runner.active)]
            try:
                self.standby.copy_from(active)
            except Exception:
                self.standby.held_version = -1
                log.exception("the standby copy could not catch up; the next version goes in full", tp_rank=self.rank)

    def _wait_caught_up(self) -> None:
        catching_up = self._catching_up
        if catching_up is not None:
            self._base_needed.set()
            catching_up.join()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._base_needed.set()
        if self.tcp:
            self.tcp.close()
        self.receiver.close()


def build_rank(
    model_dir: str | Path,
    collectives: Collectives,
    transfer: RankTransfer,
    version: int,
    device: torch.device = CPU,
    dtype: torch.dtype | None = None,
) -> tuple[RankRunner, RankWeights]:
    """A rank's two model copies on `device`, cut from the model folder's full weights, and its
    receiving end. `dtype`: what the copies hold and pushes carry (None: the folder's dtype)."""
    config = serving_config(model_dir, dtype)
    shape = ModelShape.from_hf_config(config)
    layout = RankLayout(shape, collectives.size)
    full = load_weights(model_dir, hf_parameter_shapes(shape).keys())
    tensors = {
        name: t.to(weights_dtype(config))
        for name, t in shard_full_tensors(full, shape, collectives.size, collectives.rank).items()
    }
    del full
    manifest = pack_layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, version)
    models = [build_rank_model(config, collectives).to(device) for _ in range(2)]
    for model in models:
        layout.check(model)
    runner = RankRunner(models[0], models[1], version, device)
    weights = RankWeights(collectives.rank, transfer, runner, layout, manifest)
    for model in models:
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            layout.load(params, name, tensor)
    del tensors
    return_freed_memory()
    return runner, weights
