"""Validation overhead: the default job's step time while a background validation runs on the
rollout instances, against the steps of the same run with none running, and against a same-seed
run that validates only at its start and end; with one rollout instance (the validation holds
the only one) and with two (it holds one, the other goes on with new versions)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import write_result
from bench.training_runs import TrainingRun, run_up
from rlmesh.logging import configure_logging

TARGET_RATIO = 0.9
WARMUP_STEPS = 2
"""Left out: the first steps pay for the processes' first calls."""
ROLLOUT_INSTANCES = (1, 2)


def split_steps(run: TrainingRun) -> tuple[list[dict], list[dict]]:
    """The step records whose wall-clock span overlaps a validation's, and the others. A
    validation record is written when it ends and carries how long it took (`eval/seconds`)."""
    windows = [(r["time"] - r["eval/seconds"], r["time"]) for r in run.evaluations if "eval/seconds" in r]
    during, outside = [], []
    for record in run.steps:
        if record["step"] <= WARMUP_STEPS or record["step"] == run.summary["steps"]:
            continue
        start, end = record["time"] - record["step_seconds"], record["time"]
        overlaps = any(start < stop and begin < end for begin, stop in windows)
        (during if overlaps else outside).append(record)
    return during, outside


def mean_of(records: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in records)


def measure(scratch: Path, instances: int, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """(figures, baseline, ratios) of one pair of runs, names prefixed with the instance count."""
    common = [f"algorithm.checkpoint_every={args.steps}"]
    flags = ["--max-staleness", str(args.max_staleness), "--rollout-instances", str(instances)]
    validating = run_up(
        scratch / f"validating-{instances}", args.steps, common + [f"algorithm.eval_every={args.eval_every}"], flags
    )
    quiet = run_up(scratch / f"quiet-{instances}", args.steps, common + [f"algorithm.eval_every={args.steps}"], flags)
    during, outside = split_steps(validating)
    baseline_steps = [r for r in quiet.steps if WARMUP_STEPS < r["step"] < quiet.summary["steps"]]
    evaluations = [r for r in validating.evaluations if "eval/seconds" in r]
    name = f"instances{instances}"
    figures = {
        f"{name}_step_seconds_during_validation": mean_of(during, "step_seconds"),
        f"{name}_rollout_wait_seconds_during_validation": mean_of(during, "rollout_wait_seconds"),
        f"{name}_steps_during_validation": len(during),
        f"{name}_validations": len(evaluations),
        f"{name}_validation_seconds_mean": mean_of(evaluations, "eval/seconds"),
        f"{name}_validations_skipped": len(validating.summary.get("validations_skipped", [])),
    }
    baseline = {
        f"{name}_step_seconds_no_validation_running": mean_of(outside, "step_seconds"),
        f"{name}_rollout_wait_seconds_no_validation_running": mean_of(outside, "rollout_wait_seconds"),
        f"{name}_steps_no_validation_running": len(outside),
        f"{name}_step_seconds_run_without_validations": mean_of(baseline_steps, "step_seconds"),
    }
    during_seconds = figures[f"{name}_step_seconds_during_validation"]
    ratios = {
        f"{name}_no_validation_over_during (same run)": baseline[f"{name}_step_seconds_no_validation_running"]
        / during_seconds,
        f"{name}_run_without_over_during": baseline[f"{name}_step_seconds_run_without_validations"] / during_seconds,
    }
    return figures, baseline, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--rollout-instances", type=int, nargs="+", default=list(ROLLOUT_INSTANCES))
    args = parser.parse_args()
    configure_logging(service="bench")
    figures, baseline, ratios = {"held_out_prompts_per_validation": 64}, {}, {}
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-validation-") as scratch:
        for instances in args.rollout_instances:
            for collected, part in zip((figures, baseline, ratios), measure(Path(scratch), instances, args)):
                collected |= part
    targets = {
        f"{name} >= {TARGET_RATIO}": value >= TARGET_RATIO for name, value in ratios.items() if "same run" in name
    }
    write_result(
        "validation",
        figures,
        baseline,
        ratios,
        targets,
        {
            "steps": args.steps,
            "eval_every": args.eval_every,
            "max_staleness": args.max_staleness,
            "rollout_instances": args.rollout_instances,
            "validation": "background",
        },
    )


if __name__ == "__main__":
    main()
