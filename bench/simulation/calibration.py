"""What the simulator is told about a real `rlmesh up` run, read from what the run wrote beside its
step times (metrics.jsonl, the weights service's log): the trainer's busy time per response token,
the response lengths, when the manager learned each version and when each instance served it; and
the torch engine's decode speed, measured in this process."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

WARMUP_STEPS = 4
"""Left out of the comparison: the first steps pay for the processes' first calls and the start's validation."""
PUSH_PERCENTILES = (0.1, 0.9)
"""The simulator draws each push uniformly between these percentiles of the run's push delays."""


@dataclass(frozen=True, slots=True)
class RunCalibration:
    """A run's inputs to the simulator and its measured steps (which the simulator never sees)."""

    steps: int
    measured_steps: list[int]
    """The steps compared: after WARMUP_STEPS, before the last (which waits for the end's validation)."""
    real_step_seconds: list[float]
    real_wait_seconds: list[float]
    trainer_seconds_per_token: float
    """The trainer's busy time (step_seconds - rollout_wait_seconds) over the response tokens it
    trained, summed over the measured steps."""
    response_length_mean: float
    announce_seconds: float
    """Median delay from a step's end to the manager learning its version (the publish record's time)."""
    shared_push_seconds: tuple[float, float]
    """Percentiles (PUSH_PERCENTILES) of the delay from a step's end to the first instance serving
    its version: what every instance waits for alike (the upload to the weights service)..."""
    push_seconds: tuple[float, float]
    """...and of each instance's delay beyond that first one."""
    push_delays: dict[int, list[float]]
    """By step, the delay from its end to each instance serving its version."""


def step_records(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "step_seconds" in r}


def measured_steps(steps: dict[int, dict], warmup: int = WARMUP_STEPS) -> list[int]:
    last = max(steps)
    return [s for s in sorted(steps) if warmup < s < last]


def trainer_seconds_per_token(steps: list[dict], samples_per_step: int) -> float:
    busy = sum(r["step_seconds"] - r["rollout_wait_seconds"] for r in steps)
    tokens = sum(r["response_length"] * samples_per_step for r in steps)
    return busy / tokens


def announce_delays(records: list[dict], steps: list[int]) -> list[float]:
    """Per step, from its record (written as it ends) to its publish record (written once the
    manager accepted the version); never below 0 (both times are the trainer's)."""
    by_step = step_records(records)
    published = {r["step"]: r["time"] for r in records if "publish_seconds" in r}
    return [max(0.0, published[s] - by_step[s]["time"]) for s in steps if s in published]


def log_time(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def push_delays(records: list[dict], weights_log: list[str], steps: list[int]) -> dict[int, list[float]]:
    """By step, from its record to each of the weights service's "pushed" lines of its version
    (logged once the instance committed it)."""
    by_step = step_records(records)
    step_of_version = {int(by_step[s]["weight_version"]): s for s in steps}
    delays: dict[int, list[float]] = {}
    for line in weights_log:
        entry = json.loads(line)
        if entry.get("event") != "pushed" or entry.get("weight_version") not in step_of_version:
            continue
        step = step_of_version[entry["weight_version"]]
        delays.setdefault(step, []).append(max(0.0, log_time(entry["timestamp"]) - by_step[step]["time"]))
    return delays


def push_ranges(delays: dict[int, list[float]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """(shared, own) ranges of the push delays: the first instance's of each version, and every
    instance's beyond it, each between PUSH_PERCENTILES."""
    shared = [min(pushes) for pushes in delays.values()]
    own = [delay - min(pushes) for pushes in delays.values() for delay in pushes]
    low, high = PUSH_PERCENTILES
    return (percentile(shared, low), percentile(shared, high)), (percentile(own, low), percentile(own, high))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def calibrate(records: list[dict], weights_log: list[str], samples_per_step: int) -> RunCalibration:
    by_step = step_records(records)
    steps = measured_steps(by_step)
    measured = [by_step[s] for s in steps]
    pushes = push_delays(records, weights_log, steps)
    shared, own = push_ranges(pushes)
    return RunCalibration(
        steps=max(by_step),
        measured_steps=steps,
        real_step_seconds=[r["step_seconds"] for r in measured],
        real_wait_seconds=[r["rollout_wait_seconds"] for r in measured],
        trainer_seconds_per_token=trainer_seconds_per_token(measured, samples_per_step),
        response_length_mean=statistics.mean(r["response_length"] for r in measured),
        announce_seconds=statistics.median(announce_delays(records, steps)),
        shared_push_seconds=shared,
        push_seconds=own,
        push_delays=pushes,
    )


def calibrate_run(output_dir: Path, samples_per_step: int) -> RunCalibration:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    weights_log = (output_dir / "logs" / "weights.log").read_text().splitlines()
    return calibrate(records, weights_log, samples_per_step)


@dataclass(frozen=True, slots=True)
class DecodeSpeed:
    """The torch engine's rate (tokens/s) for a lone sequence and for a batch of `batch`."""

    lone_tokens_per_second: float
    batch: int
    batch_tokens_per_second: float


async def torch_decode_speed(
    model_dir: Path, prompt: list[int], max_tokens: int, batch: int, rounds: int = 3
) -> DecodeSpeed:
    """The torch engine on one thread (the rollout default), as `rlmesh up` runs it: requests of the
    job's prompt length and max_tokens with no stop token (each runs max_tokens steps, prefill
    included), alone and `batch` at once; each rate the median of `rounds` measured in turn."""
    import torch

    from services.rollout.engine import EngineRequest, Sampling
    from services.rollout.torch.engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(model_dir, max_batch_size=batch)
    await engine.start()
    try:

        async def tokens_per_second(count: int, tag: str) -> float:
            async def one(index: int) -> int:
                request = EngineRequest(f"{tag}-{index}", prompt, Sampling(temperature=1.0, max_tokens=max_tokens))
                return sum([len(chunk.token_ids) async for chunk in engine.generate(request)])

            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(count))))
            return tokens / (time.perf_counter() - started)

        await tokens_per_second(batch, "warmup")
        lone, full = [], []
        for i in range(rounds):
            lone.append(await tokens_per_second(1, f"lone{i}"))
            full.append(await tokens_per_second(batch, f"batch{i}"))
    finally:
        await engine.stop()
    return DecodeSpeed(statistics.median(lone), batch, statistics.median(full))
