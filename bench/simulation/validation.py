"""The simulator against the real thing at small scale: the same synchronous steps (same prompts,
seeds, instance speeds and synthetic decode model) on a real manager with synthetic rollout
processes over gRPC, and in the simulator; step times compared."""

from __future__ import annotations

import time

from bench.common import BenchMesh, InstanceSpec
from bench.simulation.scenarios import (
    SMALL_GROUP,
    SMALL_MAX_TOKENS,
    SMALL_PROMPTS,
    SMALL_SPEEDS,
    SMALL_STEPS,
    small,
    small_engine_settings,
)
from bench.simulation.trainer import batch_id
from bench.simulation.world import Simulation
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.rpc.channels import call_options

SEED = 7


def step_seed(step: int) -> int:
    """The sampling seed of a step, as the simulated trainer draws it for Simulation(seed=SEED)."""
    return SEED * 1000 + 1 + step


async def real_step_seconds(instances: int) -> list[float]:
    """Each synchronous step's time on a real manager and `instances` synthetic rollout processes."""
    specs = [InstanceSpec(f"v{i}", SMALL_SPEEDS[i], small_engine_settings()) for i in range(instances)]
    seconds = []
    async with BenchMesh(specs) as mesh:
        for step in range(SMALL_STEPS):
            sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=SMALL_MAX_TOKENS, seed=step_seed(step))
            request = manager_pb2.SubmitPromptsRequest(
                batch_id=batch_id(step),
                policy_version=0,
                sampling=sampling,
                prompts=[
                    manager_pb2.Prompt(prompt_id=f"s{step}p{i}", token_ids=[1, 2, 3, 4], n=SMALL_GROUP)
                    for i in range(SMALL_PROMPTS)
                ],
            )
            started = time.perf_counter()
            await mesh.manager.SubmitPrompts(request, **call_options(30))
            stream = mesh.manager.StreamRollouts(
                manager_pb2.StreamRolloutsRequest(batch_id=batch_id(step), micro_batch_groups=8), **call_options(600)
            )
            groups = [group async for reply in stream for group in reply.groups]
            seconds.append(time.perf_counter() - started)
            assert len(groups) == SMALL_PROMPTS, f"step {step}: {len(groups)} groups of {SMALL_PROMPTS}"
            await mesh.manager.AcknowledgeRollouts(
                manager_pb2.AcknowledgeRolloutsRequest(batch_id=batch_id(step)), **call_options(30)
            )
    return seconds


def simulated_step_seconds(instances: int) -> list[float]:
    simulation = Simulation(small(instances), "steady", seed=SEED)
    simulation.run()
    ends = [0.0, *simulation.trainer.accounts.step_ends]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


async def compare(instance_counts: tuple[int, ...] = (1, 2, 3)) -> dict[str, dict]:
    """Per instance count: the real and simulated step times, and simulated ÷ real of their sums."""
    compared = {}
    for count in instance_counts:
        real = await real_step_seconds(count)
        simulated = simulated_step_seconds(count)
        compared[str(count)] = {
            "real_step_seconds": real,
            "simulated_step_seconds": simulated,
            "simulated_over_real": sum(simulated) / sum(real),
        }
    return compared
