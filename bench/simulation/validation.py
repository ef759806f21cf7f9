"""The simulator against real `rlmesh up` runs at 1 to 3 rollout instances, on the torch engine (the
default job) and on the synthetic one (the same job, rollout.engine.kind = synthetic): each run's
step times against the simulator's for the same mesh, told only the run's component speeds."""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.common import OtherProcesses, QuietMachine
from bench.simulation import scenarios
from bench.simulation.calibration import DecodeSpeed, RunCalibration, calibrate_run, torch_decode_speed
from bench.simulation.fleet import InstanceModel
from bench.simulation.world import Simulation
from bench.training_runs import ROOT, run_up
from rlmesh.job import DEFAULT_MODELS, Job
from rlmesh.settings.rollout import SyntheticConfig

ENGINES = ("torch", "synthetic")
INSTANCE_COUNTS = (1, 2, 3)
STEPS = 30
SEEDS = 8
"""Simulations per run (seeds of lengths and pushes): the simulated step time is their mean."""
SYNTHETIC = SyntheticConfig(mean_tokens=8, sigma=0.5, stream_interval=16)
"""The synthetic engine of the validation job: lengths like the default task's (lognormal about 8
tokens, cut at its 12), chunks of 16 tokens as the torch engine's in a job, and the engine's own
speed (2,000 tok/s at a full batch, 4 ms a lone step): rollout sets the pace at one instance, and
rollout and training overlap at three."""
TORCH_LENGTH_HALF_WIDTH = 2.0
"""The default task's answers have 4 to 8 digits and an end-of-text token: the simulated torch
instance draws lengths uniformly within 2 tokens of the run's mean."""
DECODE_PROMPT = [1, 2, 3, 4, 5, 6, 10]
"""A prompt of the default task's length ("123456=")."""

SOURCES = {
    "synthetic decode model and lengths": "the synthetic engine's settings in the job (exact)",
    "torch decode model": "the torch engine measured in this process after the runs (one thread, "
    "the job's prompt length and max_tokens, a lone sequence and the step's whole batch)",
    "torch lengths": "the run's mean response_length (metrics.jsonl), uniform within "
    f"{TORCH_LENGTH_HALF_WIDTH:g} tokens",
    "trainer seconds per token": "the run's busy time, step_seconds - rollout_wait_seconds, over its "
    "response tokens, summed over the measured steps (metrics.jsonl)",
    "announce seconds": "median of the run's publish records' time less their step records' time (metrics.jsonl)",
    "push seconds": "the weights service's 'pushed' lines less their step records' time: 10th-90th "
    "percentile of each version's first (shared by every instance) and of each instance's delay beyond it",
    "compared": "step_seconds of the measured steps against the simulated steps of the same numbers; "
    "the simulator is never given a step time",
}


def job_settings(engine: str, steps: int) -> list[str]:
    """The default job with its validations and checkpoints only at the start and the end; on the
    synthetic engine with the SYNTHETIC settings."""
    settings = [f"algorithm.eval_every={steps}", f"algorithm.checkpoint_every={steps}"]
    if engine == "synthetic":
        settings.append("rollout.engine.kind=synthetic")
        settings += [
            f"rollout.engine.synthetic.{k}={v}" for k, v in SYNTHETIC.model_dump(exclude_defaults=True).items()
        ]
    return settings


def instance_model(engine: str, job: Job, calibration: RunCalibration, decode: DecodeSpeed | None) -> InstanceModel:
    engine_settings = job.rollout.engine
    if engine == "synthetic":
        return scenarios.synthetic_instance(SYNTHETIC, engine_settings.max_batch_size)
    assert decode is not None, "the torch engine's decode speed is measured first"
    mean = calibration.response_length_mean
    lengths = SyntheticConfig(length="uniform", mean_tokens=mean, sigma=TORCH_LENGTH_HALF_WIDTH / mean)
    return scenarios.torch_instance(decode, lengths, engine_settings.max_batch_size, engine_settings.stream_interval)


def simulated_step_seconds(instance: InstanceModel, calibration: RunCalibration, instances: int, job: Job) -> dict:
    """Per seed, the simulated times of the run's measured steps; their mean, and the simulated
    trainer's mean wait for rollouts in them."""
    per_seed, waits = [], []
    for seed in range(SEEDS):
        simulation = Simulation(scenarios.real_mesh(instance, calibration, instances, job), "steady", seed=seed)
        simulation.run()
        ends = [0.0, *simulation.trainer.accounts.step_ends]
        per_seed.append([ends[s] - ends[s - 1] for s in calibration.measured_steps])
        waits.append(statistics.mean(simulation.trainer.reports[s - 1][2] for s in calibration.measured_steps))
    return {
        "step_seconds": [statistics.mean(times) for times in zip(*per_seed, strict=True)],
        "seed_means": [statistics.mean(times) for times in per_seed],
        "wait_seconds_mean": statistics.mean(waits),
    }


def figures_of(calibration: RunCalibration, instance: InstanceModel, simulated: dict) -> dict:
    real_mean = statistics.mean(calibration.real_step_seconds)
    simulated_mean = statistics.mean(simulated["seed_means"])
    return {
        "measured_steps": calibration.measured_steps,
        "real_step_seconds": calibration.real_step_seconds,
        "real_step_seconds_mean": real_mean,
        "real_rollout_wait_seconds_mean": statistics.mean(calibration.real_wait_seconds),
        "simulated_step_seconds": simulated["step_seconds"],
        "simulated_step_seconds_mean": simulated_mean,
        "simulated_seed_means": simulated["seed_means"],
        "simulated_rollout_wait_seconds_mean": simulated["wait_seconds_mean"],
        "simulated_over_real": simulated_mean / real_mean,
        "inputs": {
            "trainer_seconds_per_token": calibration.trainer_seconds_per_token,
            "response_length_mean": calibration.response_length_mean,
            "announce_seconds": calibration.announce_seconds,
            "shared_push_seconds": list(calibration.shared_push_seconds),
            "push_seconds": list(calibration.push_seconds),
            "instance_tokens_per_second": instance.throughput,
            "instance_min_step_seconds": instance.min_step_seconds,
        },
    }


async def compare(
    engines: tuple[str, ...] = ENGINES, instance_counts: tuple[int, ...] = INSTANCE_COUNTS, steps: int = STEPS
) -> dict:
    """Per engine and instance count: the real and simulated step times and simulated ÷ real of
    their means; the torch engine's measured decode speed. The real runs come first, one after
    the other, each once the machine is quiet (QuietMachine), then the decode measurement (the
    torch runs created the model), then the simulations."""
    job = Job()
    samples = job.algorithm.prompts_per_step * job.algorithm.group_size
    calibrations: dict[tuple[str, int], RunCalibration] = {}
    other_cores: dict[tuple[str, int], float] = {}
    """What other processes of this (shared) machine used during each run: it shows in its times."""
    quiet = QuietMachine()
    with tempfile.TemporaryDirectory(prefix="rlmesh-scale-validation-") as scratch:
        for engine in engines:
            for count in instance_counts:
                output_dir = Path(scratch) / f"{engine}-{count}"
                await quiet.wait()
                with OtherProcesses() as others:
                    run_up(output_dir, steps, job_settings(engine, steps), ["--rollout-instances", str(count)])
                calibrations[engine, count] = calibrate_run(output_dir, samples)
                other_cores[engine, count] = others.cores
    decode = None
    if "torch" in engines:
        model_dir = ROOT / DEFAULT_MODELS[job.model.builtin]
        await quiet.wait()
        decode = await torch_decode_speed(model_dir, DECODE_PROMPT, job.tasks[0].max_tokens, samples)
    runs: dict[str, dict[str, dict]] = {}
    for (engine, count), calibration in calibrations.items():
        instance = instance_model(engine, job, calibration, decode)
        figures = figures_of(calibration, instance, simulated_step_seconds(instance, calibration, count, job))
        figures["other_processes_cores"] = other_cores[engine, count]
        runs.setdefault(engine, {})[str(count)] = figures
        print(
            f"{engine}, {count} instance(s): real {figures['real_step_seconds_mean']:.3f} s a step "
            f"(waiting {figures['real_rollout_wait_seconds_mean']:.3f}), simulated "
            f"{figures['simulated_step_seconds_mean']:.3f} s (waiting "
            f"{figures['simulated_rollout_wait_seconds_mean']:.3f}): simulated ÷ real "
            f"{figures['simulated_over_real']:.3f}",
            flush=True,
        )
    return {"torch_decode": None if decode is None else asdict(decode), "runs": runs}
