"""Balance: the makespan of one rollout step on a heterogeneous pool (speeds 1, 1, 1/3) with
long-tailed response lengths, against the ideal bound (total tokens ÷ total throughput), for
the manager's balanced dispatch and for plain round-robin, measured in the same run."""

from __future__ import annotations

import argparse
import asyncio

from bench.common import BenchMesh, InstanceSpec, check_exactly_once, write_result
from rlmesh.common.v1 import common_pb2

SPEEDS = (1.0, 1.0, 1.0 / 3.0)
THROUGHPUT = 2000.0
"""Tokens/s of a full batch at speed 1."""
MIN_STEP_SECONDS = 0.001
MAX_BATCH = 16
MEAN_TOKENS = 128
SIGMA = 1.0
MAX_TOKENS = 1024
PROMPTS, GROUP_SIZE = 128, 8
WARMUP_PROMPTS = 32


def instances() -> list[InstanceSpec]:
    settings = {
        "ENGINE__MAX_BATCH_SIZE": str(MAX_BATCH),
        "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": str(THROUGHPUT),
        "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": str(MIN_STEP_SECONDS),
        "ENGINE__SYNTHETIC__LENGTH": "lognormal",
        "ENGINE__SYNTHETIC__MEAN_TOKENS": str(MEAN_TOKENS),
        "ENGINE__SYNTHETIC__SIGMA": str(SIGMA),
        "ENGINE__SYNTHETIC__STREAM_INTERVAL": "8",
    }
    return [InstanceSpec(f"speed-{i}", speed, settings) for i, speed in enumerate(SPEEDS)]


async def measure(policy: str, seed: int, warmup_steps: int) -> dict:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
    async with BenchMesh(instances(), {"DISPATCH_POLICY": policy}) as mesh:
        # The manager learns each instance's speed from earlier steps, as a long-running one has;
        # round-robin learns nothing, so it skips them.
        for step in range(warmup_steps if policy == "balanced" else 0):
            warm = common_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed + 1000 + step)
            await mesh.run_step(f"warmup-{step}", WARMUP_PROMPTS, GROUP_SIZE, warm)
        result = await mesh.run_step("measured", PROMPTS, GROUP_SIZE, sampling)
        status = await mesh.status()
    lost, duplicated = check_exactly_once(result, PROMPTS, GROUP_SIZE)
    capacity = sum(THROUGHPUT * s for s in SPEEDS)
    ideal = result.tokens / capacity
    return {
        "makespan_seconds": result.seconds,
        "ideal_seconds": ideal,
        "makespan_over_ideal": result.seconds / ideal,
        "tokens": result.tokens,
        "longest_response": max(len(s.token_ids) for s in result.samples),
        "migrated_samples": status.migrated_samples,
        "lost": lost,
        "duplicated": duplicated,
    }


async def main(seed: int, warmup_steps: int) -> dict:
    balanced = await measure("balanced", seed, warmup_steps)
    round_robin = await measure("round_robin", seed, warmup_steps)
    return write_result(
        "balance",
        figures={f"balanced_{k}": v for k, v in balanced.items()},
        baseline={f"round_robin_{k}": v for k, v in round_robin.items()},
        ratios={
            "balanced_makespan_over_ideal": balanced["makespan_over_ideal"],
            "round_robin_makespan_over_ideal": round_robin["makespan_over_ideal"],
            "balanced_over_round_robin": balanced["makespan_seconds"] / round_robin["makespan_seconds"],
        },
        targets={
            "balanced_makespan_over_ideal <= 1.15": balanced["makespan_over_ideal"] <= 1.15,
            "nothing lost or duplicated": balanced["lost"] == balanced["duplicated"] == 0,
        },
        settings={
            "speeds": SPEEDS,
            "throughput_tokens_per_second": THROUGHPUT,
            "min_step_seconds": MIN_STEP_SECONDS,
            "max_batch_size": MAX_BATCH,
            "length": f"lognormal(mean {MEAN_TOKENS}, sigma {SIGMA}), capped at {MAX_TOKENS}",
            "samples": PROMPTS * GROUP_SIZE,
            "seed": seed,
            "warmup_steps": warmup_steps,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.seed, args.warmup_steps))
