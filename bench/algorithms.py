"""The algorithm registry's estimators on the default task: GRPO, RLOO, REINFORCE++ (with a
baseline) and PPO with a critic (GAE), one real `rlmesh up` run each of the same length and
seed; held-out reward at steps 0, half-way and the end, and wall time, against GRPO's."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.async_quality import evaluations_by_step, training_started
from bench.common import write_result
from bench.training_runs import TrainingRun, run_up

ESTIMATORS = {
    "grpo": "GRPO",
    "rloo": "RLOO",
    "reinforce_pp": "REINFORCE++",
    "gae": "PPO + critic",
}
"""advantage_estimator -> the name in the table; `grpo` is the baseline."""
TARGET_RISE = 0.3
"""PPO with a critic must raise the held-out reward by at least this in the run, as GRPO does."""


@dataclass
class AlgorithmFigures:
    estimator: str
    held_out: dict[int, float]
    """Held-out sampled reward by step (0, half-way, the end)."""
    evaluated_steps: dict[int, int]
    """The step each figure's evaluation is of: a background validation that found its version no
    longer served (a busy host) is retried on the next version, so half-way may be a step later."""
    wall_seconds: float
    """The trainer's run from start to end (the first and last held-out evaluations included)."""
    training_seconds: float
    """From the start of the first training step to the end of the last."""
    critic: dict[str, float]
    """The last step's critic metrics (PPO with a critic only)."""

    @classmethod
    def of(cls, estimator: str, run: TrainingRun, marks: list[int]) -> AlgorithmFigures:
        evaluations = evaluations_by_step(run)
        evaluated = {}
        for mark in marks:
            at_or_after = [r for r in evaluations if r["step"] >= mark]
            if not at_or_after:
                raise RuntimeError(
                    f"{estimator}: no held-out evaluation at or after step {mark} "
                    f"(evaluated: {[r['step'] for r in evaluations]})"
                )
            evaluated[mark] = at_or_after[0]
        last = run.steps[-1]
        return cls(
            estimator,
            {mark: r["eval/sampled_reward"] for mark, r in evaluated.items()},
            {mark: r["step"] for mark, r in evaluated.items()},
            run.summary["wall_seconds"],
            last["time"] - training_started(run),
            {k: v for k, v in last.items() if k.startswith("critic/")},
        )

    @property
    def rise(self) -> float:
        steps = sorted(self.held_out)
        return self.held_out[steps[-1]] - self.held_out[steps[0]]


def print_table(rows: list[AlgorithmFigures], baseline: AlgorithmFigures, marks: list[int]) -> None:
    header = " ".join(f"{'step ' + str(step):>9}" for step in marks)
    print(f"\n{'algorithm':<14} {header} {'rise':>6} {'wall s':>7} {'train s':>8} {'rise/GRPO':>9} {'wall/GRPO':>9}")
    for r in rows:
        values = " ".join(f"{r.held_out[step]:>9.3f}" for step in marks)
        print(
            f"{ESTIMATORS[r.estimator]:<14} {values} {r.rise:>+6.3f} {r.wall_seconds:>7.0f} {r.training_seconds:>8.0f} "
            f"{r.rise / baseline.rise:>9.2f} {r.wall_seconds / baseline.wall_seconds:>9.2f}"
        )
    print(
        "held-out sampled reward of the default task at each step (or the first evaluation after it); "
        "wall: the trainer's run; train: first step to last"
    )


def finished_run(output_dir: Path) -> TrainingRun | None:
    """A run an earlier invocation completed in `output_dir` (its summary written), or None."""
    if not (output_dir / "summary.json").is_file():
        return None
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return TrainingRun(output_dir, records, json.loads((output_dir / "summary.json").read_text()), float("nan"))


def main(steps: int, seed: int, settings: list[str], keep_dir: Path | None, estimators: list[str], reuse: bool) -> dict:
    work = keep_dir or Path(tempfile.mkdtemp(prefix="rlmesh-bench-algorithms-"))
    print(f"runs in {work}", flush=True)
    marks = [0, steps // 2, steps]
    rows = []
    for estimator in estimators:
        run = finished_run(work / estimator) if reuse else None
        if run is None:
            run = run_up(
                work / estimator,
                steps,
                [f"algorithm.seed={seed}", f"algorithm.advantage_estimator={estimator}", *settings],
            )
        rows.append(AlgorithmFigures.of(estimator, run, marks))
        row = rows[-1]
        print(
            f"{ESTIMATORS[estimator]}: held-out {' -> '.join(f'{row.held_out[s]:.3f}' for s in marks)} "
            f"({row.rise:+.3f}), {row.wall_seconds:.0f} s",
            flush=True,
        )
    by_name = {r.estimator: r for r in rows}
    baseline = by_name.get("grpo", rows[0])
    print_table(rows, baseline, marks)
    targets = {}
    if "gae" in by_name:
        targets[f"PPO + critic raises the held-out reward by >= {TARGET_RISE}"] = by_name["gae"].rise >= TARGET_RISE
    targets[f"GRPO raises the held-out reward by >= {TARGET_RISE} (reported)"] = baseline.rise >= TARGET_RISE
    for name, met in targets.items():
        print(f"{'met' if met else 'NOT MET'}: {name}")
    return write_result(
        "algorithms",
        figures={
            r.estimator: {
                "held_out": {str(s): v for s, v in r.held_out.items()},
                "evaluated_steps": {str(s): v for s, v in r.evaluated_steps.items()},
                "rise": r.rise,
                "wall_seconds": r.wall_seconds,
                "training_seconds": r.training_seconds,
                **({"last_step_critic": r.critic} if r.critic else {}),
            }
            for r in rows
        },
        baseline={"estimator": baseline.estimator, "rise": baseline.rise, "wall_seconds": baseline.wall_seconds},
        ratios={f"{r.estimator}_rise_over_grpo": r.rise / baseline.rise for r in rows}
        | {f"{r.estimator}_wall_over_grpo": r.wall_seconds / baseline.wall_seconds for r in rows},
        targets=targets,
        settings={
            "steps": steps,
            "seed": seed,
            "estimators": estimators,
            "extra_settings": settings,
            "job": "the default (built-in increment task, tiny-increment model, 16 prompts x 8 samples per step, "
            "held-out evaluation every 10 steps) with algorithm.advantage_estimator and extra_settings",
            "runs_dir": str(work),
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600, help="training steps of every run (make run's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a job field for every run alike, e.g. algorithm.gae_lambda=0.95",
    )
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=list(ESTIMATORS))
    parser.add_argument("--runs-dir", type=Path, help="where the runs' outputs go (default: a new temporary folder)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="tabulate the runs an earlier invocation completed in --runs-dir instead of running them again",
    )
    args = parser.parse_args()
    main(args.steps, args.seed, args.set, args.runs_dir, args.estimators, args.reuse)
