"""The scenarios the scale benchmark runs: a reference fleet of GPU-class instances with a trainer
sized to it, and the real `rlmesh up` meshes of 1 to 3 instances the simulator is checked against."""

from __future__ import annotations

import math

from bench.simulation.calibration import DecodeSpeed, RunCalibration
from bench.simulation.fleet import InstanceModel
from bench.simulation.trainer import TrainerModel
from bench.simulation.world import Scenario
from rlmesh.job import Job
from rlmesh.settings.rollout import SyntheticConfig

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


MANAGER_WATCH_SECONDS = 0.25
"""How often the manager measures its instances' rates and moves stragglers (services/manager/leases.py)."""
REAL_TICK_SECONDS = 0.002
"""The event loop's granularity for real meshes: a synthetic engine's own tick."""


def synthetic_instance(config: SyntheticConfig, max_batch_size: int) -> InstanceModel:
    """A synthetic rollout instance of `rlmesh up`: its decode model and lengths are its settings,
    and it declares no saturation batch (the job's default)."""
    return InstanceModel(
        throughput=config.throughput_tokens_per_second * config.speed,
        min_step_seconds=config.min_step_seconds / config.speed,
        max_batch_size=max_batch_size,
        lengths=config,
        stream_interval=config.stream_interval,
        declares_saturation=False,
    )


def torch_instance(
    speed: DecodeSpeed, lengths: SyntheticConfig, max_batch_size: int, stream_interval: int
) -> InstanceModel:
    """A torch rollout instance of `rlmesh up` as the decode model sees it: a lone sequence's step
    from its measured lone rate, a full batch's throughput from its measured batch rate."""
    return InstanceModel(
        throughput=speed.batch_tokens_per_second,
        min_step_seconds=1 / speed.lone_tokens_per_second,
        max_batch_size=max_batch_size,
        lengths=lengths,
        stream_interval=stream_interval,
        declares_saturation=False,
    )


def real_mesh(instance: InstanceModel, calibration: RunCalibration, instances: int, job: Job) -> Scenario:
    """The mesh of a real `rlmesh up` run of `job` at `instances` rollout instances: every token as
    it is, the manager's own settings and periods, the job's step, the trainer and the weight plane
    as the run measured them (`calibration`)."""
    algorithm = job.algorithm
    trainer = TrainerModel(
        prompts_per_step=algorithm.prompts_per_step,
        group_size=algorithm.group_size,
        max_tokens=job.tasks[0].max_tokens,
        seconds_per_token=calibration.trainer_seconds_per_token,
        micro_batch_groups=algorithm.micro_batch_groups,
        announce_seconds=calibration.announce_seconds,
    )
    share = math.ceil(algorithm.prompts_per_step * algorithm.group_size / instances)
    return Scenario(
        fleet=instances,
        instance=instance,
        trainer=trainer,
        steps=calibration.steps,
        max_staleness=algorithm.max_staleness,
        speeds=(1.0, 1.0),
        tick_seconds=REAL_TICK_SECONDS,
        # A running sequence's tokens reach the manager a chunk (stream_interval tokens) at a time.
        flush_seconds=instance.stream_interval * max(instance.min_step_seconds, share / instance.throughput),
        measure_seconds=MANAGER_WATCH_SECONDS,
        lease_seconds=job.manager.lease_seconds,
        heartbeat_seconds=job.manager.heartbeat_interval_seconds,
        push_seconds=calibration.push_seconds,
        shared_push_seconds=calibration.shared_push_seconds,
        policy=job.manager.dispatch_policy,
    )
