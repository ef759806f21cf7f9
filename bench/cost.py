"""Cost: what harvesting spot capacity saves. The simulator (bench/simulation) runs the reference
mesh at the same shape with the real autoscaler sizing the fleet on the manager's recommendation
in both: every rollout instance reserved and never preempted, and every one a spot instance
through a preemption trace. $ per 1,000 trainer steps follows for reserved and spot $/GPU-hour
(the price ratio swept 0.1 to 0.7); the trainer's GPUs are reserved in both."""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.common import DOCS_IMAGES, write_result
from bench.simulation import scenarios
from bench.simulation.world import Simulation

RESERVED_PER_GPU_HOUR = 2.0
"""$ per GPU-hour of reserved capacity: only ratios matter below, this sets the scale of the table."""
REFERENCE_RATIO = 0.3
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
TRAINER_GPUS_PER_INSTANCE = 1 / 3
"""The trainer's reserved GPUs for each rollout instance's (one GPU each) of the reference mesh:
a trainer a third the size of its rollout fleet, as decoupled RL systems run long-generation work."""
TARGET_SAVING = 0.5
FLEET = 100
TRACE_OF_SPOT = ("poisson", "burst")


def run(fleet: int, trace: str, steps: int, seed: int) -> dict:
    """The reference mesh through `trace` ("steady": reserved instances, never preempted), autoscaled."""
    scenario = replace(scenarios.reference(fleet, steps), autoscale=(max(1, fleet // 2), 2 * fleet))
    simulation = Simulation(scenario, trace, seed=seed)
    outcome = simulation.run()
    accounts = simulation.trainer.accounts
    result = {
        "trace": trace,
        "steps": outcome.steps,
        "hours": outcome.seconds / 3600,
        "steps_per_hour": 3600 * outcome.steps / outcome.seconds,
        "instance_hours": outcome.instance_seconds / 3600,
        "mean_instances": outcome.instance_seconds / outcome.seconds,
        "autoscaler_changes": len(outcome.scale_changes),
        "preemptions": outcome.preemptions + outcome.crashes,
        "staleness_violations": accounts.violations,
        "samples_lost": accounts.lost,
        "samples_duplicated": accounts.duplicated,
    }
    print(
        f"{'reserved' if trace == 'steady' else 'spot, ' + trace:>14}: {result['steps_per_hour']:.0f} steps/h, "
        f"{result['mean_instances']:.1f} instances on average, {result['preemptions']} preemptions",
        flush=True,
    )
    return result


def dollars_per_thousand_steps(run: dict, trainer_gpus: float, instance_price: float) -> float:
    trainer = trainer_gpus * run["hours"] * RESERVED_PER_GPU_HOUR
    rollout = run["instance_hours"] * instance_price
    return 1000 * (trainer + rollout) / run["steps"]


def break_even_ratio(reserved: dict, spot: dict, trainer_gpus: float, saving: float) -> float:
    """The spot/reserved price ratio at which spot saves exactly `saving` (0: where it stops paying)."""
    reserved_cost = dollars_per_thousand_steps(reserved, trainer_gpus, RESERVED_PER_GPU_HOUR)
    trainer_cost = dollars_per_thousand_steps(spot, trainer_gpus, 0.0)
    rollout_at_reserved_price = dollars_per_thousand_steps(spot, 0.0, RESERVED_PER_GPU_HOUR)
    return ((1 - saving) * reserved_cost - trainer_cost) / rollout_at_reserved_price


def plot(table: dict[str, list[dict]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for trace, rows in table.items():
        axis.plot([r["ratio"] for r in rows], [100 * r["saving"] for r in rows], marker="o", label=f"spot, {trace}")
    axis.axhline(100 * TARGET_SAVING, color="grey", linestyle="--", linewidth=1, label="target: 50 % cheaper")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xlabel("spot $/GPU-h ÷ reserved $/GPU-h")
    axis.set_ylabel("% cheaper per 1,000 steps than all-reserved")
    axis.set_title("What harvesting spot saves (simulated, the real manager and autoscaler)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fleet", type=int, default=FLEET, help="rollout instances of the mesh (default 100)")
    parser.add_argument("--steps", type=int, default=scenarios.STEPS)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trainer_gpus = args.fleet * TRAINER_GPUS_PER_INSTANCE
    reserved = run(args.fleet, "steady", args.steps, args.seed)
    spot = {trace: run(args.fleet, trace, args.steps, args.seed) for trace in TRACE_OF_SPOT}
    reserved_cost = dollars_per_thousand_steps(reserved, trainer_gpus, RESERVED_PER_GPU_HOUR)
    table = {
        trace: [
            {
                "ratio": ratio,
                "spot_dollars_per_1000_steps": (
                    cost := dollars_per_thousand_steps(spot[trace], trainer_gpus, ratio * RESERVED_PER_GPU_HOUR)
                ),
                "reserved_dollars_per_1000_steps": reserved_cost,
                "saving": 1 - cost / reserved_cost,
            }
            for ratio in RATIOS
        ]
        for trace in TRACE_OF_SPOT
    }
    for trace, rows in table.items():
        print(trace + ": " + ", ".join(f"{r['ratio']:.1f} -> {100 * r['saving']:.0f} %" for r in rows))
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    plot(table, DOCS_IMAGES / "cost.png")
    at_reference = {t: next(r for r in rows if r["ratio"] == REFERENCE_RATIO) for t, rows in table.items()}
    write_result(
        "cost",
        {
            "table": table,
            **{f"{t}_saving_at_reference": r["saving"] for t, r in at_reference.items()},
            **{f"{t}_spot_dollars_per_1000_steps": r["spot_dollars_per_1000_steps"] for t, r in at_reference.items()},
            **{f"{t}_break_even_ratio": break_even_ratio(reserved, spot[t], trainer_gpus, 0.0) for t in spot},
            **{f"{t}_ratio_for_target": break_even_ratio(reserved, spot[t], trainer_gpus, TARGET_SAVING) for t in spot},
            "spot_runs": spot,
        },
        {"reserved_dollars_per_1000_steps": reserved_cost, "reserved_run": reserved},
        {f"{t}_spot_over_reserved": 1 - r["saving"] for t, r in at_reference.items()},
        {
            f"{t} >= {TARGET_SAVING:.0%} cheaper at ratio {REFERENCE_RATIO}": r["saving"] >= TARGET_SAVING
            for t, r in at_reference.items()
        },
        {
            "fleet": args.fleet,
            "steps": args.steps,
            "reserved_dollars_per_gpu_hour": RESERVED_PER_GPU_HOUR,
            "trainer_gpus": trainer_gpus,
            "gpus_per_instance": 1,
            "reference_ratio": REFERENCE_RATIO,
            "target_saving": TARGET_SAVING,
            "autoscale_bounds": [max(1, args.fleet // 2), 2 * args.fleet],
        },
    )


if __name__ == "__main__":
    main()
