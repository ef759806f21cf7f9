"""Relay capacity: tokens/s that reach the trainer through the manager from synthetic engines,
against the same engines called directly, against the torch engine's generation rate on this
machine, with the manager's journal on against off, and with authorization on (every call
carrying its role's bearer secret, the default) against off, all measured in the same run."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from bench.common import BenchMesh, InstanceSpec, check_exactly_once, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from services.manager.config import ManagerConfig

INSTANCES = 3
MAX_BATCH = 128
LENGTH = 256
PROMPTS, GROUP_SIZE = 48, 8
SYNTHETIC = {
    "ENGINE__MAX_BATCH_SIZE": str(MAX_BATCH),
    "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": "1000000",
    "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": "0.0002",
    "ENGINE__SYNTHETIC__LENGTH": "fixed",
    "ENGINE__SYNTHETIC__MEAN_TOKENS": str(LENGTH),
    "ENGINE__SYNTHETIC__STREAM_INTERVAL": "32",
}


def instance_specs() -> list[InstanceSpec]:
    return [InstanceSpec(f"synthetic-{i}", 1.0, SYNTHETIC) for i in range(INSTANCES)]


async def direct_rate(addresses: list[str], requests_per_instance: int) -> tuple[float, int]:
    """Tokens/s of the engines streamed straight to one client, as many requests as the relay gets."""
    channels = [open_channel(a) for a in addresses]
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=LENGTH + 1)

    async def one(stub: rollout_pb2_grpc.RolloutServiceStub, request_id: str) -> int:
        tokens = 0
        request = rollout_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=sampling)
        async for reply in stub.Generate(request, **call_options(300)):
            tokens += len(reply.chunk.token_ids)
        return tokens

    try:
        stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in channels]
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(one(stub, f"direct-{i}-{j}") for i, stub in enumerate(stubs) for j in range(requests_per_instance))
        )
        return sum(counts) / (time.perf_counter() - started), sum(counts)
    finally:
        for channel in channels:
            await channel.close()


async def torch_rate(requests: int = 256, max_tokens: int = 48) -> float:
    """The default model's architecture on the torch engine, one thread, a full batch."""
    from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
    from services.rollout.engine import EngineRequest, Sampling
    from services.rollout.torch.engine import TorchEngine

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        model_dir = create_default_model(folder, TinyModelSpec(warmup_iterations=0))
        engine = TorchEngine(model_dir, max_batch_size=requests)
        await engine.start()
        try:

            async def one(index: int) -> int:
                request = EngineRequest(
                    f"t{index}", [1, 2, 3, 4, 5, 6, 10], Sampling(temperature=1.0, max_tokens=max_tokens)
                )
                return sum([len(chunk.token_ids) async for chunk in engine.generate(request)])

            await asyncio.gather(*(one(i) for i in range(16)))
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
            return tokens / (time.perf_counter() - started)
        finally:
            await engine.stop()


async def relay_rounds(
    rounds: int, manager_settings: dict[str, str], direct_rates: list[float] | None = None
) -> list[float]:
    """Tokens/s through the manager per round; with `direct_rates`, the engines called directly
    after each round go there."""
    rates = []
    async with BenchMesh(instance_specs(), manager_settings) as mesh:
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=LENGTH + 1)
        await mesh.run_step("warmup", PROMPTS // 4, GROUP_SIZE, sampling)
        for round_ in range(rounds):
            result = await mesh.run_step(f"relay-{round_}", PROMPTS, GROUP_SIZE, sampling)
            lost, duplicated = check_exactly_once(result, PROMPTS, GROUP_SIZE)
            assert lost == duplicated == 0 and result.tokens == PROMPTS * GROUP_SIZE * LENGTH, (
                "the relay lost or duplicated tokens"
            )
            rates.append(result.tokens / result.seconds)
            if direct_rates is not None:
                rate, _ = await direct_rate(list(mesh.instance_addresses.values()), PROMPTS * GROUP_SIZE // INSTANCES)
                direct_rates.append(rate)
    return rates


async def authorization_rounds(rounds: int) -> tuple[list[float], list[float]]:
    """Tokens/s through the manager per round with authorization on and off: two meshes up at
    once, their rounds taken in turn, so that a change of the machine's speed falls on both."""
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=LENGTH + 1)
    rates: dict[bool, list[float]] = {False: [], True: []}
    meshes = {insecure: BenchMesh(instance_specs(), insecure=insecure) for insecure in (False, True)}
    async with meshes[False] as secured_mesh, meshes[True] as open_mesh:
        for open_first in [round_ % 2 == 1 for round_ in range(rounds + 1)]:
            for mesh in (open_mesh, secured_mesh) if open_first else (secured_mesh, open_mesh):
                # Each call of this process presents the secrets of the mesh it drives.
                mesh.auth.use()
                result = await mesh.run_step(f"auth-{len(rates[mesh.auth.insecure])}", PROMPTS, GROUP_SIZE, sampling)
                lost, duplicated = check_exactly_once(result, PROMPTS, GROUP_SIZE)
                assert lost == duplicated == 0, "the relay lost or duplicated tokens"
                rates[mesh.auth.insecure].append(result.tokens / result.seconds)
    # The first round of each is a warm-up.
    return rates[False][1:], rates[True][1:]


async def main(rounds: int) -> dict:
    direct_rates: list[float] = []
    relay_rates = await relay_rounds(rounds, {}, direct_rates)
    with tempfile.TemporaryDirectory() as folder:
        journaled_rates = await relay_rounds(rounds, {"JOURNAL_PATH": f"{folder}/manager-journal.sqlite"})
    authorized_rates, insecure_rates = await authorization_rounds(rounds)
    torch_tokens_per_second = await torch_rate()
    relay = statistics.median(relay_rates)
    journaled = statistics.median(journaled_rates)
    authorized = statistics.median(authorized_rates)
    insecure = statistics.median(insecure_rates)
    direct = statistics.median(direct_rates)
    return write_result(
        "relay",
        figures={
            "relay_tokens_per_second_median": relay,
            "relay_rounds": relay_rates,
            "journaled_relay_tokens_per_second_median": journaled,
            "journaled_relay_rounds": journaled_rates,
            "authorized_relay_tokens_per_second_median": authorized,
            "authorized_relay_rounds": authorized_rates,
        },
        baseline={
            "direct_tokens_per_second_median": direct,
            "direct_rounds": direct_rates,
            "torch_engine_tokens_per_second": torch_tokens_per_second,
            "insecure_relay_tokens_per_second_median": insecure,
            "insecure_relay_rounds": insecure_rates,
        },
        ratios={
            "relay_over_direct": relay / direct,
            "relay_over_torch_engine": relay / torch_tokens_per_second,
            "journaled_over_in_memory_relay": journaled / relay,
            "authorized_over_insecure_relay": authorized / insecure,
        },
        targets={
            "relay_over_torch_engine >= 10": relay / torch_tokens_per_second >= 10,
            "journaled_over_in_memory_relay >= 0.8": journaled / relay >= 0.8,
            "authorized_over_insecure_relay >= 0.95": authorized / insecure >= 0.95,
        },
        settings={
            "instances": INSTANCES,
            "samples_per_round": PROMPTS * GROUP_SIZE,
            "tokens_per_sample": LENGTH,
            "synthetic": SYNTHETIC,
            "rounds": rounds,
            "torch_engine": "default tiny Qwen2, 256 requests x 48 tokens, 1 thread",
            "journal": f"SQLite WAL, synchronous=NORMAL, flushed every {ManagerConfig().journal_flush_seconds} s "
            "and before every reply that confirms something",
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    asyncio.run(main(parser.parse_args().rounds))
