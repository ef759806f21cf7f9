"""Asynchrony and quality: the default task's held-out reward after the same number of steps at
max_staleness η = 0, 1, 2, 4, under the `ppo` and the `decoupled` loss, all in AReaL's regime of
four mini-batches per step (8 runs of the real mesh, same seed; the two runs the target compares
again with more seeds), and its curve over wall-clock time (bench/results/async_quality.png)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.common import RESULTS, write_result
from bench.training_runs import TrainingRun, run_up

ALGORITHM = ("algorithm.mini_batches_per_step=4", "algorithm.learning_rate=7.5e-5")
"""Every run alike: four optimizer steps per training step at a quarter of the default learning
rate, as AReaL trains its decoupled objective. With the default single mini-batch, π = π_prox
during the only update, so the decoupled clip never binds and stale tokens keep pulling
(`--set algorithm.mini_batches_per_step=1 --set algorithm.learning_rate=3e-4 --tag one-minibatch`
measures that regime)."""
STALENESS = (0, 1, 2, 4)
LOSSES = ("ppo", "decoupled")
TARGET_GAP = 0.05
"""Decoupled at the largest η may end at most this far below decoupled at η = 0 (AReaL's claim:
staleness up to 4 costs no final quality with the decoupled objective)."""
TARGET_SEEDS = 3
"""Seeds of the two runs the target compares (decoupled at η = 0 and at the largest η). One run's
final held-out reward moves by a few hundredths with the seed (same-setting finals 0.757-0.804 on
seed 0 alone), as much as the gap measured: the target is judged on the mean gap over the seeds,
and seed 0's gap is reported beside it."""
LAST_EVALUATIONS = 3
"""Held-out evaluations averaged besides the final one: one evaluation (64 prompts x 4 samples) moves by a
few hundredths from the one before."""


@dataclass
class QualityFigures:
    loss: str
    max_staleness: int
    final_held_out: float
    last_evaluations_mean: float
    training_seconds: float
    """From the start of the first training step to the end of the last."""
    process_seconds: float
    staleness_mean: float
    staleness_violations: float
    importance_weight_mean: float
    importance_weight_max_mean: float
    """The mean over steps of each step's largest pi_prox / pi_behav."""
    importance_weight_max: float
    capped_fraction: float
    behaviour_kl: float

    @classmethod
    def of(cls, loss: str, max_staleness: int, run: TrainingRun) -> QualityFigures:
        steps, evaluations = run.steps, evaluations_by_step(run)

        def mean(key: str) -> float:
            return statistics.mean(r[key] for r in steps)

        return cls(
            loss=loss,
            max_staleness=max_staleness,
            final_held_out=run.summary["end"]["eval/sampled_reward"],
            last_evaluations_mean=statistics.mean(r["eval/sampled_reward"] for r in evaluations[-LAST_EVALUATIONS:]),
            training_seconds=steps[-1]["time"] - training_started(run),
            process_seconds=run.process_seconds,
            staleness_mean=mean("staleness_mean"),
            staleness_violations=sum(r["staleness_violations"] for r in steps),
            importance_weight_mean=mean("importance_weight_mean"),
            importance_weight_max_mean=mean("importance_weight_max"),
            importance_weight_max=max(r["importance_weight_max"] for r in steps),
            capped_fraction=mean("capped_fraction"),
            behaviour_kl=mean("behaviour_kl"),
        )

    @property
    def name(self) -> str:
        return f"{self.loss}_eta{self.max_staleness}"


def evaluations_by_step(run: TrainingRun) -> list[dict]:
    """The held-out evaluations in the order of the versions they evaluated (a background validation
    is written when it ends, possibly after a later step's)."""
    return sorted(run.evaluations, key=lambda r: r["step"])


def training_started(run: TrainingRun) -> float:
    first = run.steps[0]
    return first["time"] - first["step_seconds"]


def held_out_curve(run: TrainingRun) -> tuple[list[float], list[float], list[int]]:
    """(seconds since training started, held-out sampled reward, step) of every evaluation; the
    time is when its version was trained, not when its evaluation ended."""
    started = training_started(run)
    trained = {0: started} | {r["step"]: r["time"] for r in run.steps}
    evaluations = evaluations_by_step(run)
    return (
        [trained[r["step"]] - started for r in evaluations],
        [r["eval/sampled_reward"] for r in evaluations],
        [r["step"] for r in evaluations],
    )


def plot(runs: dict[tuple[str, int], TrainingRun], title: str, path: Path) -> None:
    """Held-out reward against wall-clock time (left) and against steps (right), for every run."""
    figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    colours = plt.get_cmap("tab10")
    for (loss, eta), run in runs.items():
        seconds, rewards, steps = held_out_curve(run)
        style = {
            "linestyle": "-" if loss == "decoupled" else "--",
            "marker": "o" if loss == "decoupled" else "s",
            "markersize": 2.5,
            "color": colours(STALENESS.index(eta)),
            "label": f"{loss}, η = {eta}",
        }
        by_time.plot(seconds, rewards, **style)
        by_step.plot(steps, rewards, **style)
    by_time.set_xlabel("seconds since training started (each evaluation at the time its version was trained)")
    by_step.set_xlabel("training step")
    by_time.set_ylabel("held-out reward (sampled)")
    for axis in (by_time, by_step):
        axis.grid(alpha=0.3)
    by_time.legend(loc="lower right", ncol=2, fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(rows: list[QualityFigures]) -> None:
    print(
        f"\n{'loss':<10} {'η':>2} {'final':>6} {'last3':>6} {'train s':>8} {'stale':>6} {'viol':>5} "
        f"{'w mean':>7} {'w max':>7} {'w max*':>7} {'capped':>7} {'b-KL':>8}"
    )
    for r in rows:
        print(
            f"{r.loss:<10} {r.max_staleness:>2} {r.final_held_out:>6.3f} {r.last_evaluations_mean:>6.3f} "
            f"{r.training_seconds:>8.1f} {r.staleness_mean:>6.2f} {r.staleness_violations:>5.0f} "
            f"{r.importance_weight_mean:>7.4f} {r.importance_weight_max_mean:>7.3f} {r.importance_weight_max:>7.2f} "
            f"{r.capped_fraction:>7.5f} {r.behaviour_kl:>8.5f}"
        )
    print(
        "w max: mean over steps of each step's largest importance weight; w max*: the largest of the run; "
        "capped: share of tokens over importance_cap; b-KL: KL(behaviour || proximal)"
    )


def main(steps: int, seed: int, settings: list[str], keep_dir: Path | None, tag: str | None, target_seeds: int) -> dict:
    settings = [*ALGORITHM, *settings]
    work = keep_dir or Path(tempfile.mkdtemp(prefix="rlmesh-bench-quality-"))
    print(f"runs in {work}", flush=True)
    runs: dict[tuple[str, int], TrainingRun] = {}
    rows: list[QualityFigures] = []
    for loss in LOSSES:
        for eta in STALENESS:
            run = run_up(
                work / f"{loss}-eta{eta}",
                steps,
                [f"algorithm.seed={seed}", f"algorithm.loss={loss}", *settings],
                ["--max-staleness", str(eta)],
            )
            runs[loss, eta] = run
            rows.append(QualityFigures.of(loss, eta, run))
            row = rows[-1]
            print(
                f"{loss} η={eta}: final held-out {row.final_held_out:.3f}, last {LAST_EVALUATIONS} "
                f"{row.last_evaluations_mean:.3f}, {row.training_seconds:.0f} s",
                flush=True,
            )
    print_table(rows)
    largest = max(STALENESS)
    finals = {eta: [next(r for r in rows if r.name == f"decoupled_eta{eta}").final_held_out] for eta in (0, largest)}
    for extra in range(seed + 1, seed + target_seeds):
        for eta in (0, largest):
            run = run_up(
                work / f"decoupled-eta{eta}-seed{extra}",
                steps,
                [f"algorithm.seed={extra}", "algorithm.loss=decoupled", *settings],
                ["--max-staleness", str(eta)],
            )
            finals[eta].append(run.summary["end"]["eval/sampled_reward"])
            print(f"decoupled η={eta}, seed {extra}: final held-out {finals[eta][-1]:.3f}", flush=True)
    gaps = [far - sync for far, sync in zip(finals[largest], finals[0])]
    mean_gap = statistics.mean(gaps)
    print(
        f"\ndecoupled η={largest} minus η=0, final held-out, by seed from {seed}: "
        f"{', '.join(f'{g:+.3f}' for g in gaps)}; mean {mean_gap:+.3f} (target >= -{TARGET_GAP})"
    )
    name = f"async_quality-{tag}" if tag else "async_quality"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(
        runs,
        f"rlmesh, default job{''.join(', ' + s for s in settings)}, {steps} steps, seed {seed}: held-out reward",
        RESULTS / f"{name}.png",
    )
    by_name = {r.name: r for r in rows}
    decoupled_far, decoupled_sync, ppo_sync = (
        by_name[f"decoupled_eta{largest}"],
        by_name["decoupled_eta0"],
        by_name["ppo_eta0"],
    )
    start = runs["ppo", 0].summary["start"]["eval/sampled_reward"]
    return write_result(
        name,
        figures={
            f"{r.name}_{key}": value
            for r in rows
            for key, value in vars(r).items()
            if key not in ("loss", "max_staleness")
        }
        | {"held_out_at_step_0": start}
        | {f"decoupled_eta{eta}_final_held_out_by_seed": values for eta, values in finals.items()},
        baseline={
            "decoupled_eta0_final_held_out": decoupled_sync.final_held_out,
            "decoupled_eta0_last_evaluations_mean": decoupled_sync.last_evaluations_mean,
            "ppo_eta0_final_held_out": ppo_sync.final_held_out,
            "ppo_eta0_last_evaluations_mean": ppo_sync.last_evaluations_mean,
        },
        ratios={
            f"decoupled_eta{largest}_minus_decoupled_eta0_final_mean_of_{target_seeds}_seeds": mean_gap,
            f"decoupled_eta{largest}_minus_decoupled_eta0_final_by_seed": gaps,
            f"decoupled_eta{largest}_minus_decoupled_eta0_final": decoupled_far.final_held_out
            - decoupled_sync.final_held_out,
            f"decoupled_eta{largest}_minus_ppo_eta0_final": decoupled_far.final_held_out - ppo_sync.final_held_out,
            f"decoupled_eta{largest}_minus_decoupled_eta0_last{LAST_EVALUATIONS}": decoupled_far.last_evaluations_mean
            - decoupled_sync.last_evaluations_mean,
            f"decoupled_eta{largest}_minus_ppo_eta0_last{LAST_EVALUATIONS}": decoupled_far.last_evaluations_mean
            - ppo_sync.last_evaluations_mean,
            f"decoupled_eta{largest}_training_seconds_over_decoupled_eta0": decoupled_far.training_seconds
            / decoupled_sync.training_seconds,
            **{f"{r.name}_final_minus_decoupled_eta0": r.final_held_out - decoupled_sync.final_held_out for r in rows},
        },
        targets={
            (
                f"decoupled η={largest} final >= decoupled η=0 final - {TARGET_GAP}, "
                f"mean over {target_seeds} seeds (the target)"
            ): mean_gap >= -TARGET_GAP,
            (
                f"decoupled η={largest} final >= decoupled η=0 final - {TARGET_GAP}, seed {seed} alone (reported)"
            ): decoupled_far.final_held_out >= decoupled_sync.final_held_out - TARGET_GAP,
            f"decoupled η={largest} final >= ppo η=0 final - {TARGET_GAP} (reported)": decoupled_far.final_held_out
            >= ppo_sync.final_held_out - TARGET_GAP,
            "held-out reward rose in every run": all(r.final_held_out > start for r in rows),
            "no staleness violation in any run": all(r.staleness_violations == 0 for r in rows),
        },
        settings={
            "steps": steps,
            "seed": seed,
            "target_seeds": list(range(seed, seed + target_seeds)),
            "staleness": STALENESS,
            "losses": LOSSES,
            "extra_settings": settings,
            "job": "the default (built-in increment task, tiny-increment model, 16 prompts x 8 samples per step, "
            "held-out evaluation every 10 steps) with extra_settings",
            "runs_dir": str(work),
            "plot": str(RESULTS / f"{name}.png"),
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a job field for every run alike, e.g. algorithm.importance_cap=4",
    )
    parser.add_argument(
        "--target-seeds",
        type=int,
        default=TARGET_SEEDS,
        help="seeds (from --seed on) of the decoupled η = 0 and largest-η runs the target compares",
    )
    parser.add_argument("--runs-dir", type=Path, help="where the runs' outputs go (default: a new temporary folder)")
    parser.add_argument(
        "--tag", help="results as async_quality-TAG.json / .png, so a try with other settings keeps the default's"
    )
    args = parser.parse_args()
    main(args.steps, args.seed, args.set, args.runs_dir, args.tag, args.target_seeds)
