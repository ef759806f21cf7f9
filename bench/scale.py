"""Scale: the manager's own domain under a virtual clock (bench/simulation) with 10, 100 and 1,000
simulated spot instances through fleet traces (Poisson preemptions, a correlated burst, a growing
fleet): steps an hour against the ideal the fleet and the trainer allow, staleness, tokens
regenerated, samples lost or duplicated, and the manager's CPU per simulated second; the simulator
checked against real `rlmesh up` runs of 1 to 3 instances on this machine, on the torch and the
synthetic engines (bench/simulation/validation.py). Both go to bench/results/scale.json; either
can be run alone, keeping the other's part of the file."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict

from bench.common import DOCS_IMAGES, RESULTS, write_result
from bench.simulation import scenarios, validation
from bench.simulation.calibration import WARMUP_STEPS
from bench.simulation.traces import TRACES, TraceSettings
from bench.simulation.world import Outcome, Simulation

FLEETS = (10, 100, 1000)
TARGET_AT_SCALE = 0.9
"""Of ideal steps an hour, at 1,000 instances through the burst."""
VALIDATION_TOLERANCE = 0.10
VALIDATION_TARGET = "simulator within 10 % of real at 1-3 instances"


def figures_of(simulation: Simulation, outcome: Outcome, wall_seconds: float) -> dict:
    accounts = simulation.trainer.accounts
    return {
        "steps": outcome.steps,
        "simulated_seconds": outcome.seconds,
        "steps_per_hour": 3600 * outcome.steps / outcome.seconds,
        "ideal_steps_per_hour": 3600 * outcome.steps / outcome.ideal_seconds,
        "of_ideal": outcome.ideal_seconds / outcome.seconds,
        "fleet_bound_seconds": outcome.fleet_bound_seconds,
        "trainer_bound_seconds": outcome.trainer_bound_seconds,
        "staleness_violations": accounts.violations,
        "max_staleness_seen": accounts.max_staleness_seen,
        "tokens_regenerated": outcome.regenerated_units * simulation.scenario.token_unit,
        "tokens_lost_in_flight": outcome.lost_in_flight_units * simulation.scenario.token_unit,
        "samples_lost": accounts.lost,
        "samples_duplicated": accounts.duplicated,
        "samples_trained": accounts.trained_samples,
        "preemptions_with_notice": outcome.preemptions,
        "preemptions_without_notice": outcome.crashes,
        "joins": outcome.joins,
        "trainer_wait_seconds": accounts.wait_seconds,
        "manager_cpu_seconds": outcome.manager_cpu_seconds,
        "manager_cpu_per_simulated_second": outcome.manager_cpu_seconds / outcome.seconds,
        "manager_calls": outcome.manager_calls,
        "wall_seconds": wall_seconds,
        "timeline": outcome.timeline,
    }


def run_fleet(fleet: int, trace: str, steps: int, seed: int) -> dict:
    simulation = Simulation(scenarios.reference(fleet, steps), trace, seed=seed)
    started = time.perf_counter()
    outcome = simulation.run()
    figures = figures_of(simulation, outcome, time.perf_counter() - started)
    print(
        f"{fleet:>5} instances, {trace:>7}: {figures['of_ideal']:.3f} of ideal "
        f"({figures['steps_per_hour']:.0f} of {figures['ideal_steps_per_hour']:.0f} steps/h), "
        f"{figures['staleness_violations']} staleness violations, {figures['tokens_regenerated']} tokens regenerated, "
        f"{figures['samples_lost']}/{figures['samples_duplicated']} lost/duplicated, manager "
        f"{figures['manager_cpu_per_simulated_second']:.3f} CPU s per s ({figures['wall_seconds']:.0f} s wall)",
        flush=True,
    )
    return figures


def plot(runs: dict[str, dict[str, dict]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet = max(runs, key=int)
    figure, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for trace, figures in runs[fleet].items():
        times = [t / 60 for t, _, _ in figures["timeline"]]
        axes[0].plot(times, [serving for _, serving, _ in figures["timeline"]], label=trace)
        axes[1].plot(times, [steps for _, _, steps in figures["timeline"]], label=trace)
    axes[0].set_ylabel("instances serving")
    axes[1].set_ylabel("trainer steps done")
    axes[1].set_xlabel("simulated minutes")
    axes[0].set_title(f"{fleet} simulated spot instances, the real manager's domain")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def validate(steps: int) -> dict[str, dict]:
    """The real runs and their simulations, as parts of scale.json: the real runs are the baseline."""
    compared = asyncio.run(validation.compare(steps=steps))
    runs = compared["runs"]
    ratios = {
        f"simulated_over_real_{engine}_{count}": figures["simulated_over_real"]
        for engine, by in runs.items()
        for count, figures in by.items()
    }
    every = len(validation.ENGINES) * len(validation.INSTANCE_COUNTS)
    return {
        "baseline": {"validation": runs},
        "ratios": {
            **ratios,
            "simulated_over_real_min": min(ratios.values()),
            "simulated_over_real_max": max(ratios.values()),
        },
        "targets": {
            VALIDATION_TARGET: len(ratios) == every
            and all(abs(ratio - 1) <= VALIDATION_TOLERANCE for ratio in ratios.values())
        },
        "settings": {
            "validation": {
                "engines": list(validation.ENGINES),
                "instance_counts": list(validation.INSTANCE_COUNTS),
                "steps": steps,
                "warmup_steps": WARMUP_STEPS,
                "seeds": validation.SEEDS,
                "synthetic": validation.SYNTHETIC.model_dump(exclude_defaults=True),
                "torch_decode": compared["torch_decode"],
                "tolerance": VALIDATION_TOLERANCE,
                "sources": validation.SOURCES,
            }
        },
    }


def split_result(result: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """(the fleets' parts, the validation's parts) of a scale.json."""
    validation_parts = {
        "baseline": {"validation": result["baseline"]["validation"]},
        "ratios": {k: v for k, v in result["ratios"].items() if k.startswith("simulated_over_real")},
        "targets": {VALIDATION_TARGET: result["targets"][VALIDATION_TARGET]},
        "settings": {"validation": result["settings"]["validation"]},
    }
    fleet_parts = {
        "figures": result["figures"],
        "targets": {k: v for k, v in result["targets"].items() if k != VALIDATION_TARGET},
        "settings": {k: v for k, v in result["settings"].items() if k != "validation"},
    }
    return fleet_parts, validation_parts


def run_fleets(args: argparse.Namespace) -> dict[str, dict]:
    """The simulated fleets, as parts of scale.json; their plot in the docs."""
    fleets = [int(f) for f in args.fleets.split(",")]
    traces = args.traces.split(",")
    runs = {str(f): {t: run_fleet(f, t, args.steps, args.seed) for t in traces} for f in fleets}
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    plot(runs, DOCS_IMAGES / "scale.png")
    largest = str(max(fleets))
    summary = {
        f"{fleet}_{trace}_of_ideal": figures["of_ideal"] for fleet, by in runs.items() for trace, figures in by.items()
    }
    for fleet, by in runs.items():
        summary[f"{fleet}_manager_cpu_per_simulated_second_max"] = max(
            f["manager_cpu_per_simulated_second"] for f in by.values()
        )
    every = [f for by in runs.values() for f in by.values()]
    scenario = scenarios.reference(fleets[0])
    return {
        "figures": {"runs": runs, **summary},
        "targets": {
            f"{largest} instances, burst: >= {TARGET_AT_SCALE} of ideal": runs[largest]
            .get("burst", {})
            .get("of_ideal", 0)
            >= TARGET_AT_SCALE,
            "0 staleness violations": all(f["staleness_violations"] == 0 for f in every),
            "0 tokens regenerated": all(f["tokens_regenerated"] == 0 for f in every),
            "0 samples lost or duplicated": all(f["samples_lost"] == f["samples_duplicated"] == 0 for f in every),
        },
        "settings": {
            "fleets": fleets,
            "traces": traces,
            "steps": args.steps,
            "seed": args.seed,
            "token_unit": scenario.token_unit,
            "instance_tokens_per_second": scenarios.INSTANCE_TOKENS_PER_SECOND,
            "saturation_batch": scenarios.SATURATION_BATCH,
            "max_batch": scenarios.MAX_BATCH,
            "lengths": {"mean": scenarios.MEAN_TOKENS, "sigma": scenarios.SIGMA, "max": scenarios.MAX_TOKENS},
            "per_instance_step": [scenarios.PROMPTS_PER_INSTANCE, scenarios.GROUP_SIZE],
            "trainer_step_seconds": scenarios.TRAINER_STEP_SECONDS,
            "max_staleness": scenario.max_staleness,
            "trace_settings": asdict(TraceSettings()),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fleets", default=",".join(map(str, FLEETS)), help="instance counts (default 10,100,1000)")
    parser.add_argument("--traces", default=",".join(TRACES), help="fleet traces (default poisson,burst,join)")
    parser.add_argument("--steps", type=int, default=scenarios.STEPS, help="trainer steps a run (default 120)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--validation-steps", type=int, default=validation.STEPS, help="steps of each real run (default 30)"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--skip-validation", action="store_true", help="no real runs: scale.json keeps its last validation"
    )
    only.add_argument(
        "--validation-only", action="store_true", help="only the real runs: scale.json keeps its last fleets"
    )
    args = parser.parse_args()
    kept = (
        split_result(json.loads((RESULTS / "scale.json").read_text()))
        if args.skip_validation or args.validation_only
        else ({}, {})
    )
    # The real runs first, while nothing else of this run loads the machine.
    validated = kept[1] if args.skip_validation else validate(args.validation_steps)
    fleets = kept[0] if args.validation_only else run_fleets(args)
    write_result(
        "scale",
        fleets["figures"],
        validated["baseline"],
        validated["ratios"],
        {**fleets["targets"], **validated["targets"]},
        {**fleets["settings"], **validated["settings"]},
    )


if __name__ == "__main__":
    main()
