"""The weight path on one machine: a version handed over through shared memory to the weights
service, pushed over TCP to a torch-engine instance (its pinned staging buffer, then the device),
committed; against a plain device-to-host copy plus a loopback socket of the same bytes. Also the
instance's decode tokens/s at several batch sizes, and at the largest while versions are pushed."""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from bench.common import BenchAuth
from bench.weights import Generation, raw_socket_gbps
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, spawn_service, stop_children, wait_started
from rlmesh.models.loading import load_weights
from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes
from rlmesh.rpc.authz import Role
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.transfer.payload import stream_chunks
from rlmesh.transfer.shards import SHM_DIR, LocalShard, SharedMemorySlot, layout_to_proto, shard_specs, write_payload
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc


class Publisher:
    """One trainer rank's hand-off (world 1) of the folder's weights, as the trainer's ShardHandoff
    does it: the payload written once into a shared-memory slot, each version a new header; where
    /dev/shm has no room for it (a small container mount), streamed in chunks after the header."""

    def __init__(self, model_dir: Path) -> None:
        shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
        full_shapes = hf_parameter_shapes(shape)
        tensors = load_weights(model_dir, full_shapes.keys())
        shards = {
            name: LocalShard(tensors[name], dims, *fsdp_rows(dims[0], 1, 0)) for name, dims in full_shapes.items()
        }
        specs, self.nbytes = shard_specs(shards)
        self.slot = None
        if shutil.disk_usage(SHM_DIR).free > 2 * self.nbytes:
            self.slot = SharedMemorySlot(f"rlmesh-gpu-check-{os.getpid()}", self.nbytes)
            self.payload = self.slot.tensor
        else:
            self.payload = torch.empty(self.nbytes, dtype=torch.uint8)
        crc = write_payload(shards, specs, self.payload)
        self.handoff = "shm" if self.slot is not None else "stream"
        self._header = dict(
            rank=0,
            world_size=1,
            layout=layout_to_proto(shape),
            shards=specs,
            total_bytes=self.nbytes,
            shm_path=str(self.slot.path) if self.slot is not None else "",
            payload_crc32=crc,
        )

    async def publish(self, stub: weights_pb2_grpc.WeightsServiceStub, version: int) -> None:
        header = weights_pb2.ShardsHeader(version=version, **self._header)

        async def parts():
            yield weights_pb2.UploadShardsRequest(header=header)
            if self.slot is None:
                for offset, data in stream_chunks(self.payload, self.nbytes):
                    yield weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

        await stub.UploadShards(parts(), **call_options(300))

    def close(self) -> None:
        if self.slot is not None:
            self.slot.close()


class Mesh:
    """A manager, one rollout instance on `device` and the weights service, as processes, with
    their role secrets in the log folder."""

    def __init__(self, model_dir: Path, device: str, max_batch_size: int, log_dir: Path) -> None:
        self.model_dir, self.device, self.max_batch_size, self.log_dir = model_dir, device, max_batch_size, log_dir
        self.auth = BenchAuth(log_dir / "secrets")
        self.children: list[Child] = []
        self.instance_address = ""
        self.weights_address = ""

    async def start(self) -> None:
        self.auth.use()
        quiet = {"SERVER__LOG_LEVEL": "warning"}
        manager = f"127.0.0.1:{free_port()}"
        self._spawn(
            "manager",
            "services.manager",
            manager,
            "RLMESH_MANAGER",
            "manager",
            {**quiet, "SERVER__PORT": _port(manager)},
        )
        await wait_started(self.children)
        self.instance_address = f"127.0.0.1:{free_port()}"
        self._spawn(
            "rollout",
            "services.rollout",
            self.instance_address,
            "RLMESH_ROLLOUT",
            "instance",
            {
                **quiet,
                "SERVER__PORT": _port(self.instance_address),
                "INSTANCE_ID": "rollout-0",
                "MANAGER_ADDRESS": manager,
                "ENGINE__MODEL_DIR": str(self.model_dir),
                "ENGINE__DEVICE": self.device,
                "ENGINE__MAX_BATCH_SIZE": str(self.max_batch_size),
                "ENGINE__STREAM_INTERVAL": "8",
                "TRANSFER__MOONCAKE": "false",
                "TRANSFER__TCP": "true",
            },
        )
        self.weights_address = f"127.0.0.1:{free_port()}"
        self._spawn(
            "weights",
            "services.weights",
            self.weights_address,
            "RLMESH_WEIGHTS",
            "weights",
            {
                **quiet,
                "SERVER__PORT": _port(self.weights_address),
                "MANAGER_ADDRESS": manager,
                "BACKEND": "tcp",
                "COMPRESSION": "none",
                "POLL_INTERVAL_SECONDS": "0.05",
            },
        )
        await wait_started(self.children, timeout=180)

    def _spawn(self, name: str, module: str, address: str, prefix: str, role: Role, settings: dict[str, str]) -> None:
        environment = {**{f"{prefix}_{k}": v for k, v in settings.items()}, **self.auth.settings(f"{prefix}_", role)}
        self.children.append(spawn_service(name, module, address, environment, self.log_dir, str(self.log_dir)))

    async def committed(
        self, stub: weights_pb2_grpc.WeightsServiceStub, version: int, timeout: float = 120
    ) -> weights_pb2.InstancePush:
        deadline = time.monotonic() + timeout
        while True:
            crashed = [c for c in self.children if c.process.poll() is not None]
            if crashed:
                raise RuntimeError(
                    f"{crashed[0].name} exited with code {crashed[0].process.returncode}; see {crashed[0].log_path}"
                )
            status = await stub.GetStatus(weights_pb2.GetStatusRequest(), **call_options(10))
            if status.instances and status.instances[0].committed_version >= version:
                return status.instances[0]
            if time.monotonic() > deadline:
                errors = [i.last_error for i in status.instances]
                raise TimeoutError(f"version {version} not committed within {timeout:.0f} s: {errors}")
            await asyncio.sleep(0.005)

    def stop(self) -> None:
        stop_children(self.children)


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def copy_and_socket_seconds(nbytes: int, device: str, repeats: int = 3) -> dict:
    """The baseline: the bytes copied from the device into pinned host memory (on the CPU: one
    memcpy), then sent through one loopback socket."""
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    copies = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        target.copy_(source, non_blocking=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        copies.append(time.perf_counter() - started)
    del source, target
    copy = statistics.median(copies[1:])
    socket_seconds = nbytes / (raw_socket_gbps(nbytes) * 1e9)
    return {"device_to_host_seconds": copy, "socket_seconds": socket_seconds, "seconds": copy + socket_seconds}


async def _pushes(mesh: Mesh, publisher: Publisher, stub, first_version: int, count: int) -> list[dict]:
    pushes = []
    for version in range(first_version, first_version + count):
        started = time.perf_counter()
        await publisher.publish(stub, version)
        instance = await mesh.committed(stub, version)
        done = time.perf_counter()
        stored_to_served = instance.last_version_latency_ms / 1000
        pushes.append(
            {
                "version": version,
                "stored_to_served_seconds": stored_to_served,
                "end_to_end_seconds": done - started,
                "window": (started, done),
            }
        )
    return pushes


async def _decode_rate(mesh: Mesh, batch: int, max_tokens: int, warm: float, window: float) -> float:
    generation = Generation([mesh.instance_address], concurrency=batch, max_tokens=max_tokens)
    generation.start()
    try:
        await asyncio.sleep(warm)
        start = time.perf_counter()
        await asyncio.sleep(window)
        return generation.rate(start, time.perf_counter())
    finally:
        await generation.stop()


async def _decode_during_pushes(
    mesh: Mesh,
    publisher: Publisher,
    stub,
    batch: int,
    max_tokens: int,
    first_version: int,
    pushes: int,
    warm: float,
    quiet: float,
) -> dict:
    """Tokens/s over all push windows (hand-off to commit: the push into the standby copy and
    its switch lie inside) against quiet windows between them."""
    generation = Generation([mesh.instance_address], concurrency=batch, max_tokens=max_tokens)
    generation.start()
    quiet_windows, push_windows = [], []
    try:
        await asyncio.sleep(warm)
        for version in range(first_version, first_version + pushes):
            start = time.perf_counter()
            await asyncio.sleep(quiet)
            quiet_windows.append((start, time.perf_counter()))
            push_windows.append((await _pushes(mesh, publisher, stub, version, 1))[0]["window"])
    finally:
        await generation.stop()
    without, during = generation.pooled_rate(quiet_windows), generation.pooled_rate(push_windows)
    return {
        "batch": batch,
        "tokens_per_second_without_push": without,
        "tokens_per_second_during_push": during,
        "ratio": during / without if without else 0.0,
        "push_window_seconds": sum(e - s for s, e in push_windows),
    }


async def measure(model_dir: Path, device: str, pushes: int, decode_batches: list[int] | None, quick: bool) -> dict:
    """Stored-to-served seconds of `pushes` versions (median) against the baseline; with
    `decode_batches`, decode tokens/s at each and at the largest during pushes."""
    log_dir = Path(tempfile.mkdtemp(prefix="rlmesh-gpu-check-"))
    largest = max(decode_batches or [1])
    mesh = Mesh(model_dir, device, max(largest, 8), log_dir)
    publisher = Publisher(model_dir)
    figures: dict = {"payload_bytes": publisher.nbytes, "handoff": publisher.handoff, "log_dir": str(log_dir)}
    try:
        await mesh.start()
        async with open_channel(mesh.weights_address) as channel:
            stub = weights_pb2_grpc.WeightsServiceStub(channel)
            results = await _pushes(mesh, publisher, stub, 1, pushes)
            stored_to_served = statistics.median(r["stored_to_served_seconds"] for r in results)
            baseline = copy_and_socket_seconds(publisher.nbytes, device)
            figures.update(
                {
                    "stored_to_served_seconds": stored_to_served,
                    "stored_to_served_all": [r["stored_to_served_seconds"] for r in results],
                    "end_to_end_seconds": statistics.median(r["end_to_end_seconds"] for r in results),
                    "baseline": baseline,
                    "ratio_to_baseline": stored_to_served / baseline["seconds"],
                }
            )
            if decode_batches:
                warm, window = (0.25, 1.0) if quick else (2.0, 4.0)
                max_tokens = 32 if quick else 128
                figures["decode_tokens_per_second"] = {
                    str(b): await _decode_rate(mesh, b, max_tokens, warm, window) for b in decode_batches
                }
                figures["decode_during_push"] = await _decode_during_pushes(
                    mesh,
                    publisher,
                    stub,
                    largest,
                    max_tokens,
                    pushes + 1,
                    pushes=2 if quick else 4,
                    warm=warm,
                    quiet=0.75 if quick else 2.0,
                )
    finally:
        mesh.stop()
        publisher.close()
    return figures
