"""Asynchrony: training steps per hour at max_staleness η = 1, 2, 4 against η = 0 on the same
resources (the real trainer on the built-in tiny model, one synthetic rollout instance calibrated
to it, long-tailed response lengths), and how that ratio grows with the length tail."""

from __future__ import annotations

import os

# Set before grpc loads: the bench forks service processes while its channels are open, and gRPC
# would log a line per fork that it skipped its fork handlers (they have nothing to protect).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import argparse
import asyncio
import json
import math
import platform
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common import QUIET_CORES, BenchMesh, InstanceSpec, OtherProcesses, QuietMachine, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.job import DEFAULT_MODELS
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import spawn_service, wait_started
from rlmesh.models.families import is_model_dir
from rlmesh.models.qwen2_tiny import create_default_model

ROOT = Path(__file__).resolve().parent.parent
STALENESS = (0, 1, 2, 4)
TAILS = (8.0, 2.0, 4.0)
"""p99/p50 of the response lengths; the first is the main one (every η), the others compare η = 0
with the best η of the main one."""
TARGET_RATIO = 2.8
"""AReaL reports 2.77x over synchronous RL on the same GPUs."""
PROMPTS_PER_STEP, GROUP_SIZE, MICRO_BATCH_GROUPS = 16, 8, 4
"""The default job's step: 128 samples, trained in micro-batches of 4 groups as they finish."""
MEAN_TOKENS = 24
MAX_TOKENS = 512
"""Caps a response: beyond the longest response of a run at the longest tail, so the tail is not cut."""
MAX_BATCH = 256
"""Sequences the rollout instance decodes at once (the torch engine's default)."""
STREAM_INTERVAL = 16
"""Tokens per chunk streamed to the manager, as vLLM's stream_interval."""
TINY_VOCABULARY = 14
"""The built-in model's vocabulary: the synthetic engine's token ids must stay below it."""
FAST_THROUGHPUT, FAST_MIN_STEP_SECONDS = 1e7, 1e-4
"""A synthetic engine far faster than the trainer: the calibration run measures the trainer alone."""
PROBE_PROMPTS, PROBE_GROUP = 128, 16
"""A batch generated after each calibration run with the same length settings, to measure the tail."""
Z99 = 2.3263
"""The standard normal's 99th percentile: a lognormal's p99/p50 is exp(Z99 * sigma)."""
POLL_SECONDS = 0.1
"""How often the manager is asked how many samples run and how many tokens were generated."""
TRAINER_TIMEOUT_SECONDS = 900
KNEE_ROUNDS = 5
"""One measurement of a full batch's rate varied by a third from the next on this kind of machine;
the knee sets the tail's cost, so it is the median of several, each rate measured in turn."""
DRIFT_TOLERANCE = 0.1
"""The main tail's calibration is repeated after its runs: a trainer step or a knee that moved by
more than this fraction means the machine's speed changed under the runs (a shared host), and
their ratios are flagged as not comparable."""


def sigma_for(p99_over_p50: float) -> float:
    return math.log(p99_over_p50) / Z99


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])


@dataclass
class Window:
    warmup_steps: int
    measured_steps: int

    @property
    def first(self) -> int:
        """The step whose end starts the window."""
        return self.warmup_steps

    @property
    def last(self) -> int:
        return self.warmup_steps + self.measured_steps

    def steps(self, max_staleness: int) -> int:
        """Steps to train: the window, then η more, so that no measured step is trained after the
        trainer stopped submitting (the last η batches generate with the instance to themselves)."""
        return self.last + max_staleness


@dataclass
class TrainingRun:
    records: list[dict]
    """The trainer's step records (metrics.jsonl), by step."""
    engine: list[tuple[float, int, int]]
    """(time, tokens generated so far, samples running) as the manager reported them every POLL_SECONDS."""
    other_processes_cores: float
    probe_lengths: list[int] = field(default_factory=list)

    def window(self, window: Window) -> tuple[float, float, list[dict]]:
        """(start, end, step records) of the measured steps."""
        by_step = {r["step"]: r for r in self.records}
        return (
            by_step[window.first]["time"],
            by_step[window.last]["time"],
            [by_step[s] for s in range(window.first + 1, window.last + 1)],
        )


@dataclass
class Calibration:
    p99_over_p50: float
    sigma: float
    trainer_seconds_per_step: float
    """The trainer's step period with rollouts ready at once (the fast engine, η = 1)."""
    response_tokens_per_step: float
    knee_batch: float
    """Sequences at which the torch engine stops being latency-bound (see `torch_engine_knee`)."""
    probe_p50: float
    probe_p99: float
    probe_max: int
    other_processes_cores: float

    @property
    def throughput_tokens_per_second(self) -> float:
        """At a full batch the synthetic instance generates a step's tokens in the trainer's step time."""
        return self.response_tokens_per_step / self.trainer_seconds_per_step

    @property
    def min_step_seconds(self) -> float:
        """A lone sequence's decode step: puts the synthetic instance's knee where the torch engine's is."""
        return self.knee_batch / self.throughput_tokens_per_second


@dataclass
class RunFigures:
    steps_per_hour: float
    step_seconds_mean: float
    rollout_wait_seconds_mean: float
    staleness_mean: float
    response_length_mean: float
    generation_utilization: float
    """Tokens generated per second over the window, over the instance's full-batch throughput."""
    below_knee_fraction: float
    """Share of the window the instance ran fewer sequences than its knee (it had capacity to spare)."""
    other_processes_cores: float

    @classmethod
    def of(cls, run: TrainingRun, window: Window, calibration: Calibration) -> RunFigures:
        """Steps per hour between the end of the last warm-up step and the end of the last measured
        step; means over the measured steps."""
        start, end, measured = run.window(window)
        polls = [p for p in run.engine if start <= p[0] <= end]
        generated = (polls[-1][1] - polls[0][1]) / (polls[-1][0] - polls[0][0])
        return cls(
            steps_per_hour=3600 * window.measured_steps / (end - start),
            step_seconds_mean=statistics.mean(r["step_seconds"] for r in measured),
            rollout_wait_seconds_mean=statistics.mean(r["rollout_wait_seconds"] for r in measured),
            staleness_mean=statistics.mean(r["staleness_mean"] for r in measured),
            response_length_mean=statistics.mean(r["response_length"] for r in measured),
            generation_utilization=generated / calibration.throughput_tokens_per_second,
            below_knee_fraction=sum(p[2] < calibration.knee_batch for p in polls) / len(polls),
            other_processes_cores=run.other_processes_cores,
        )


def builtin_model() -> Path:
    model_dir = DEFAULT_MODELS["tiny-increment"].resolve()
    if not is_model_dir(model_dir):
        create_default_model(model_dir)
    return model_dir


async def torch_engine_knee(model_dir: Path, max_tokens: int = 48) -> dict[str, float]:
    """The torch engine on the tiny model, one thread (the rollout default): a lone sequence's
    rate and a full batch's, each the median of KNEE_ROUNDS measured in turn. Their ratio is the
    batch beyond which a decode step costs more than a lone sequence's; the synthetic instance is
    given the same knee."""
    from services.rollout.engine import EngineRequest, Sampling
    from services.rollout.torch.engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(model_dir, max_batch_size=MAX_BATCH)
    await engine.start()
    try:

        async def tokens_per_second(batch: int, tag: str) -> float:
            async def one(index: int) -> int:
                # No stop tokens: every sequence runs max_tokens steps.
                request = EngineRequest(
                    f"{tag}-{index}", [1, 2, 3, 4, 5, 6, 10], Sampling(temperature=1.0, max_tokens=max_tokens)
                )
                return sum([len(chunk.token_ids) async for chunk in engine.generate(request)])

            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(batch))))
            return tokens / (time.perf_counter() - started)

        await tokens_per_second(16, "warmup")
        lone_rates, full_rates = [], []
        for i in range(KNEE_ROUNDS):
            lone_rates.append(await tokens_per_second(1, f"lone{i}"))
            full_rates.append(await tokens_per_second(MAX_BATCH, f"full{i}"))
        lone, full = statistics.median(lone_rates), statistics.median(full_rates)
    finally:
        await engine.stop()
    return {"lone_tokens_per_second": lone, "full_batch_tokens_per_second": full, "knee_batch": full / lone}


def synthetic_instance(model_dir: Path, sigma: float, throughput: float, min_step_seconds: float) -> InstanceSpec:
    """The instance declares its knee as its saturation batch, as a deployment sets the torch
    engine's (`engine.saturation_batch_size`): a decode step of more sequences gains no throughput."""
    saturation = min(MAX_BATCH, math.ceil(throughput * min_step_seconds))
    return InstanceSpec(
        "synthetic-0",
        1.0,
        {
            # The instance checks every weight push against the model's parameters, as a real one would.
            "ENGINE__MODEL_DIR": str(model_dir),
            "ENGINE__MAX_BATCH_SIZE": str(MAX_BATCH),
            "ENGINE__SATURATION_BATCH_SIZE": str(saturation),
            "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": f"{throughput:.6g}",
            "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": f"{min_step_seconds:.6g}",
            "ENGINE__SYNTHETIC__LENGTH": "lognormal",
            "ENGINE__SYNTHETIC__MEAN_TOKENS": str(MEAN_TOKENS),
            "ENGINE__SYNTHETIC__SIGMA": f"{sigma:.6g}",
            "ENGINE__SYNTHETIC__STREAM_INTERVAL": str(STREAM_INTERVAL),
            "ENGINE__SYNTHETIC__VOCAB_SIZE": str(TINY_VOCABULARY),
        },
    )


def trainer_config(model_dir: Path, output_dir: Path, steps: int, max_staleness: int) -> dict:
    return {
        "model_dir": str(model_dir),
        "output_dir": str(output_dir),
        "steps": steps,
        "prompts_per_step": PROMPTS_PER_STEP,
        "group_size": GROUP_SIZE,
        "micro_batch_groups": MICRO_BATCH_GROUPS,
        # What the README advises: the on-policy loss at η = 0, the decoupled one for stale rollouts.
        "loss": "decoupled" if max_staleness else "ppo",
        # Evaluation and checkpoints run inline between steps: here only before the first step and
        # after the last one, outside the measured window, on one held-out prompt.
        "eval_every": 1_000_000,
        "checkpoint_every": 1_000_000,
        "tasks": [
            {
                "name": "increment",
                "kind": "increment",
                "sampling": {"max_tokens": MAX_TOKENS},
                "eval": {"prompts": 1, "samples": 1},
            }
        ],
    }


async def run_trainer(
    mesh: BenchMesh, model_dir: Path, steps: int, max_staleness: int
) -> tuple[list[dict], list[tuple[float, int, int]]]:
    """Starts the weights service and the trainer on the mesh, polls the manager until the trainer
    exits; returns its step records and the polls."""
    weights_address = f"127.0.0.1:{free_port()}"
    weights = spawn_service(
        "weights",
        "services.weights",
        weights_address,
        {
            "RLMESH_WEIGHTS_SERVER__HOST": "127.0.0.1",
            "RLMESH_WEIGHTS_SERVER__PORT": weights_address.rsplit(":", 1)[1],
            "RLMESH_WEIGHTS_MANAGER_ADDRESS": mesh.manager_address,
            "RLMESH_WEIGHTS_SERVER__LOG_LEVEL": "warning",
            **mesh.auth.settings("RLMESH_WEIGHTS_", "weights"),
        },
        mesh.log_dir,
        str(mesh.log_dir),
    )
    mesh.children.append(weights)
    await wait_started([weights])
    output_dir = mesh.log_dir / "trainer-output"
    config_path = mesh.log_dir / "trainer.json"
    config_path.write_text(json.dumps(trainer_config(model_dir, output_dir, steps, max_staleness)))
    trainer_address = f"127.0.0.1:{free_port()}"
    trainer = spawn_service(
        "trainer",
        "services.trainer",
        trainer_address,
        {
            "RLMESH_TRAINER_SERVER__HOST": "127.0.0.1",
            "RLMESH_TRAINER_SERVER__PORT": trainer_address.rsplit(":", 1)[1],
            "RLMESH_TRAINER_MANAGER_ADDRESS": mesh.manager_address,
            "RLMESH_TRAINER_WEIGHTS_ADDRESS": weights_address,
            **mesh.auth.settings("RLMESH_TRAINER_", "trainer"),
        },
        mesh.log_dir,
        str(mesh.log_dir),
        args=["--config", str(config_path)],
    )
    mesh.children.append(trainer)
    deadline = time.monotonic() + TRAINER_TIMEOUT_SECONDS
    engine = []
    while trainer.process.poll() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainer did not finish within {TRAINER_TIMEOUT_SECONDS} s; see {trainer.log_path}")
        status = await mesh.status()
        engine.append((time.time(), status.generated_tokens, status.running_samples))
        await asyncio.sleep(POLL_SECONDS)
    if trainer.process.returncode != 0:
        raise RuntimeError(f"the trainer exited with code {trainer.process.returncode}; see {trainer.log_path}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward" in r], engine


class AsyncBench:
    def __init__(self, model_dir: Path, window: Window) -> None:
        self.model_dir = model_dir
        self.window = window
        self.quiet = QuietMachine()
        self.knee: dict[str, float] = {}

    async def measure_knee(self) -> dict[str, float]:
        await self.quiet.wait()
        return await torch_engine_knee(self.model_dir)

    async def train(self, max_staleness: int, instance: InstanceSpec, probe: bool = False) -> TrainingRun:
        """Once the machine is quiet, a fresh mesh (manager, weights service, the synthetic instance,
        the trainer) trains the window's steps; with `probe`, the instance then generates one more
        batch for its response lengths."""
        await self.quiet.wait()
        with OtherProcesses() as others:
            async with BenchMesh([instance], {"MAX_STALENESS": str(max_staleness)}) as mesh:
                records, engine = await run_trainer(
                    mesh, self.model_dir, self.window.steps(max_staleness), max_staleness
                )
                lengths = []
                if probe:
                    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
                    result = await mesh.run_step("length-probe", PROBE_PROMPTS, PROBE_GROUP, sampling)
                    lengths = [len(s.token_ids) for s in result.samples]
        # Logs are kept only when something failed (the errors name them).
        shutil.rmtree(mesh.log_dir, ignore_errors=True)
        return TrainingRun(records, engine, others.cores, lengths)

    async def calibrate(self, p99_over_p50: float, knee: dict[str, float] | None = None) -> Calibration:
        sigma = sigma_for(p99_over_p50)
        run = await self.train(
            1, synthetic_instance(self.model_dir, sigma, FAST_THROUGHPUT, FAST_MIN_STEP_SECONDS), probe=True
        )
        start, end, measured = run.window(self.window)
        calibration = Calibration(
            p99_over_p50=p99_over_p50,
            sigma=sigma,
            trainer_seconds_per_step=(end - start) / self.window.measured_steps,
            response_tokens_per_step=statistics.mean(r["response_length"] for r in measured)
            * PROMPTS_PER_STEP
            * GROUP_SIZE,
            knee_batch=(knee or self.knee)["knee_batch"],
            probe_p50=percentile(run.probe_lengths, 0.5),
            probe_p99=percentile(run.probe_lengths, 0.99),
            probe_max=max(run.probe_lengths),
            other_processes_cores=run.other_processes_cores,
        )
        print_calibration(knee or self.knee, calibration)
        return calibration

    async def measure(self, calibration: Calibration, max_staleness: int) -> RunFigures:
        instance = synthetic_instance(
            self.model_dir, calibration.sigma, calibration.throughput_tokens_per_second, calibration.min_step_seconds
        )
        figures = RunFigures.of(await self.train(max_staleness, instance), self.window, calibration)
        print(
            f"  p99/p50 {calibration.p99_over_p50:g}, η = {max_staleness}: {figures.steps_per_hour:5.0f} steps/h, "
            f"step {figures.step_seconds_mean:.3f} s, rollout wait {figures.rollout_wait_seconds_mean:.3f} s/step, "
            f"staleness {figures.staleness_mean:.2f}, generation at {figures.generation_utilization:.0%} of capacity "
            f"(below the knee {figures.below_knee_fraction:.0%} of the time); other processes "
            f"{figures.other_processes_cores:.2f} cores",
            flush=True,
        )
        return figures


async def measure_drift(bench: AsyncBench, before: Calibration) -> dict[str, float]:
    """The knee and the trainer's step measured again after the main tail's runs: their relative
    change since the calibration the runs used."""
    knee = await bench.measure_knee()
    after = await bench.calibrate(before.p99_over_p50, knee)
    drift = {
        "trainer_seconds_per_step": after.trainer_seconds_per_step / before.trainer_seconds_per_step - 1,
        "knee_batch": after.knee_batch / before.knee_batch - 1,
    }
    print(
        f"  again after the runs: the trainer alone {after.trainer_seconds_per_step:.3f} s/step "
        f"({drift['trainer_seconds_per_step']:+.1%}), knee {after.knee_batch:.1f} ({drift['knee_batch']:+.1%})",
        flush=True,
    )
    return drift


def print_calibration(knee: dict[str, float], calibration: Calibration) -> None:
    print(
        f"calibration, p99/p50 {calibration.p99_over_p50:g} (sigma {calibration.sigma:.3f}): "
        f"the trainer alone {calibration.trainer_seconds_per_step:.3f} s/step for "
        f"{calibration.response_tokens_per_step:.0f} response tokens -> synthetic throughput "
        f"{calibration.throughput_tokens_per_second:.0f} tok/s at a full batch; "
        f"torch engine knee {knee['knee_batch']:.1f} sequences ({knee['full_batch_tokens_per_second']:.0f} / "
        f"{knee['lone_tokens_per_second']:.0f} tok/s) -> a lone sequence's step "
        f"{1000 * calibration.min_step_seconds:.2f} ms; lengths generated: p50 {calibration.probe_p50:.0f}, "
        f"p99 {calibration.probe_p99:.0f} (p99/p50 {calibration.probe_p99 / calibration.probe_p50:.2f}), "
        f"longest {calibration.probe_max} of {PROBE_PROMPTS * PROBE_GROUP}; "
        f"other processes {calibration.other_processes_cores:.2f} cores",
        flush=True,
    )


def git_state() -> dict[str, object]:
    """The commit measured, and the files of the code that differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    changed = [line[3:] for line in git("status", "--porcelain", "--", "services", "rlmesh", "protos").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes_in_code": changed}


async def main(window: Window) -> dict:
    started = time.perf_counter()
    bench = AsyncBench(builtin_model(), window)
    bench.knee = await bench.measure_knee()
    calibrations: dict[float, Calibration] = {}
    runs: dict[float, dict[int, RunFigures]] = {}

    main_tail = TAILS[0]
    calibrations[main_tail] = await bench.calibrate(main_tail)
    runs[main_tail] = {eta: await bench.measure(calibrations[main_tail], eta) for eta in STALENESS}
    baseline = runs[main_tail][0].steps_per_hour
    ratios = {eta: runs[main_tail][eta].steps_per_hour / baseline for eta in STALENESS}
    drift = await measure_drift(bench, calibrations[main_tail])
    best = max((eta for eta in STALENESS if eta > 0), key=lambda eta: ratios[eta])
    for tail in TAILS[1:]:
        calibrations[tail] = await bench.calibrate(tail)
        runs[tail] = {eta: await bench.measure(calibrations[tail], eta) for eta in (0, best)}
    tail_ratios = {tail: runs[tail][best].steps_per_hour / runs[tail][0].steps_per_hour for tail in sorted(TAILS)}
    met = any(ratios[eta] >= TARGET_RATIO for eta in STALENESS if 0 < eta <= 4)
    contended = [
        f"calibration p99/p50 {tail:g}" for tail, c in calibrations.items() if c.other_processes_cores >= QUIET_CORES
    ]
    contended += [
        f"p99/p50 {tail:g} η = {eta}"
        for tail, by_eta in runs.items()
        for eta, f in by_eta.items()
        if f.other_processes_cores >= QUIET_CORES
    ]
    drifted = [name for name, change in drift.items() if abs(change) > DRIFT_TOLERANCE]

    print(
        f"\nsteps per hour by η, p99/p50 {main_tail:g} ({window.measured_steps} steps after {window.warmup_steps} "
        f"warm-up steps, same run; the trainer alone: {3600 / calibrations[main_tail].trainer_seconds_per_step:.0f} "
        "steps/h):"
    )
    print(f"{'η':>3} {'steps/h':>8} {'vs η=0':>7} {'staleness':>10} {'wait s/step':>12} {'generation':>11}")
    for eta, figures in runs[main_tail].items():
        print(
            f"{eta:>3} {figures.steps_per_hour:>8.0f} {ratios[eta]:>6.2f}x {figures.staleness_mean:>10.2f} "
            f"{figures.rollout_wait_seconds_mean:>12.3f} {figures.generation_utilization:>10.0%}"
        )
    print(f"\nthe length tail: η = {best} (the best above) against η = 0")
    print(
        f"{'p99/p50':>8} {'generated':>10} {'η=0 steps/h':>12} {f'η={best} steps/h':>12} {'ratio':>6} "
        f"{'trainer alone':>14}"
    )
    for tail in sorted(TAILS):
        calibration = calibrations[tail]
        print(
            f"{tail:>8g} {calibration.probe_p99 / calibration.probe_p50:>10.2f} "
            f"{runs[tail][0].steps_per_hour:>12.0f} {runs[tail][best].steps_per_hour:>12.0f} "
            f"{tail_ratios[tail]:>5.2f}x {3600 / calibration.trainer_seconds_per_step:>9.0f} /h"
        )
    print(
        f"\ntarget: >= {TARGET_RATIO}x at some η <= 4: {'met' if met else 'not met'} "
        f"(best {ratios[best]:.2f}x at η = {best}); {time.perf_counter() - started:.0f} s"
    )
    if contended:
        print(
            f"measured while other processes used {QUIET_CORES} cores or more (not comparable): {', '.join(contended)}"
        )
    if drifted:
        print(
            f"the machine's speed changed under the p99/p50 {main_tail:g} runs (more than {DRIFT_TOLERANCE:.0%}; "
            f"their ratios are not comparable): {', '.join(f'{name} {drift[name]:+.0%}' for name in drifted)}"
        )

    return write_result(
        "async",
        figures={
            **{f"steps_per_hour_eta{eta}": runs[main_tail][eta].steps_per_hour for eta in STALENESS if eta},
            **{f"tail{tail:g}_steps_per_hour_eta{best}": runs[tail][best].steps_per_hour for tail in sorted(TAILS)},
            "runs": {
                f"p99/p50 {tail:g}": {f"eta{eta}": asdict(f) for eta, f in by_eta.items()}
                for tail, by_eta in runs.items()
            },
            "drift_after_main_runs": drift,
            "calibration": {
                "torch_engine": bench.knee,
                **{
                    f"p99/p50 {tail:g}": {
                        **asdict(c),
                        "throughput_tokens_per_second": c.throughput_tokens_per_second,
                        "min_step_seconds": c.min_step_seconds,
                    }
                    for tail, c in calibrations.items()
                },
            },
        },
        baseline={
            "steps_per_hour_eta0": baseline,
            **{f"tail{tail:g}_steps_per_hour_eta0": runs[tail][0].steps_per_hour for tail in sorted(TAILS)},
        },
        ratios={
            **{f"eta{eta}_over_eta0": ratios[eta] for eta in STALENESS if eta},
            **{f"tail{tail:g}_eta{best}_over_eta0": tail_ratios[tail] for tail in sorted(TAILS)},
        },
        targets={f"eta<=4 over eta0 >= {TARGET_RATIO}": met},
        settings={
            **git_state(),
            "measured_while_other_processes_ran": contended,
            "machine_speed_drifted": drifted,
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
            "wall_seconds": time.perf_counter() - started,
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE,
            "micro_batch_groups": MICRO_BATCH_GROUPS,
            "warmup_steps": window.warmup_steps,
            "measured_steps": window.measured_steps,
            "lengths": f"lognormal, mean {MEAN_TOKENS} tokens, capped at {MAX_TOKENS}; sigma = ln(p99/p50) / {Z99}",
            "rollout": f"1 synthetic instance, max batch {MAX_BATCH}, saturation batch its knee (rounded up), "
            f"{STREAM_INTERVAL}-token chunks",
            "trainer": "services.trainer, 1 rank, 1 thread, the built-in tiny-increment model, default schedule; "
            "loss ppo at η = 0, decoupled at η >= 1; evaluation (1 held-out prompt) and checkpoints only before "
            "and after the measured window",
            "calibration": "throughput = a step's response tokens / the trainer's step period with rollouts ready "
            "at once (fast engine, η = 1); min_step_seconds = the torch engine's knee (median of "
            f"{KNEE_ROUNDS} rounds) / throughput; the main tail's calibration and the knee measured again "
            "after its runs (drift_after_main_runs)",
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measured-steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="8 measured steps instead of --measured-steps")
    parser.add_argument(
        "--knee-only",
        metavar="MODEL_DIR",
        nargs="?",
        const="",
        help="only measure the torch engine's knee (a value for rollout.engine.saturation_batch_size), "
        "on MODEL_DIR or the built-in model, and print it",
    )
    args = parser.parse_args()
    if args.knee_only is not None:
        model_dir = Path(args.knee_only) if args.knee_only else builtin_model()
        if not is_model_dir(model_dir):
            parser.error(f"--knee-only: {model_dir} is not a HF-format model folder (no config.json)")
        knee = asyncio.run(torch_engine_knee(model_dir))
        print(
            f"torch engine knee on {model_dir}: {knee['knee_batch']:.1f} sequences "
            f"({knee['full_batch_tokens_per_second']:.0f} tok/s at {MAX_BATCH} / "
            f"{knee['lone_tokens_per_second']:.0f} tok/s alone, one thread): "
            f"--set rollout.engine.saturation_batch_size={math.ceil(knee['knee_batch'])}"
        )
    else:
        asyncio.run(main(Window(args.warmup_steps, 8 if args.quick else args.measured_steps)))
