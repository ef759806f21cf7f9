"""The WeightsService servicer: receives sharded and full uploads into the store and reports push state."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import structlog
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import DomainError, InvalidArgument
from rlmesh.models.tp_layout import hf_parameter_shapes
from rlmesh.rpc.prometheus import Families
from rlmesh.transfer.payload import DTYPE_CODES, torch_dtype
from rlmesh.transfer.receiver import CODE_OF_MODE
from rlmesh.transfer.shards import layout_from_proto, read_shared_memory
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.weights.pusher import Pusher
from services.weights.store import Assembly, WeightStore

log = structlog.get_logger()

MAX_BUCKETS = 1 << 18
"""Most checksum buckets a payload may have (1 TiB in the default 4 MiB buckets): checking a
manifest lists its buckets, so a tiny bucket size must not make that list unbounded."""


def check_buckets(manifest: common_pb2.WeightManifest, label: str) -> None:
    """Refuses a manifest whose bucket count is unbounded or disagrees with its checksums, before
    anything lists its buckets."""
    if manifest.bucket_bytes <= 0:
        return
    buckets = -(-manifest.total_bytes // manifest.bucket_bytes)
    if buckets > MAX_BUCKETS:
        raise InvalidArgument(
            f"{label}: {manifest.total_bytes} bytes in buckets of {manifest.bucket_bytes} make {buckets} buckets, "
            f"more than {MAX_BUCKETS}"
        )
    if buckets != len(manifest.bucket_crc32):
        raise InvalidArgument(f"{label}: {len(manifest.bucket_crc32)} bucket checksums for {buckets} buckets")


def check_layout(header: weights_pb2.ShardsHeader, max_bytes: int) -> None:
    """Refuses a header whose layout could not be held or listed, before anything is built from it:
    a rank may hold no rows of a model of any size, yet every layout a version is cut into is
    allocated in full, and listing a layout's parameters takes time in its number of layers."""
    try:
        shape = layout_from_proto(header.layout)
        # A layout grows linearly with its layers: two small ones give the size of any.
        one, two = (hf_parameter_shapes(replace(shape, num_layers=n)) for n in (1, 2))
    except ValueError as exc:
        raise InvalidArgument(f"shards header: layout: {exc}") from exc
    more = shape.num_layers - 1
    parameters = len(one) + more * (len(two) - len(one))
    if parameters > len(header.shards):
        raise InvalidArgument(
            f"shards header: the layout has {parameters} parameters "
            f"but the header lists only {len(header.shards)} shards"
        )
    elements = [sum(math.prod(dims) for dims in shapes.values()) for shapes in (one, two)]
    dtype = next(
        (torch_dtype(spec.dtype) for spec in header.shards if spec.dtype in DTYPE_CODES.values()), torch.float32
    )
    total = (elements[0] + more * (elements[1] - elements[0])) * torch.empty(0, dtype=dtype).element_size()
    if total > max_bytes:
        raise InvalidArgument(f"shards header: the layout's model takes {total} bytes, over the limit of {max_bytes}")


class WeightsServicer(weights_pb2_grpc.WeightsServiceServicer):
    def __init__(self, store: WeightStore, pusher: Pusher, backend_name: str) -> None:
        self.store = store
        self.pusher = pusher
        self.backend_name = backend_name
        self._applying: dict[int, list[asyncio.Future[None]]] = {}
        self._background: set[asyncio.Future[None]] = set()
        self._storing: set[int] = set()
        """Versions whose every rank arrived, being installed."""

    async def UploadShards(self, request_iterator, context):
        header = None
        payload = None
        received = 0
        async for message in request_iterator:
            if header is None:
                if not message.HasField("header"):
                    raise InvalidArgument("the first message of a shard upload must carry the header")
                header = message.header
                earlier = self.store.earlier_upload(header)
                if earlier is not None:
                    async for _ in request_iterator:
                        pass
                    log.info(
                        "an upload already taken came again; answered as before",
                        weight_version=header.version,
                        rank=header.rank,
                    )
                    return weights_pb2.UploadShardsResponse(
                        version=header.version, ranks_received=earlier[0], complete=earlier[1]
                    )
                check_layout(header, self.store.max_bytes)
                self.store.check_shards(header)
                payload = self.store.shard_buffer(header)
                if header.shm_path:
                    try:
                        await asyncio.to_thread(read_shared_memory, header.shm_path, header.total_bytes, payload)
                    except (ValueError, OSError) as exc:
                        raise InvalidArgument(f"shm_path: {exc}") from exc
                    received = header.total_bytes
            elif not message.HasField("chunk"):
                raise InvalidArgument("only payload chunks may follow the header")
            elif header.shm_path:
                raise InvalidArgument("chunks may not follow a header that names a shared-memory file")
            else:
                chunk = message.chunk
                if chunk.offset != received or chunk.offset + len(chunk.data) > header.total_bytes:
                    raise InvalidArgument(
                        f"chunk [{chunk.offset}, {chunk.offset + len(chunk.data)}) does not continue the "
                        f"{received} bytes received of {header.total_bytes}"
                    )
                payload.numpy()[chunk.offset : chunk.offset + len(chunk.data)] = memoryview(chunk.data)
                received += len(chunk.data)
        if header is None:
            raise InvalidArgument("the shard upload stream was empty")
        if received != header.total_bytes:
            raise InvalidArgument(
                f"rank {header.rank} of version {header.version} ended after {received} of {header.total_bytes} bytes"
            )
        await asyncio.to_thread(self.store.check_payload, header, payload)
        assembly = self.store.add_shards(header, payload)
        # The rank's rows go into the payloads of the layouts in use while the other ranks upload;
        # the reply does not wait for that, so the trainer goes on at once.
        self._applying.setdefault(assembly.version, []).append(
            asyncio.ensure_future(asyncio.to_thread(assembly.apply_rank, header.rank))
        )
        if assembly.complete:
            # Counted as being stored before the reply: the trainer publishes the version next.
            self._storing.add(assembly.version)
            self._background.add(asyncio.ensure_future(self._install(assembly)))
        return weights_pb2.UploadShardsResponse(
            version=header.version, ranks_received=len(assembly.headers), complete=assembly.complete
        )

    async def _install(self, assembly: Assembly) -> None:
        try:
            await asyncio.gather(*self._applying.pop(assembly.version, []))
            for version in [v for v in self._applying if v < assembly.version]:
                del self._applying[version]
            snapshot = await asyncio.to_thread(self.store.finish_assembly, assembly)
            self.store.drop_previous()
            base = self.store.acquire()
            try:
                await asyncio.to_thread(self.pusher.encode_ahead, snapshot, base, self.pusher.compressed_links())
            finally:
                if base is not None:
                    self.store.release(base)
            self.store.install(snapshot)
        except DomainError as exc:
            log.warning("version not stored", weight_version=assembly.version, error=str(exc))
            return
        finally:
            self._storing.discard(assembly.version)
            self._background.discard(asyncio.current_task())
        log.info(
            "version stored",
            weight_version=snapshot.version,
            ranks=assembly.world_size,
            bytes=snapshot.total_bytes,
            prebuilt_layouts=sorted(snapshot.payloads),
        )
        self.pusher.trigger()

    async def UploadWeights(self, request_iterator, context):
        upload = None
        async for message in request_iterator:
            if upload is None:
                if not message.HasField("manifest"):
                    raise InvalidArgument("the first message of an upload must carry the manifest")
                check_buckets(message.manifest, "manifest")
                upload = self.store.begin_upload(message.manifest)
            elif message.HasField("chunk"):
                upload.write(message.chunk.offset, message.chunk.data)
            else:
                raise InvalidArgument("only payload chunks may follow the manifest")
        if upload is None:
            raise InvalidArgument("the upload stream was empty")
        snapshot = self.store.finish(upload)
        log.info("version stored", weight_version=snapshot.version, bytes=snapshot.total_bytes)
        self.pusher.trigger()
        return weights_pb2.UploadWeightsResponse(version=snapshot.version, received_bytes=upload.received)

    async def GetStatus(self, request, context):
        latest = self.store.latest
        return weights_pb2.GetStatusResponse(
            latest_version=latest.version if latest else -1,
            latest_bytes=latest.total_bytes if latest else 0,
            storing_version=max(self._storing, default=-1),
            backend=self.backend_name,
            instances=[
                weights_pb2.InstancePush(
                    instance_id=s.instance_id,
                    committed_version=s.committed_version,
                    pushing_version=s.pushing_version,
                    last_push_ms=s.last_push_ms,
                    last_push_gbps=s.last_push_gbps,
                    failures=s.failures,
                    last_error=s.last_error,
                    tensor_parallel_size=s.tensor_parallel_size,
                    compression=CODE_OF_MODE[s.compression],
                    compression_ratio=s.compression_ratio,
                    encode_ms=s.encode_ms,
                    max_abs_error=s.max_abs_error,
                    relative_rms_error=s.relative_rms_error,
                    superseded=s.superseded,
                    last_version_latency_ms=s.last_version_latency_ms,
                )
                for s in self.pusher.instances.values()
            ],
        )

    async def collect_metrics(self, families: Families) -> None:
        """What Prometheus scrapes: the figures of GetStatus, per instance for the pushes."""
        status = await self.GetStatus(weights_pb2.GetStatusRequest(), None)
        families.gauge("latest_version", "Newest weight version stored (-1: none yet).", status.latest_version)
        families.gauge("latest_bytes", "Bytes of the newest version stored.", status.latest_bytes)
        for push in status.instances:
            labels = {"instance": push.instance_id}
            families.gauge(
                "committed_version", "Version the instance confirmed it serves.", push.committed_version, **labels
            )
            families.gauge(
                "push_seconds", "Duration of the last push to the instance.", push.last_push_ms / 1e3, **labels
            )
            families.gauge("push_gbps", "GB/s of the last push to the instance.", push.last_push_gbps, **labels)
            families.gauge(
                "stored_to_served_seconds",
                "From the last version pushed being stored to the instance serving it.",
                push.last_version_latency_ms / 1e3,
                **labels,
            )
            families.gauge(
                "compression_ratio", "Payload bytes over bytes sent in the last push.", push.compression_ratio, **labels
            )
            families.counter("push_failures", "Pushes to the instance that failed.", push.failures, **labels)
            families.counter(
                "pushes_superseded", "Pushes abandoned because a newer version arrived.", push.superseded, **labels
            )
