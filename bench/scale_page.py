"""The scale and cost page, generated from bench/results/scale.json, capacity.json, cost.json and
relay_shards.json so that it cannot drift from them: `python -m bench.scale_page > docs/scale.md`
(`make bench` runs it after all four)."""

from __future__ import annotations

import json
import sys

from bench.common import RESULTS
from bench.scale import VALIDATION_TARGET

TRACE_WORDS = {
    "poisson": "Poisson preemptions",
    "burst": "a burst: 30 % gone in 2 min, back over 20",
    "join": "half the fleet joining over 10 min",
}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def met(value: bool) -> str:
    return "met" if value else "**not met**"


def relay_section(relay: dict) -> list[str]:
    settings = relay["settings"]
    rows = []
    for name, lengths in settings["lengths"].items():
        for path, run in (("the manager relays", relay["baseline"][name]), ("relay shards", relay["figures"][name])):
            rows.append(
                [
                    f"mean {lengths['mean']}, σ {lengths['sigma']}, max {lengths['max']}",
                    path if path != "relay shards" else f"{settings['relay_shards']} relay shards",
                    f"{run['tokens']:,}",
                    f"{run['manager_cpu_seconds_per_million_tokens']:.2f}",
                    f"{run['manager_idle_cpu_per_second']:.3f}",
                    f"{run['manager_cpu_seconds_per_million_tokens_beyond_idle']:.2f}",
                    f"{run['manager_core_ceiling_tokens_per_second']:,.0f}",
                    f"{run['shard_cpu_seconds_per_million_tokens']:.2f}" if run["relay_shards"] else "—",
                    f"{run['samples_lost']} / {run['samples_duplicated']}",
                ]
            )
    ratios = relay["ratios"]
    shard_core = 1e6 / max(run["shard_cpu_seconds_per_million_tokens"] for run in relay["figures"].values())
    return [
        "## The data path past one relay",
        "",
        f"`python -m bench.relay_shards`: {settings['instances']} instances of the capacity host, one step of "
        f"{settings['per_instance'][0]} prompts × {settings['per_instance'][1]} per instance in "
        f"{settings['chunk_tokens']}-token chunks, run with the manager relaying every token and with relay shards "
        "holding them (`mesh.relay_shards`) while the manager keeps the ledger. Both paths give each instance "
        f"`manager.queue_ahead = {settings['queue_ahead']}` requests beyond its batch of {settings['per_instance'][1]} "
        "(they wait in its engine and start as a sequence ends); the shards gather their reports over "
        f"`relay.report_window_seconds = {settings['report_window_seconds']}`. A core's ceiling: what is left of "
        "it after the fleet's heartbeats (its idle CPU, before and after the step) over the CPU a token costs "
        "beyond them.",
        "",
        *table(
            [
                "lengths",
                "path",
                "tokens",
                "manager CPU s per 1M tokens",
                "idle CPU s per s",
                "beyond idle, per 1M",
                "a core's ceiling (tok/s)",
                "shards' CPU s per 1M",
                "lost / duplicated",
            ],
            rows,
        ),
        "",
        *(
            f"- Ceiling with shards ÷ the manager's own relay, {name} lengths: "
            f"{ratios[f'manager_ceiling_over_single_relay_{name}']:.1f}×."
            for name in settings["lengths"]
        ),
        *(f"- Target {target}: {met(value)}." for target, value in relay["targets"].items()),
        "- What is left on the manager's side is per request and per second, not per token: a dispatch pass and "
        "a command write per report of finished requests, each request's placement and delivery, the running "
        "requests' counts (once a second each) and gRPC's own polling. The shards' CPU per token is the relay's "
        "work moved to processes that scale out.",
        f"- For a fleet: a shard per {shard_core:,.0f} tok/s (a core at the shards' CPU per token above), a queue "
        "ahead that covers what an instance finishes within a report window and a dispatch pass, and a wider "
        "window; with the defaults (no queue ahead, 50 ms) the manager makes a pass per finish or two.",
        "",
    ]


def capacity_section(capacity: dict) -> list[str]:
    runs = {**capacity["baseline"]["runs"], **capacity["figures"]["runs"]}
    rows = [
        [
            f"{int(count):,}",
            f"{run['instances_held']:,}",
            f"{run['heartbeats_per_second']:.0f} of {run['heartbeats_per_second_asked']:.0f}",
            f"{run['dispatch_latency_p50_ms']:.0f} / {run['dispatch_latency_p99_ms']:.0f}",
            f"{run['relay_tokens_per_second']:,.0f}",
            f"{1000 * run['manager_idle_cpu_per_instance']:.2f}",
            f"{run['manager_step_cpu_per_second']:.2f}",
            f"{run['manager_cpu_seconds_per_million_tokens']:.1f}",
            f"{run['manager_peak_memory_mb']:.0f}",
            f"{run['samples_lost']} / {run['samples_duplicated']}",
        ]
        for count, run in sorted(runs.items(), key=lambda item: int(item[0]))
    ]
    settings = capacity["settings"]
    return [
        "## The manager with hundreds of real instances",
        "",
        "`python -m bench.capacity`: the manager process against real rollout instances (the rollout service on the "
        "synthetic engine, each with its own port, registration, heartbeats every "
        f"{settings['heartbeat_seconds']:.0f} s and GenerateMany stream) served from one host process "
        "(`bench/capacity_host.py`), over gRPC on loopback; after a quiet "
        f"{settings['idle_seconds']:.0f} s, one synchronous step of {settings['per_instance'][0]} prompt × "
        f"{settings['per_instance'][1]} per instance, the host's engines generating "
        f"{settings['host_tokens_per_second']:,.0f} tok/s at most together. Dispatch latency: from the "
        "submission to each first request's arrival at its instance.",
        "",
        *table(
            [
                "instances",
                "held",
                "heartbeats/s answered (asked)",
                "dispatch p50 / p99 (ms)",
                "relay tok/s",
                "manager idle CPU ms/s per instance",
                "manager CPU s/s in the step",
                "manager CPU s per 1 M tokens",
                "manager peak MB",
                "lost / duplicated",
            ],
            rows,
        ),
        "",
        *(f"- {target}: {met(value)}" for target, value in capacity["targets"].items()),
        "",
    ]


SOURCE_WORDS = {
    "trainer seconds per token": "the trainer's busy time per response token",
    "announce seconds": "when the manager learns a version",
    "push seconds": "when each instance serves it",
    "torch decode model": "the torch engine's decode model",
    "torch lengths": "the torch engine's response lengths",
    "synthetic decode model and lengths": "the synthetic engine's decode model and lengths",
    "compared": "what is compared",
}
"""What each input of the simulator is, in the page's words (the sources are the results' own)."""


def validation_section(scale: dict) -> list[str]:
    settings = scale["settings"]["validation"]
    rows = [
        [
            engine,
            count,
            f"{run['real_step_seconds_mean']:.3f} ({run['real_rollout_wait_seconds_mean']:.3f})",
            f"{run['simulated_step_seconds_mean']:.3f} ({run['simulated_rollout_wait_seconds_mean']:.3f})",
            f"{run['simulated_over_real']:.3f}",
            f"{run['inputs']['trainer_seconds_per_token'] * 1e3:.3f}",
            f"{run['inputs']['announce_seconds']:.3f}",
            "{:.3f}–{:.3f} + {:.3f}–{:.3f}".format(
                *run["inputs"]["shared_push_seconds"], *run["inputs"]["push_seconds"]
            ),
            f"{run['other_processes_cores']:.2f}",
        ]
        for engine, runs in scale["baseline"]["validation"].items()
        for count, run in runs.items()
    ]
    synthetic = ", ".join(f"{key} {value}" for key, value in settings["synthetic"].items())
    return [
        "## The simulator against real runs",
        "",
        f"`python -m bench.scale` first runs `rlmesh up` for {settings['steps']} steps at "
        f"{', '.join(map(str, settings['instance_counts']))} rollout instances on this machine: the default job (the "
        f"torch engine), and the same job on the synthetic engine (`rollout.engine.kind = synthetic`, {synthetic}). "
        "Each run's step times are compared with the simulator's for the same mesh, which is told only the run's "
        "component speeds, never a step time; the simulated figure is the mean of "
        f"{settings['seeds']} seeds. Steps 1–{settings['warmup_steps']} and the last are left out. Step time and, "
        "in brackets, the part spent waiting for rollouts, in seconds. Each run starts once other processes use "
        f"little CPU, and the cores they used during it are shown ({scale['machine']['cpus']} cores in all, "
        "shared with other work):",
        "",
        *table(
            [
                "engine",
                "instances",
                "real",
                "simulated",
                "simulated ÷ real",
                "trainer ms per token",
                "announce (s)",
                "push: shared + own (s)",
                "other processes' cores",
            ],
            rows,
        ),
        "",
        *(f"- {SOURCE_WORDS.get(name, name)}: {source}." for name, source in settings["sources"].items()),
        *(
            f"- The torch engine measured: {decode['lone_tokens_per_second']:,.0f} tok/s for a lone sequence, "
            f"{decode['batch_tokens_per_second']:,.0f} tok/s for {decode['batch']} at once."
            for decode in (settings["torch_decode"],)
            if decode
        ),
        "- The trainer's busy time comes from the run itself: a run whose trainer never waits for rollouts matches "
        "by construction, and what the comparison tests is the waiting, which the simulator predicts from the "
        "rollout's and the weight plane's speeds, the staleness bound and the manager's own scheduling.",
        f"- {VALIDATION_TARGET}: {met(scale['targets'][VALIDATION_TARGET])}",
        "",
    ]


def page() -> str:
    scale, cost = load("scale"), load("cost")
    settings, figures = scale["settings"], scale["figures"]
    fleet_rows = [
        [
            f"{int(fleet):,}",
            TRACE_WORDS.get(trace, trace),
            f"{run['of_ideal']:.3f}",
            f"{run['steps_per_hour']:.0f} / {run['ideal_steps_per_hour']:.0f}",
            f"{run['staleness_violations']}",
            f"{run['tokens_regenerated']}",
            f"{run['samples_lost']} / {run['samples_duplicated']}",
            f"{run['preemptions_with_notice']} + {run['preemptions_without_notice']}",
            f"{run['manager_cpu_per_simulated_second']:.3f}",
        ]
        for fleet, runs in figures["runs"].items()
        for trace, run in runs.items()
    ]
    traces = list(cost["figures"]["table"])
    ratios = [row["ratio"] for row in cost["figures"]["table"][traces[0]]]
    cost_rows = [
        [
            f"{ratio:.1f}",
            f"{cost['baseline']['reserved_dollars_per_1000_steps']:.1f}",
            *(
                f"{row['spot_dollars_per_1000_steps']:.1f} ({100 * row['saving']:.0f} % cheaper)"
                for trace in traces
                for row in cost["figures"]["table"][trace]
                if row["ratio"] == ratio
            ),
        ]
        for ratio in ratios
    ]
    cost_settings = cost["settings"]
    lengths = settings["lengths"]
    parts = [
        "# Scale and cost",
        "",
        "What the manager does with the fleets rlmesh is for, and what harvesting spot capacity saves. "
        "`python -m bench.scale` drives the manager's own domain code (registry, admission and the capacity rule, "
        "scheduling, request table, delivery) under a virtual clock with simulated instances and a simulated "
        "trainer (bench/simulation); `python -m bench.cost` prices its runs. Generated: "
        "`python -m bench.scale_page > docs/scale.md`; the figures are in `bench/results/scale.json` and "
        f"`cost.json` ({scale['when'][:10]}, {cost['when'][:10]}).",
        "",
        "## The model",
        "",
        f"- Instances: {settings['instance_tokens_per_second']:,.0f} tok/s with {settings['saturation_batch']} "
        f"sequences or more (a decode step of b sequences takes max(min step, b / throughput), the synthetic "
        f"engine's model), at most {settings['max_batch']} a batch, speeds uniform in 0.8–1.2; lognormal lengths "
        f"(mean {lengths['mean']:,}, σ {lengths['sigma']}, at most {lengths['max']:,}), drawn per seed as the "
        "synthetic engine draws them; a new version reaches an instance 3–6 s after it is published, a joiner "
        "boots for 60 s and loads its first weights for 15 s before it serves.",
        f"- Trainer: {settings['per_instance_step'][0]} prompts × {settings['per_instance_step'][1]} per instance a "
        f"step, trained in {settings['trainer_step_seconds']:.0f} s a step of the full fleet's batch, "
        f"η = {settings['max_staleness']}, {settings['steps']} steps.",
        "- Fleet: Poisson preemptions at 0.5 per instance-hour in every trace, each replaced after 1–3 min; "
        "preemption notices of 30 s and 120 s (two clouds), a tenth with none (the manager finds out when "
        "the lease expires). At a notice the instance does what the rollout service does: it announces its "
        "drain, aborts its requests (each ends with its tokens so far, continued elsewhere) and deregisters.",
        f"- A simulated token stands for {settings['token_unit']} (a chunk): a step of 1,000 instances then fits "
        "this machine; the manager records a chunk where it would record one. Prefill of a continued request "
        "is not charged.",
        "",
        *validation_section(scale),
        "## 10, 100 and 1,000 instances",
        "",
        "Of ideal: the steps an hour the run reached over those the fleet and the trainer allow, the ideal time "
        "being the longer of the trainer's busy time and the tokens trained over the registered fleet's mean "
        "capacity (instances loading their first weights count; booting machines do not).",
        "",
        *table(
            [
                "instances",
                "trace",
                "of ideal",
                "steps/h (ideal)",
                "staleness violations",
                "tokens regenerated",
                "samples lost / duplicated",
                "preemptions (notice + none)",
                "manager CPU s per s",
            ],
            fleet_rows,
        ),
        "",
        *(f"- {target}: {met(value)}" for target, value in scale["targets"].items() if target != VALIDATION_TARGET),
        "",
        "![instances serving and steps done at 1,000 instances](images/scale.png)",
        "",
        *capacity_section(load("capacity")),
        "Manager CPU is the domain's own time in its calls at the simulated chunk rate; the gRPC relay of the "
        "tokens comes on top (see [Benchmarks](benchmarks.md), `relay`).",
        "",
        *relay_section(load("relay_shards")),
        "## What spot saves",
        "",
        f"{cost_settings['fleet']} rollout instances of one GPU each and a trainer of "
        f"{cost_settings['trainer_gpus']:.1f} reserved GPUs; the real autoscaler sizes the fleet within "
        f"{cost_settings['autoscale_bounds'][0]}–{cost_settings['autoscale_bounds'][1]} in every run. Reserved "
        f"capacity at ${cost_settings['reserved_dollars_per_gpu_hour']:.2f} per GPU-hour; spot at the ratio "
        "below of it. $ per 1,000 trainer steps:",
        "",
        *table(["spot ÷ reserved price", "all reserved", *(f"spot, {t}" for t in traces)], cost_rows),
        "",
        *(
            f"- {trace}: {cost['figures'][f'{trace}_spot_dollars_per_1000_steps']:.1f} $ at "
            f"{cost_settings['reference_ratio']} against {cost['baseline']['reserved_dollars_per_1000_steps']:.1f} $ "
            f"({100 * cost['figures'][f'{trace}_saving_at_reference']:.0f} % cheaper); 50 % cheaper up to a ratio of "
            f"{cost['figures'][f'{trace}_ratio_for_target']:.2f}; spot stops paying at a ratio of "
            f"{cost['figures'][f'{trace}_break_even_ratio']:.2f}."
            for trace in traces
        ),
        *(f"- Target {target}: {met(value)}." for target, value in cost["targets"].items()),
        "",
        "![saving against the price ratio](images/cost.png)",
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(page())
