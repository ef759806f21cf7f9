"""The scenarios the scale benchmark runs: a reference fleet of GPU-class instances with a trainer
sized to it, and the small synthetic meshes the simulator is checked against on this machine."""

from __future__ import annotations

from bench.simulation.fleet import InstanceModel
from bench.simulation.trainer import TrainerModel
from bench.simulation.world import Scenario
from services.rollout.synthetic_engine import SyntheticConfig

TOKEN_UNIT = 16
"""At fleet scale a simulated token stands for a 16-token chunk: a step of a thousand instances
then fits this machine's memory, and the manager sees a chunk where it would see one."""
INSTANCE_TOKENS_PER_SECOND = 4000.0
SATURATION_BATCH = 32
MAX_BATCH = 64
MEAN_TOKENS, SIGMA, MAX_TOKENS = 1024, 0.7, 4096
PROMPTS_PER_INSTANCE, GROUP_SIZE = 6, 8
TRAINER_STEP_SECONDS = 15.0
"""The trainer's time for a step of the full fleet's batch: the fleet needs about 80 % of it."""
MAX_STALENESS = 4
STEPS = 120
"""Enough steps (about 30 minutes) for the burst to leave and come back."""


def reference(fleet: int, steps: int = STEPS, max_staleness: int = MAX_STALENESS) -> Scenario:
    """`fleet` instances of 4,000 tok/s (saturating at 32 sequences), 6 prompts × 8 per instance a
    step, lognormal lengths (mean 1,024, σ 0.7, at most 4,096), a trainer whose step takes 15 s."""
    unit = TOKEN_UNIT
    instance = InstanceModel(
        throughput=INSTANCE_TOKENS_PER_SECOND / unit,
        min_step_seconds=SATURATION_BATCH * unit / INSTANCE_TOKENS_PER_SECOND,
        max_batch_size=MAX_BATCH,
        lengths=SyntheticConfig(length="lognormal", mean_tokens=MEAN_TOKENS / unit, sigma=SIGMA),
        stream_interval=1,
    )
    step_units = fleet * PROMPTS_PER_INSTANCE * GROUP_SIZE * MEAN_TOKENS / unit
    trainer = TrainerModel(
        prompts_per_step=fleet * PROMPTS_PER_INSTANCE,
        group_size=GROUP_SIZE,
        max_tokens=MAX_TOKENS // unit,
        seconds_per_token=TRAINER_STEP_SECONDS / step_units,
    )
    return Scenario(
        fleet=fleet,
        instance=instance,
        trainer=trainer,
        steps=steps,
        max_staleness=max_staleness,
        token_unit=unit,
        boot_seconds=60.0,
    )


SMALL_THROUGHPUT, SMALL_MIN_STEP, SMALL_MAX_BATCH = 2000.0, 0.004, 16
SMALL_MEAN, SMALL_SIGMA, SMALL_MAX_TOKENS, SMALL_STREAM = 128, 0.7, 512, 8
SMALL_SPEEDS = (1.0, 0.8, 1.25)
SMALL_PROMPTS, SMALL_GROUP, SMALL_STEPS = 16, 8, 3


def small_engine_settings() -> dict[str, str]:
    """The synthetic rollout settings of the small meshes (environment names without the prefix)."""
    return {
        "ENGINE__MAX_BATCH_SIZE": str(SMALL_MAX_BATCH),
        "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": str(SMALL_THROUGHPUT),
        "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": str(SMALL_MIN_STEP),
        "ENGINE__SYNTHETIC__LENGTH": "lognormal",
        "ENGINE__SYNTHETIC__MEAN_TOKENS": str(SMALL_MEAN),
        "ENGINE__SYNTHETIC__SIGMA": str(SMALL_SIGMA),
        "ENGINE__SYNTHETIC__STREAM_INTERVAL": str(SMALL_STREAM),
    }


def small(instances: int) -> Scenario:
    """The mesh `bench.scale` also runs for real: synthetic instances at the speeds SMALL_SPEEDS,
    synchronous steps of 16 prompts × 8, every token as it is (no unit), the server's own periods."""
    instance = InstanceModel(
        throughput=SMALL_THROUGHPUT,
        min_step_seconds=SMALL_MIN_STEP,
        max_batch_size=SMALL_MAX_BATCH,
        lengths=SyntheticConfig(length="lognormal", mean_tokens=SMALL_MEAN, sigma=SMALL_SIGMA),
        stream_interval=SMALL_STREAM,
    )
    trainer = TrainerModel(SMALL_PROMPTS, SMALL_GROUP, SMALL_MAX_TOKENS, seconds_per_token=0.0, publishes=False)
    return Scenario(
        fleet=instances,
        instance=instance,
        trainer=trainer,
        steps=SMALL_STEPS,
        max_staleness=0,
        speeds=(1.0, 1.0),
        fixed_speeds=SMALL_SPEEDS[:instances],
        tick_seconds=0.005,
        flush_seconds=SMALL_STREAM / SMALL_THROUGHPUT * SMALL_MAX_BATCH,
        measure_seconds=0.25,
        push_seconds=(0.0, 0.0),
    )
