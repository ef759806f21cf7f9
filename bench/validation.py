"""Validation overhead: the default job's step time while a background validation runs on the
rollout instance, against the steps of the same run with none running, and against a same-seed
run that validates only at its start and end."""

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
ROLLOUT_INSTANCES = 1


def split_steps(run: TrainingRun) -> tuple[list[float], list[float]]:
    """step_seconds of the steps whose wall-clock span overlaps a validation's, and of the others.
    A validation record is written when it ends and carries how long it took (`eval/seconds`)."""
    windows = [(r["time"] - r["eval/seconds"], r["time"]) for r in run.evaluations if "eval/seconds" in r]
    during, outside = [], []
    for record in run.steps:
        if record["step"] <= WARMUP_STEPS or record["step"] == run.summary["steps"]:
            continue
        start, end = record["time"] - record["step_seconds"], record["time"]
        overlaps = any(start < stop and begin < end for begin, stop in windows)
        (during if overlaps else outside).append(record["step_seconds"])
    return during, outside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--rollout-instances", type=int, default=ROLLOUT_INSTANCES)
    args = parser.parse_args()
    configure_logging(service="bench")
    common = [f"algorithm.checkpoint_every={args.steps}"]
    flags = ["--max-staleness", str(args.max_staleness), "--rollout-instances", str(args.rollout_instances)]
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-validation-") as scratch:
        validating = run_up(Path(scratch) / "validating", args.steps, common + [f"algorithm.eval_every={args.eval_every}"], flags)
        quiet = run_up(Path(scratch) / "quiet", args.steps, common + [f"algorithm.eval_every={args.steps}"], flags)
    during, outside = split_steps(validating)
    baseline_steps = [r["step_seconds"] for r in quiet.steps if WARMUP_STEPS < r["step"] < quiet.summary["steps"]]
    evaluations = [r for r in validating.evaluations if "eval/seconds" in r]
    figures = {
        "step_seconds_during_validation": statistics.mean(during),
        "steps_during_validation": len(during),
        "validations": len(evaluations),
        "validation_seconds_mean": statistics.mean(r["eval/seconds"] for r in evaluations),
        "validations_skipped": len(validating.summary.get("validations_skipped", [])),
        "held_out_prompts_per_validation": 64,
    }
    baseline = {
        "step_seconds_no_validation_running": statistics.mean(outside),
        "steps_no_validation_running": len(outside),
        "step_seconds_run_without_validations": statistics.mean(baseline_steps),
    }
    ratios = {
        "no_validation_over_during (same run)": baseline["step_seconds_no_validation_running"] / figures["step_seconds_during_validation"],
        "run_without_over_during": baseline["step_seconds_run_without_validations"] / figures["step_seconds_during_validation"],
    }
    targets = {"no_validation_over_during (same run) >= 0.9": ratios["no_validation_over_during (same run)"] >= TARGET_RATIO}
    write_result("validation", figures, baseline, ratios, targets,
                 {"steps": args.steps, "eval_every": args.eval_every, "max_staleness": args.max_staleness,
                  "rollout_instances": args.rollout_instances, "validation": "background"})


if __name__ == "__main__":
    main()
