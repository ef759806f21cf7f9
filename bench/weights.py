"""Weight plane: a 1 GiB bf16 model handed over by 2 trainer ranks (shared memory) and pushed by
the weights service to 2 rollout instances × TP 2 on loopback, for each transport and link
compression; effective GB/s against a raw-socket sendall/recv_into of the same bytes measured right
after each push (the ratio is the median over those pairs: loopback throughput here drifts by up to
2x within minutes), delta mode on a real training step and on a synthetic 2 % change, and generation
tokens/s during a push against without."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import BenchAuth, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, spawn_service, stop_children, wait_started
from rlmesh.lifecycle import return_freed_memory
from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes, tp_parameter_shapes
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel, use_secret
from rlmesh.rpc.credentials import read_secret, secret_path
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc

TRAINER_RANKS = 2
INSTANCES = 2
TP = 2
CHANGED_FRACTION = 0.02
BENCH_MODEL = ModelShape(
    hidden_size=1024,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=4096,
    vocab_size=32000,
    num_layers=33,
    tie_word_embeddings=True,
    attention_bias=True,
)
"""About 535 M parameters: 1.0 GiB in bf16."""
COLD_PUSHES = 3
"""Pushes after a weights-service start that allocate and fault in its buffers (the incoming, the
latest and the delta-base version each hold a set; on a delta link the first is a full version):
reported apart from the warm ones."""
MEASURED_PUSHES = 5
"""Pushes per mode, each paired with a raw-socket run: the socket alone ranges over 2x within one
bench (1.76-4.63 GB/s in one run), and medians of 3 pairs gave 0.71 and 0.90 in two runs of the
same code."""
CATCH_UP_DELAY_SECONDS = 1.0
"""The rollouts' catch_up_delay_seconds: after a delta push each rank copies the served version
into its standby buffer this long after switching, for a fraction of a second."""
CATCH_UP_SECONDS = CATCH_UP_DELAY_SECONDS + 1.5
"""What the raw-socket run after a push waits, so it does not share the CPU and memory with those copies."""
GENERATION_PUSHES = 6
"""Pushes while generating; under load each takes seconds (the transfers yield the CPU)."""
MODES = [("tcp", "none"), ("mooncake", "none"), ("grpc", "none"), ("tcp", "zstd"), ("tcp", "delta")]


def model_bytes(shape: ModelShape) -> int:
    return sum(torch.Size(dims).numel() * 2 for dims in hf_parameter_shapes(shape).values())


# The raw-socket baseline -----------------------------------------------------------------------


def _raw_receiver(port_queue, nbytes: int, chunk: int) -> None:
    # Pre-faulted, as the receivers' buffers are.
    view = memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy())
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    connection, _ = server.accept()
    with connection:
        received = 0
        while received < nbytes:
            count = connection.recv_into(view[received : received + chunk])
            if count == 0:
                break
            received += count
        connection.sendall(received.to_bytes(8, "little"))


def raw_socket_gbps(nbytes: int, chunk: int = 4 << 20) -> float:
    """GB/s of one sendall/recv_into stream of `nbytes` between two processes on loopback."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    receiver = context.Process(target=_raw_receiver, args=(ports, nbytes, chunk))
    receiver.start()
    payload = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    port = ports.get(timeout=30)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.perf_counter()
        for start in range(0, nbytes, chunk):
            sock.sendall(payload[start : start + chunk])
        acknowledged = int.from_bytes(sock.recv(8), "little")
        elapsed = time.perf_counter() - started
    receiver.join()
    assert acknowledged == nbytes, (acknowledged, nbytes)
    return nbytes / elapsed / 1e9


# Trainer ranks ---------------------------------------------------------------------------------


class RankRows:
    """One FSDP rank's rows of every parameter: bf16 values of a trained model's scale at the first
    version; each later version moves `changed_fraction` of the values by about one bf16 step."""

    def __init__(self, shape: ModelShape, rank: int, world: int, changed_fraction: float) -> None:
        self.changed_fraction = changed_fraction
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.rows: dict[str, torch.Tensor] = {}
        for name, dims in hf_parameter_shapes(shape).items():
            start, end = fsdp_rows(dims[0], world, rank)
            self.rows[name] = (torch.randn((end - start, *dims[1:]), generator=self.generator) * 0.02).bfloat16()

    def step(self) -> None:
        for name, values in self.rows.items():
            changed = torch.rand(values.shape, generator=self.generator) < self.changed_fraction
            self.rows[name] = torch.where(changed, (values.float() * 1.02 + 1e-4).bfloat16(), values)


class TrainerRanks:
    """FSDP trainer ranks as processes: each prepares its shards of a version, then, when told,
    hands them to the weights service through its shared-memory slot, with the trainer's secret
    from `secrets`."""

    def __init__(self, shape: ModelShape, world: int, changed_fraction: float, secrets: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes = []
        self.processes = []
        for rank in range(world):
            parent, child = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(child, shape, rank, world, changed_fraction, secrets), daemon=True
            )
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)

    def publish(self, version: int, weights_address: str) -> tuple[float, float]:
        """Prepares `version` on every rank, then starts every hand-off at once; returns when
        they started (perf_counter) and the seconds to the last rank's reply."""
        for pipe in self.pipes:
            pipe.send(("prepare", version))
        for pipe in self.pipes:
            pipe.recv()
        started = time.perf_counter()
        for pipe in self.pipes:
            pipe.send(("go", weights_address))
        for pipe in self.pipes:
            reply = pipe.recv()
            if isinstance(reply, str):
                raise RuntimeError(reply)
        return started, time.perf_counter() - started

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(("stop", None))
        for process in self.processes:
            process.join(timeout=30)


def _rank_main(pipe, shape: ModelShape, rank: int, world: int, changed_fraction: float, secrets: Path) -> None:
    from rlmesh.transfer.shards import LocalShard, SharedMemorySlot, layout_to_proto, shard_specs, write_payload

    torch.set_num_threads(1)
    use_secret(read_secret(secret_path(secrets, "trainer")))
    full_shapes = hf_parameter_shapes(shape)
    rows = RankRows(shape, rank, world, changed_fraction)
    slot = None
    header = None
    prepared = 0

    async def hand_off(address: str, message: weights_pb2.ShardsHeader) -> None:
        async with open_channel(address) as channel:

            async def parts():
                yield weights_pb2.UploadShardsRequest(header=message)

            await weights_pb2_grpc.WeightsServiceStub(channel).UploadShards(parts(), **call_options(300))

    try:
        while True:
            command, argument = pipe.recv()
            if command == "stop":
                return
            if command == "prepare":
                if prepared:
                    rows.step()
                    return_freed_memory()
                prepared += 1
                shards = {
                    name: LocalShard(t, full_shapes[name], *fsdp_rows(full_shapes[name][0], world, rank))
                    for name, t in rows.rows.items()
                }
                specs, total = shard_specs(shards)
                slot = slot or SharedMemorySlot(f"rlmesh-bench-{os.getpid()}-rank{rank}", total)
                crc = write_payload(shards, specs, slot.tensor)
                header = weights_pb2.ShardsHeader(
                    version=argument,
                    rank=rank,
                    world_size=world,
                    layout=layout_to_proto(shape),
                    shards=specs,
                    total_bytes=total,
                    shm_path=str(slot.path),
                    payload_crc32=crc,
                )
                pipe.send("ready")
            else:
                try:
                    asyncio.run(hand_off(argument, header))
                    pipe.send(header.total_bytes)
                except Exception as exc:
                    pipe.send(f"rank {rank}: {exc}")
    finally:
        if slot is not None:
            slot.close()


# Rollout instances and the weights service -------------------------------------------------------


def ensure_bench_model(directory: Path, shape: ModelShape) -> Path:
    """A bf16 Qwen2 folder of the bench shape (random weights), written once and reused."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from rlmesh.models.tokenizer import build_char_tokenizer, save_tokenizer

    if (directory / "model.safetensors").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=shape.tie_word_embeddings,
        torch_dtype="bfloat16",
        bos_token_id=12,
        eos_token_id=12,
        pad_token_id=13,
    )
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.randn(dims, generator=generator) * 0.02).bfloat16()
        for name, dims in hf_parameter_shapes(shape).items()
    }
    save_file(tensors, str(directory / "model.safetensors"))
    save_tokenizer(build_char_tokenizer(), directory)
    del tensors
    return_freed_memory()
    return directory


@dataclass
class Services:
    log_dir: Path
    auth: BenchAuth
    manager: Child
    instances: list[Child]
    weights: Child | None = None

    @property
    def children(self) -> list[Child]:
        return [self.manager, *self.instances, *([self.weights] if self.weights else [])]


async def start_instances(model_dir: Path, log_dir: Path, auth: BenchAuth) -> Services:
    manager_address = f"127.0.0.1:{free_port()}"
    manager = spawn_service(
        "manager",
        "services.manager",
        manager_address,
        {
            "RLMESH_MANAGER_SERVER__PORT": manager_address.rsplit(":", 1)[1],
            "RLMESH_MANAGER_SERVER__LOG_LEVEL": "warning",
            **auth.settings("RLMESH_MANAGER_", "manager"),
        },
        log_dir,
        str(log_dir),
    )
    await wait_started([manager])
    instances = []
    for index in range(INSTANCES):
        port = free_port()
        instances.append(
            spawn_service(
                f"rollout-{index}",
                "services.rollout",
                f"127.0.0.1:{port}",
                {
                    "RLMESH_ROLLOUT_SERVER__PORT": str(port),
                    "RLMESH_ROLLOUT_SERVER__LOG_LEVEL": "warning",
                    "RLMESH_ROLLOUT_INSTANCE_ID": f"rollout-{index}",
                    "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
                    "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(model_dir),
                    "RLMESH_ROLLOUT_ENGINE__TENSOR_PARALLEL_SIZE": str(TP),
                    "RLMESH_ROLLOUT_ENGINE__MAX_BATCH_SIZE": "16",
                    "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "true",
                    "RLMESH_ROLLOUT_TRANSFER__TCP": "true",
                    "RLMESH_ROLLOUT_TRANSFER__CATCH_UP_DELAY_SECONDS": str(CATCH_UP_DELAY_SECONDS),
                    **auth.settings("RLMESH_ROLLOUT_", "instance"),
                },
                log_dir,
                str(log_dir),
            )
        )
    await wait_started(instances, timeout=600)
    return Services(log_dir, auth, manager, instances)


async def start_weights(services: Services, backend: str, compression: str) -> str:
    address = f"127.0.0.1:{free_port()}"
    services.weights = spawn_service(
        f"weights-{backend}-{compression}",
        "services.weights",
        address,
        {
            "RLMESH_WEIGHTS_SERVER__PORT": address.rsplit(":", 1)[1],
            "RLMESH_WEIGHTS_SERVER__LOG_LEVEL": "info",
            "RLMESH_WEIGHTS_MANAGER_ADDRESS": services.manager.address,
            "RLMESH_WEIGHTS_BACKEND": backend,
            "RLMESH_WEIGHTS_COMPRESSION": compression,
            "RLMESH_WEIGHTS_POLL_INTERVAL_SECONDS": "0.05",
            **services.auth.settings("RLMESH_WEIGHTS_", "weights"),
        },
        services.log_dir,
        str(services.log_dir),
    )
    await wait_started([services.weights])
    return address


async def stop_weights(services: Services) -> None:
    if services.weights is not None:
        await asyncio.to_thread(stop_children, [services.weights])
        services.weights = None


async def wait_committed(
    stub: weights_pb2_grpc.WeightsServiceStub, services: Services, version: int, timeout: float = 600
) -> weights_pb2.GetStatusResponse:
    deadline = time.monotonic() + timeout
    while True:
        crashed = [c for c in services.children if c.process.poll() is not None]
        if crashed:
            raise RuntimeError(
                f"{crashed[0].name} exited with code {crashed[0].process.returncode}; see {crashed[0].log_path}"
            )
        status = await stub.GetStatus(weights_pb2.GetStatusRequest(), **call_options(10))
        if len(status.instances) == INSTANCES and all(i.committed_version >= version for i in status.instances):
            return status
        failing = [i for i in status.instances if i.last_error]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"version {version} not committed everywhere: {[(i.instance_id, i.last_error) for i in failing]}"
            )
        await asyncio.sleep(0.01)


class Generation:
    """Keeps every instance generating and timestamps each token received."""

    def __init__(self, addresses: list[str], concurrency: int, max_tokens: int) -> None:
        self.addresses = addresses
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.stamps: list[float] = []
        self._tasks: list[asyncio.Task] = []
        self._channels = [open_channel(a) for a in addresses]

    async def _stream(self, stub: rollout_pb2_grpc.RolloutServiceStub, worker: str) -> None:
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=self.max_tokens)
        count = 0
        while True:
            count += 1
            request = rollout_pb2.GenerateRequest(
                request_id=f"{worker}-{count}", prompt_token_ids=[1, 2, 3, 4, 10], sampling=sampling
            )
            async for reply in stub.Generate(request, **call_options(600)):
                now = time.perf_counter()
                self.stamps.extend([now] * len(reply.chunk.token_ids))

    def start(self) -> None:
        for index, channel in enumerate(self._channels):
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            self._tasks += [asyncio.create_task(self._stream(stub, f"g{index}-{k}")) for k in range(self.concurrency)]

    def rate(self, start: float, end: float) -> float:
        return self.pooled_rate([(start, end)])

    def pooled_rate(self, windows: list[tuple[float, float]]) -> float:
        """Tokens received in any of the windows over their total length."""
        tokens = sum(1 for t in self.stamps if any(start <= t < end for start, end in windows))
        return tokens / sum(end - start for start, end in windows)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()


# A real training step ------------------------------------------------------------------------


def real_step_delta() -> dict[str, float]:
    """Delta compression of the real difference between two consecutive versions of the default
    model: one GRPO step (16 prompts x 8 samples, T = 1, Adam 3e-4, the default settings) on the
    warmed-up model, as the trainer sends it (fp32) and cast to bf16."""
    import random

    from rlmesh.models.loading import load_causal_lm
    from rlmesh.models.qwen2_tiny import create_default_model
    from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
    from rlmesh.tasks.increment import make_problem, reward
    from rlmesh.transfer.payload import pack
    from services.trainer.algorithms.advantages import group_advantages
    from services.trainer.algorithms.losses import policy_loss
    from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
    from services.weights.encoding import EncodedPayload
    from services.weights.store import RankPayload

    torch.manual_seed(0)
    model_dir = create_default_model(Path(tempfile.mkdtemp(prefix="rlmesh-bench-model-")))
    model = load_causal_lm(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = random.Random(0)
    problems = [make_problem(rng) for _ in range(16)]
    samples = []
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt).ids
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt] * 8),
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=1.0,
                max_new_tokens=12,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        responses = [row[len(prompt) :] for row in out.tolist()]
        responses = [r[: r.index(eos) + 1] if eos in r else r for r in responses]
        rewards = torch.tensor(
            [[reward(tokenizer.decode([t for t in r if t != eos]), problem.answer) for r in responses]]
        )
        for response, advantage in zip(responses, group_advantages(rewards)[0].tolist()):
            samples.append(TrainingSample(prompt, response, [0.0] * len(response), advantage))
    batch = build_micro_batch(samples, pad)
    model.train()
    logprobs = token_logprobs(model, batch, 1.0)
    loss_sum, _ = policy_loss(logprobs, logprobs.detach(), batch.advantages, batch.response_mask)
    loss = loss_sum / len(samples)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = {}
    for label, cast in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        old = RankPayload(*pack({n: t.to(cast) for n, t in before.items()}, 1, bucket_bytes=1 << 20))
        new = RankPayload(*pack({n: t.to(cast) for n, t in after.items()}, 2, bucket_bytes=1 << 20))
        changed = sum(int((before[n].to(cast) != after[n].to(cast)).sum()) for n in before) / sum(
            t.numel() for t in before.values()
        )
        delta = EncodedPayload(new, "delta", old, 1)
        full = EncodedPayload(new, "zstd")
        for _ in delta.frames():
            pass
        for _ in full.frames():
            pass
        result[f"real_step_{label}_changed_fraction"] = changed
        result[f"real_step_{label}_delta_ratio"] = delta.report.ratio
        result[f"real_step_{label}_zstd_ratio"] = full.report.ratio
    return result


# The run ---------------------------------------------------------------------------------------


def delivered_bytes(shape: ModelShape) -> int:
    """Bytes every instance receives: each TP rank only its own shards (norms and KV heads
    replicated where the layout says so)."""
    return INSTANCES * TP * sum(torch.Size(dims).numel() * 2 for dims in tp_parameter_shapes(shape, TP).values())


async def push_once(ranks: TrainerRanks, services: Services, stub, address: str, version: int) -> dict:
    """One version from the trainer ranks to every instance. push: from the version stored in the
    weights service (shards in, resharded, checked, encoded for the links) to the last instance
    serving it, as the service measured it; end to end: from the trainer ranks' hand-off on."""
    started, handoff = await asyncio.to_thread(ranks.publish, version, address)
    status = await wait_committed(stub, services, version)
    done = time.perf_counter()
    push = max(i.last_version_latency_ms for i in status.instances) / 1000
    link = status.instances[0]
    return {
        "version": version,
        "handoff_seconds": handoff,
        "push_seconds": push,
        "end_to_end_seconds": done - started,
        "stored_at": done - push,
        "done_at": done,
        "ratio": link.compression_ratio,
        "encode_ms": link.encode_ms,
    }


async def generation_during_pushes(
    ranks: TrainerRanks, services: Services, stub, address: str, version: int, pushes: int
) -> tuple[dict[str, float], int]:
    """Tokens/s of every instance over all the push windows together, against the same instances
    over quiet windows between them (one push's window holds few decode steps: alone it is too
    coarse)."""
    gen = Generation([c.address for c in services.instances], concurrency=4, max_tokens=64)
    gen.start()
    await asyncio.sleep(5.0)
    quiet, pushing = [], []
    try:
        for _ in range(pushes):
            version += 1
            quiet_start = time.perf_counter()
            await asyncio.sleep(3.0)
            quiet.append((quiet_start, time.perf_counter()))
            push = await push_once(ranks, services, stub, address, version)
            pushing.append((push["stored_at"], push["done_at"]))
            print(
                f"generation: {gen.rate(*quiet[-1]):.1f} tok/s before the push of version {version}, "
                f"{gen.rate(*pushing[-1]):.1f} during its {push['push_seconds']:.2f} s",
                flush=True,
            )
    finally:
        await gen.stop()
    return {
        "tokens_per_second_without_push": gen.pooled_rate(quiet),
        "tokens_per_second_during_push": gen.pooled_rate(pushing),
        "seconds_of_push_windows": sum(end - start for start, end in pushing),
    }, version


async def run(shape: ModelShape, model_dir: Path, modes: list[tuple[str, str]], repeats: int) -> dict:
    nbytes = delivered_bytes(shape)
    log_dir = Path(tempfile.mkdtemp(prefix="rlmesh-bench-weights-"))
    print(f"{nbytes / 2**30:.2f} GiB delivered per push; logs in {log_dir}", flush=True)
    auth = BenchAuth(log_dir / "secrets")
    auth.use()
    services = await start_instances(model_dir, log_dir, auth)
    ranks = TrainerRanks(shape, TRAINER_RANKS, CHANGED_FRACTION, auth.folder)
    version = 0
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    baselines: list[float] = []
    pair_ratios: dict[str, list[float]] = {}
    generation: dict[str, float] = {}
    try:
        for backend, compression in modes:
            address = await start_weights(services, backend, compression)
            channel = open_channel(address)
            stub = weights_pb2_grpc.WeightsServiceStub(channel)
            name = f"{backend}_{compression}"
            try:
                pushes, raw = [], []
                for index in range(COLD_PUSHES + repeats):
                    version += 1
                    pushes.append(await push_once(ranks, services, stub, address, version))
                    if index >= COLD_PUSHES:
                        await asyncio.sleep(CATCH_UP_SECONDS)
                        raw.append(await asyncio.to_thread(raw_socket_gbps, nbytes))
                        pushes[-1]["raw_socket_gbps"] = raw[-1]
                    print(f"{name}: {json.dumps({k: round(v, 4) for k, v in pushes[-1].items()})}", flush=True)
                if (backend, compression) == ("tcp", "none"):
                    generation, version = await generation_during_pushes(
                        ranks, services, stub, address, version, GENERATION_PUSHES
                    )
                measured = pushes[COLD_PUSHES:]
                seconds = statistics.median(p["push_seconds"] for p in measured)
                figures[f"{name}_gbps"] = nbytes / seconds / 1e9
                figures[f"{name}_push_seconds"] = seconds
                figures[f"{name}_end_to_end_seconds"] = statistics.median(p["end_to_end_seconds"] for p in measured)
                figures[f"{name}_compression_ratio"] = statistics.median(p["ratio"] for p in measured)
                figures[f"{name}_handoff_seconds"] = statistics.median(p["handoff_seconds"] for p in measured)
                figures[f"{name}_cold_push_seconds"] = pushes[0]["push_seconds"]
                pairs = [nbytes / p["push_seconds"] / 1e9 / p["raw_socket_gbps"] for p in measured]
                ratios[f"{name}_vs_raw_socket"] = statistics.median(pairs)
                pair_ratios[name] = [round(r, 3) for r in pairs]
                # From the trainer's hand-off on: the ingest (shared memory, resharding, checksums, encoding) included.
                ratios[f"{name}_end_to_end_vs_raw_socket"] = statistics.median(
                    nbytes / p["end_to_end_seconds"] / 1e9 / p["raw_socket_gbps"] for p in measured
                )
                baselines += raw
            finally:
                await channel.close()
                await stop_weights(services)
    finally:
        ranks.close()
        await asyncio.to_thread(stop_children, services.children)
    return {
        "figures": figures,
        "ratios": ratios,
        "generation": generation,
        "baseline_runs": baselines,
        "pair_ratios": pair_ratios,
        "delivered_bytes": nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=MEASURED_PUSHES, help="measured pushes per mode (median)")
    parser.add_argument("--small", action="store_true", help="a 64 MiB model instead of 1 GiB (a quick check)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=[f"{b}:{c}" for b, c in MODES],
        metavar="BACKEND:COMPRESSION",
        help="transports and link compressions to measure (default: all)",
    )
    args = parser.parse_args()
    modes = [tuple(mode.split(":", 1)) for mode in args.modes]
    shape = BENCH_MODEL
    if args.small:
        shape = ModelShape(
            hidden_size=512,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            vocab_size=32000,
            num_layers=4,
            tie_word_embeddings=True,
            attention_bias=True,
        )
    model_dir = ensure_bench_model(Path(".rlmesh/bench") / f"qwen2-{model_bytes(shape) >> 20}mib", shape)
    result = asyncio.run(run(shape, model_dir, modes, args.repeats))
    figures, ratios, baselines = result["figures"], result["ratios"], result["baseline_runs"]
    figures.update(real_step_delta())
    generation = result["generation"]
    if generation:
        figures.update(generation)
        ratios["generation_during_push_vs_without"] = (
            generation["tokens_per_second_during_push"] / generation["tokens_per_second_without_push"]
        )
    write_result(
        "weights",
        figures,
        {
            "raw_socket_gbps": statistics.median(baselines),
            "raw_socket_gbps_runs": [round(b, 3) for b in baselines],
            "ratio_of_each_pair": result["pair_ratios"],
        },
        ratios,
        {
            "tcp_none_vs_raw_socket": ">= 0.8",
            "tcp_delta_vs_raw_socket": ">= 5 (2 % changed)",
            "generation_during_push_vs_without": ">= 0.9",
        },
        {
            "model_bytes": model_bytes(shape),
            "delivered_bytes": result["delivered_bytes"],
            "trainer_ranks": TRAINER_RANKS,
            "instances": INSTANCES,
            "tensor_parallel": TP,
            "changed_fraction": CHANGED_FRACTION,
            "repeats": args.repeats,
        },
    )


if __name__ == "__main__":
    main()
