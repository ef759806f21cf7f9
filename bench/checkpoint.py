"""Checkpoint overhead: the default job's step time around a background checkpoint against normal
steps of the same run and of a same-length run without checkpoints (same seed), on the built-in
tiny model and on a larger model of the same shape family and tokenizer."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import write_result
from bench.training_runs import TrainingRun, run_up
from rlmesh.logging import configure_logging
from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model

CHECKPOINT_EVERY = 3
"""A checkpoint step, the step after it (the background write competes with it for CPU), then a
normal step: every 2 would leave no step of the run untouched by a checkpoint."""
NO_CHECKPOINTS = 1_000_000
"""checkpoint_every of the baseline run: only its last step writes one (excluded, as everywhere)."""
WARMUP_STEPS = CHECKPOINT_EVERY
"""Steps left out at the start: the first checkpoint sets up the writer's thread and plans."""
TARGET_RATIO = 0.9
LARGER_MODEL = TinyModelSpec(
    hidden_size=512, intermediate_size=1536, layers=8, heads=8, kv_heads=4, warmup_iterations=10
)
"""About 26 M parameters (the tiny model has 0.4 M): 0.3 GB of checkpoint with Adam's moments.
The short warm-up is enough: this run measures time, not reward."""


@dataclass
class StepTimes:
    checkpoint_steps: list[float]
    """step_seconds + checkpoint_seconds (what the loop waited for the checkpoint) of each step that wrote one."""
    following_steps: list[float]
    """step_seconds of each step right after one that wrote a checkpoint."""
    normal_steps: list[float]
    checkpoint_blocked: list[float]
    """checkpoint_seconds alone."""
    rollout_waits: dict[str, list[float]]
    """rollout_wait_seconds (part of step_seconds) by kind of step: "checkpoint", "following", "normal"."""
    window_seconds: float
    """Wall-clock time of the measured steps, their checkpoints included."""
    checkpoint_bytes: int

    @classmethod
    def of(cls, run: TrainingRun, checkpoint_every: int) -> StepTimes:
        """Steps after the warm-up and before the last one (which writes the HF export, synchronously)."""
        steps = {r["step"]: r for r in run.steps}
        blocked = {r["step"]: r["checkpoint_seconds"] for r in run.records if "checkpoint_seconds" in r}
        measured = range(WARMUP_STEPS + 1, max(steps))
        # A step's checkpoint record follows its step record: the window runs from the last record
        # of the warm-up's last step to the last record of the last measured step.
        ended = {r["step"]: r["time"] for r in run.records}
        times = cls(
            [],
            [],
            [],
            [],
            {"checkpoint": [], "following": [], "normal": []},
            ended[max(measured)] - ended[WARMUP_STEPS],
            checkpoint_bytes(run),
        )
        for step in measured:
            seconds = steps[step]["step_seconds"]
            if step % checkpoint_every == 0:
                kind = "checkpoint"
                times.checkpoint_steps.append(seconds + blocked[step])
                times.checkpoint_blocked.append(blocked[step])
            elif step % checkpoint_every == 1:
                kind = "following"
                times.following_steps.append(seconds)
            else:
                kind = "normal"
                times.normal_steps.append(seconds)
            times.rollout_waits[kind].append(steps[step]["rollout_wait_seconds"])
        return times


def checkpoint_bytes(run: TrainingRun) -> int:
    """Bytes of the sharded model and optimizer state (every rank's shard file) in the run's last checkpoint."""
    return sum(f.stat().st_size for f in Path(run.summary["checkpoint"]).glob("shards_rank*.pt"))


def figures_of(model: str, with_checkpoints: StepTimes, without: StepTimes) -> tuple[dict, dict, dict, dict]:
    """(figures, baseline, ratios, targets) of one model's pair of runs; ratios are normal / with a checkpoint."""
    mean, median = statistics.mean, statistics.median
    normal, baseline_steps = with_checkpoints.normal_steps, without.normal_steps
    pair = [(c + f) / 2 for c, f in zip(with_checkpoints.checkpoint_steps, with_checkpoints.following_steps)]
    figures = {
        f"{model}_checkpoint_mb": with_checkpoints.checkpoint_bytes / 1e6,
        f"{model}_checkpoint_blocked_seconds_mean": mean(with_checkpoints.checkpoint_blocked),
        f"{model}_checkpoint_step_seconds_mean": mean(with_checkpoints.checkpoint_steps),
        f"{model}_checkpoint_step_seconds_median": median(with_checkpoints.checkpoint_steps),
        f"{model}_following_step_seconds_mean": mean(with_checkpoints.following_steps),
        f"{model}_following_step_seconds_median": median(with_checkpoints.following_steps),
        f"{model}_checkpoint_step_rollout_wait_mean": mean(with_checkpoints.rollout_waits["checkpoint"]),
        f"{model}_following_step_rollout_wait_mean": mean(with_checkpoints.rollout_waits["following"]),
        f"{model}_checkpoints_measured": len(with_checkpoints.checkpoint_steps),
        f"{model}_window_seconds": with_checkpoints.window_seconds,
    }
    baseline = {
        f"{model}_same_run_normal_step_seconds_mean": mean(normal),
        f"{model}_same_run_normal_step_seconds_median": median(normal),
        f"{model}_same_run_normal_step_rollout_wait_mean": mean(with_checkpoints.rollout_waits["normal"]),
        f"{model}_no_checkpoint_run_step_seconds_mean": mean(baseline_steps),
        f"{model}_no_checkpoint_run_step_seconds_median": median(baseline_steps),
        f"{model}_no_checkpoint_run_rollout_wait_mean": mean(without.rollout_waits["normal"]),
        f"{model}_no_checkpoint_run_window_seconds": without.window_seconds,
    }
    ratios = {}
    for reference, steps in (("same_run", normal), ("no_checkpoint_run", baseline_steps)):
        ratios |= {
            f"{model}_{reference}_normal_over_checkpoint_step": mean(steps) / mean(with_checkpoints.checkpoint_steps),
            f"{model}_{reference}_normal_over_following_step": mean(steps) / mean(with_checkpoints.following_steps),
            f"{model}_{reference}_normal_over_checkpoint_pair": mean(steps) / mean(pair),
            f"{model}_{reference}_median_normal_over_checkpoint_step": median(steps)
            / median(with_checkpoints.checkpoint_steps),
            f"{model}_{reference}_median_normal_over_following_step": median(steps)
            / median(with_checkpoints.following_steps),
        }
    ratios[f"{model}_no_checkpoint_run_window_over_checkpoint_run_window"] = (
        without.window_seconds / with_checkpoints.window_seconds
    )
    targets = {
        f"{model}: normal / checkpoint step >= {TARGET_RATIO} ({reference}, means)": ratios[
            f"{model}_{reference}_normal_over_checkpoint_step"
        ]
        >= TARGET_RATIO
        for reference in ("same_run", "no_checkpoint_run")
    } | {
        f"{model}: normal / following step >= {TARGET_RATIO} ({reference}, means)": ratios[
            f"{model}_{reference}_normal_over_following_step"
        ]
        >= TARGET_RATIO
        for reference in ("same_run", "no_checkpoint_run")
    }
    return figures, baseline, ratios, targets


def main(steps: dict[str, int], seed: int, keep_dir: Path | None) -> dict:
    configure_logging("warning")
    work = keep_dir or Path(tempfile.mkdtemp(prefix="rlmesh-bench-checkpoint-"))
    print(f"runs in {work}", flush=True)
    models = {"tiny": None, "larger": create_default_model(work / "larger-model", LARGER_MODEL)}
    figures, baseline, ratios, targets = {}, {}, {}, {}
    for model, model_dir in models.items():
        times = {}
        for checkpoint_every in (CHECKPOINT_EVERY, NO_CHECKPOINTS):
            # Held-out evaluation only before the first step and after the last, inline, so that no
            # measured step shares the machine with one.
            run = run_up(
                work / f"{model}-every{checkpoint_every}",
                steps[model],
                [
                    f"algorithm.seed={seed}",
                    f"algorithm.checkpoint_every={checkpoint_every}",
                    f"algorithm.eval_every={steps[model]}",
                    "algorithm.validation=inline",
                ],
                model_dir=model_dir,
            )
            times[checkpoint_every] = StepTimes.of(run, checkpoint_every)
            print(f"{model}, checkpoint_every {checkpoint_every}: {run.process_seconds:.0f} s", flush=True)
        parts = figures_of(model, times[CHECKPOINT_EVERY], times[NO_CHECKPOINTS])
        for collected, part in zip((figures, baseline, ratios, targets), parts):
            collected |= part
    return write_result(
        "checkpoint",
        figures,
        baseline,
        ratios,
        targets,
        settings={
            "steps": steps,
            "seed": seed,
            "checkpoint_every": CHECKPOINT_EVERY,
            "warmup_steps": WARMUP_STEPS,
            "larger_model": asdict(LARGER_MODEL),
            "job": "the default (increment task, 16 prompts x 8 samples per step, max_staleness 1)",
            "step time": "step_seconds (rollout wait, training and publishing); a checkpoint step adds "
            "checkpoint_seconds; the last step (synchronous HF export) is left out",
            "runs_dir": str(work),
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny-steps", type=int, default=150, help="steps of each run of the built-in tiny model")
    parser.add_argument("--larger-steps", type=int, default=30, help="steps of each run of the larger model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-dir", type=Path, help="where the runs' outputs go (default: a new temporary folder)")
    args = parser.parse_args()
    main({"tiny": args.tiny_steps, "larger": args.larger_steps}, args.seed, args.runs_dir)
