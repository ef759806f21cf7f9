"""Agentic training: 4-turn episodes whose environment steps take a lognormal time (median 200 ms, p99
2 s), trained asynchronously (η = 2) against synchronously (η = 0) in the same run, with the ceiling
of the trainer alone (a step's time without its wait for rollouts); and the KV reuse between turns:
a session's second-turn prefill on the torch engine with its first turn's KV cache kept, against a
full prefill."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from bench.training_runs import TrainingRun, run_up
from rlmesh.logging import configure_logging
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.torch.engine import TorchEngine

TARGET_SPEEDUP = 2.0
TARGET_OF_CEILING = 0.95
WARMUP_STEPS = 2
STEP_MEDIAN_SECONDS = 0.2
STEP_P99_SECONDS = 2.0

ENVIRONMENT = '''
"""4 attempts at the increment problem; each environment step takes a lognormal time."""
import asyncio
import math
import random

from rlmesh.tasks.increment import reward

MEDIAN, SIGMA = {median}, math.log({p99} / {median}) / 2.3263


class SlowEnvironment:
    def __init__(self):
        self.turns = 0
        self.rng = random.Random()

    def reset(self, row):
        self.prompt, self.answer = row["prompt"], row["answer"]
        return {{"text": self.prompt}}

    async def step(self, action):
        await asyncio.sleep(self.rng.lognormvariate(math.log(MEDIAN), SIGMA))
        self.turns += 1
        score = reward(action.text.strip(), self.answer)
        if self.turns >= 4:
            return None, score, True
        # "Again": one token, so 4 turns of 8-digit answers fit the tiny model's 64 positions.
        return {{"text": "="}}, score, False
'''

JOB = """
[[tasks]]
name = "slow"
kind = "increment"
sampling.max_tokens = 12
eval.prompts = 8
eval.samples = 1

[tasks.environment]
python = "slow_env.py:SlowEnvironment"
max_turns = 4
"""


def steady(run: TrainingRun) -> list[dict]:
    return [r for r in run.steps if WARMUP_STEPS < r["step"] < run.summary["steps"]]


def training(scratch: Path, steps: int) -> tuple[dict, dict, dict]:
    (scratch / "slow_env.py").write_text(ENVIRONMENT.format(median=STEP_MEDIAN_SECONDS, p99=STEP_P99_SECONDS))
    job = scratch / "job.toml"
    job.write_text(JOB)
    common = [f"algorithm.checkpoint_every={steps}", f"algorithm.eval_every={steps}"]
    asynchronous = run_up(scratch / "async", steps, common + ["algorithm.max_staleness=2"], ["--job", str(job)])
    synchronous = run_up(scratch / "sync", steps, common + ["algorithm.max_staleness=0"], ["--job", str(job)])
    async_steps, sync_steps = steady(asynchronous), steady(synchronous)
    async_seconds = statistics.mean(r["step_seconds"] for r in async_steps)
    sync_seconds = statistics.mean(r["step_seconds"] for r in sync_steps)
    train_alone = statistics.mean(r["step_seconds"] - r["rollout_wait_seconds"] for r in sync_steps)
    figures = {
        "async_step_seconds": async_seconds,
        "async_episodes_per_second": statistics.mean(r["episodes/count"] for r in async_steps) / async_seconds,
        "async_staleness_mean": statistics.mean(r["staleness_mean"] for r in async_steps),
        "async_environment_seconds_per_episode": statistics.mean(
            r["episodes/environment_seconds"] for r in async_steps
        ),
    }
    baseline = {
        "sync_step_seconds": sync_seconds,
        "sync_episodes_per_second": statistics.mean(r["episodes/count"] for r in sync_steps) / sync_seconds,
        "sync_rollout_wait_seconds": statistics.mean(r["rollout_wait_seconds"] for r in sync_steps),
        "trainer_alone_step_seconds": train_alone,
    }
    speedup = sync_seconds / async_seconds
    ceiling = sync_seconds / train_alone
    ratios = {
        "async_over_sync_throughput": speedup,
        "ceiling_trainer_alone_over_sync": ceiling,
        "async_over_ceiling": speedup / ceiling,
    }
    return figures, baseline, ratios


async def prefill_seconds(engine: TorchEngine, prompt: list[int], follow_up: list[int], sessions: int) -> list[float]:
    """Per session: the second turn's time to its first token, after a first turn of 8 tokens."""
    sampling = Sampling(temperature=0, max_tokens=8)
    times = []
    for index in range(sessions):
        key = f"session-{index}"
        first = [
            t
            async for chunk in engine.generate(EngineRequest(f"{key}-0", prompt, sampling, cache_key=key))
            for t in chunk.token_ids
        ]
        started = time.perf_counter()
        async for _ in engine.generate(
            EngineRequest(f"{key}-1", prompt + first + follow_up, Sampling(temperature=0, max_tokens=1), cache_key=key)
        ):
            times.append(time.perf_counter() - started)
            break
    return times


async def kv_reuse(scratch: Path, sessions: int, context_tokens: int) -> tuple[dict, dict, dict]:
    model = create_chat_model(scratch / "chat", ChatModelSpec(warmup_iterations=1, warmup_batch=1))
    prompt = [(7 * i) % 90 + 1 for i in range(context_tokens)]
    follow_up = [5, 6, 7, 8, 9, 10, 11, 12]
    reusing, plain = TorchEngine(model, max_batch_size=4), TorchEngine(model, max_batch_size=4, prefix_cache_bytes=0)
    await reusing.start()
    await plain.start()
    try:
        with_reuse = await prefill_seconds(reusing, prompt, follow_up, sessions)
        without = await prefill_seconds(plain, prompt, follow_up, sessions)
    finally:
        await reusing.stop()
        await plain.stop()
    figures = {
        "second_turn_prefill_ms_with_reuse": 1000 * statistics.median(with_reuse),
        "prefix_hits": reusing.prefix_cache.hits,
    }
    baseline = {"second_turn_prefill_ms_without_reuse": 1000 * statistics.median(without)}
    ratios = {"prefill_with_over_without_reuse": statistics.median(with_reuse) / statistics.median(without)}
    return figures, baseline, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kv-sessions", type=int, default=16)
    parser.add_argument("--context-tokens", type=int, default=400)
    args = parser.parse_args()
    configure_logging(service="bench")
    figures, baseline, ratios = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-agentic-") as scratch:
        for part in (
            training(Path(scratch), args.steps),
            asyncio.run(kv_reuse(Path(scratch), args.kv_sessions, args.context_tokens)),
        ):
            for collected, values in zip((figures, baseline, ratios), part):
                collected |= values
    speedup, ceiling = ratios["async_over_sync_throughput"], ratios["ceiling_trainer_alone_over_sync"]
    met = speedup >= TARGET_SPEEDUP or (ceiling < TARGET_SPEEDUP and speedup >= TARGET_OF_CEILING * ceiling)
    targets = {f"async_over_sync >= {TARGET_SPEEDUP} (or >= {TARGET_OF_CEILING} of a ceiling below it)": met}
    write_result(
        "agentic",
        figures,
        baseline,
        ratios,
        targets,
        {
            "steps": args.steps,
            "turns_per_episode": 4,
            "environment_step_seconds": f"lognormal, median {STEP_MEDIAN_SECONDS}, p99 {STEP_P99_SECONDS}",
            "async_max_staleness": 2,
            "kv_sessions": args.kv_sessions,
            "kv_context_tokens": args.context_tokens,
            "model": "the default job's tiny model; the tiny chat shape for KV reuse",
        },
    )


if __name__ == "__main__":
    main()
