"""Failure: `kill -9` one of three rollout instances halfway through a step. Counts tokens
regenerated, samples lost and samples duplicated, and compares the step's time with the same
step (same seeds, so the same response lengths) on a pool where nothing fails."""

from __future__ import annotations

import argparse
import asyncio
import signal

from bench.common import BenchMesh, InstanceSpec, StepResult, check_exactly_once, write_result
from rlmesh.common.v1 import common_pb2
from services.manager.domain.admission import per_sample_sampling
from services.rollout.synthetic_engine import SyntheticConfig, response_length

INSTANCES = 3
PROMPTS, GROUP_SIZE = 64, 8
MAX_TOKENS = 1024
SYNTHETIC = SyntheticConfig(
    throughput_tokens_per_second=2000,
    min_step_seconds=0.001,
    length="lognormal",
    mean_tokens=128,
    sigma=1.0,
    stream_interval=1,
)
SETTINGS = {
    "ENGINE__MAX_BATCH_SIZE": "16",
    "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": str(SYNTHETIC.throughput_tokens_per_second),
    "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": str(SYNTHETIC.min_step_seconds),
    "ENGINE__SYNTHETIC__LENGTH": SYNTHETIC.length,
    "ENGINE__SYNTHETIC__MEAN_TOKENS": str(SYNTHETIC.mean_tokens),
    "ENGINE__SYNTHETIC__SIGMA": str(SYNTHETIC.sigma),
    "ENGINE__SYNTHETIC__STREAM_INTERVAL": str(SYNTHETIC.stream_interval),
}
BATCH_ID = "step"


def expected_lengths(sampling: common_pb2.SamplingParams) -> dict[tuple[str, int], int]:
    """Every sample's length as its seed fixes it, whichever instances generate it."""
    return {
        (f"p{p}", i): response_length(SYNTHETIC, per_sample_sampling(sampling, f"p{p}", i).seed, MAX_TOKENS)
        for p in range(PROMPTS)
        for i in range(GROUP_SIZE)
    }


async def run(sampling: common_pb2.SamplingParams, kill_at: float | None) -> tuple[StepResult, dict]:
    specs = [InstanceSpec(f"instance-{i}", 1.0, SETTINGS) for i in range(INSTANCES)]
    async with BenchMesh(specs) as mesh:
        before = (await mesh.status()).generated_tokens
        step = asyncio.create_task(mesh.run_step(BATCH_ID, PROMPTS, GROUP_SIZE, sampling))
        killed = ""
        if kill_at is not None:
            while (await mesh.status()).generated_tokens - before < kill_at and not step.done():
                await asyncio.sleep(0.02)
            victim = next(c for c in mesh.children if c.name == "instance-0")
            victim.process.send_signal(signal.SIGKILL)
            killed = victim.name
        result = await step
        status = await mesh.status()
    return result, {
        "killed": killed,
        "discarded_tokens": status.discarded_tokens,
        "requeued_samples": status.requeued_samples,
        "continued_tokens": status.continued_tokens,
        "instances_left": len(status.instances),
    }


def token_accounting(result: StepResult, lengths: dict[tuple[str, int], int]) -> tuple[int, int]:
    """(tokens missing, tokens extra) against the seeded lengths: a continuation that dropped or
    repeated tokens would show here; samples are matched within a group by length."""
    missing = extra = 0
    for group in result.groups:
        expected = sorted(lengths[(group.prompt_id, i)] for i in range(GROUP_SIZE))
        got = sorted(len(s.token_ids) for s in group.samples)
        missing += sum(max(0, e - g) for e, g in zip(expected, got))
        extra += sum(max(0, g - e) for e, g in zip(expected, got))
    return missing, extra


async def main(seed: int) -> dict:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
    lengths = expected_lengths(sampling)
    total = sum(lengths.values())
    calm, calm_status = await run(sampling, kill_at=None)
    failed, failed_status = await run(sampling, kill_at=total / 2)
    lost, duplicated = check_exactly_once(failed, PROMPTS, GROUP_SIZE)
    missing, extra = token_accounting(failed, lengths)
    return write_result(
        "failure",
        figures={
            "step_seconds_with_kill": failed.seconds,
            "tokens_regenerated": failed_status["discarded_tokens"],
            "samples_lost": lost,
            "samples_duplicated": duplicated,
            "tokens_missing_from_samples": missing,
            "tokens_extra_in_samples": extra,
            "samples_continued_elsewhere": sum(1 for s in failed.samples if len(set(s.instance_ids)) > 1),
            "tokens_kept_by_continuations": failed_status["continued_tokens"],
        },
        baseline={"step_seconds_without_failure": calm.seconds, "tokens": calm.tokens},
        ratios={"step_time_with_kill_over_without": failed.seconds / calm.seconds},
        targets={
            "0 regenerated, 0 lost, 0 duplicated": failed_status["discarded_tokens"]
            == lost
            == duplicated
            == missing
            == extra
            == 0,
            "step time <= 1.6x": failed.seconds / calm.seconds <= 1.6,
        },
        settings={
            "instances": INSTANCES,
            "samples": PROMPTS * GROUP_SIZE,
            "killed": "instance-0 (SIGKILL) at half the step's tokens",
            "synthetic": SYNTHETIC.model_dump(),
            "max_batch_size": 16,
            "seed": seed,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=3)
    asyncio.run(main(parser.parse_args().seed))
