"""The data path past one relay: the same fleet of real rollout instances (the capacity host) and the
same step, once with the manager relaying every token and once with relay shards holding them
while the manager keeps the ledger. Figures: the manager's CPU seconds per 1 M tokens on each path,
the token ceiling that gives one manager core (tokens per manager CPU second), the shards' CPU per
1 M tokens (each shard is a process of its own, so their ceiling grows with their count), lost and
duplicated samples; the manager's own relay is the baseline. A core's ceiling: what is left of it
after the fleet's heartbeats (measured idle, before the step), over the CPU each token costs beyond them.
Both paths give each instance QUEUE_AHEAD requests beyond its batch; the shards gather their reports
over REPORT_WINDOW_SECONDS (docs/scale.md: the settings for a fleet)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.capacity import GROUP_SIZE, cpu_seconds, host_settings, wait_for
from bench.common import BenchAuth, StepResult, check_exactly_once, spawn_manager, write_result
from bench.simulation import scenarios
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import spawn_service, stop_children, wait_started
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from services.trainer.relayed import RelayedPayloads

INSTANCES = 50
SHARDS = 2
LENGTHS = {
    "reference": (scenarios.MEAN_TOKENS, scenarios.SIGMA, scenarios.MAX_TOKENS),
    "short": (512, 0.5, 2048),
}
"""Lognormal response lengths (mean, sigma, max): the scale simulator's reference scenario, and
half as long. The manager's own relay works per chunk, the ledger per request: the shorter the
responses, the less the shards take off the manager."""
PROMPTS_PER_INSTANCE = 2
QUEUE_AHEAD = 3
"""manager.queue_ahead: an instance's next requests wait in its engine, so a freed slot does not
wait for the shard's report and the dispatch pass after it. Three cover what an instance of the
scale simulator's reference fleet finishes within a report window and a pass (4,000 tok/s, 32
sequences of 1,024 tokens: about 4 a second, 2.2 in 0.55 s); these instances finish about 0.5 a second."""
REPORT_WINDOW_SECONDS = 0.5
"""relay.report_window_seconds: the manager makes a dispatch pass per report."""
IDLE_SECONDS = 10.0
"""The windows the manager's idle CPU (heartbeats) is measured over, before the step and after it."""


def spawn_relay(index: int, auth: BenchAuth, folder: Path):
    address = f"127.0.0.1:{free_port()}"
    return spawn_service(
        f"relay-{index}",
        "services.manager.relay",
        address,
        {
            "RLMESH_RELAY_SERVER__HOST": "127.0.0.1",
            "RLMESH_RELAY_SERVER__PORT": address.rsplit(":", 1)[1],
            "RLMESH_RELAY_SERVER__LOG_LEVEL": "warning",
            # As `rlmesh up` runs a shard: its journal written before each report.
            "RLMESH_RELAY_JOURNAL_PATH": str(folder / f"relay-{index}-payloads.log"),
            "RLMESH_RELAY_REPORT_WINDOW_SECONDS": str(REPORT_WINDOW_SECONDS),
            **auth.settings("RLMESH_RELAY_", "manager"),
        },
        folder,
        str(folder),
    )


async def idle_cpu_per_second(pid: int) -> float:
    started = cpu_seconds(pid)
    await asyncio.sleep(IDLE_SECONDS)
    return (cpu_seconds(pid) - started) / IDLE_SECONDS


async def measure(shards: int, lengths: str = "reference") -> dict:
    mean_tokens, sigma, max_tokens = LENGTHS[lengths]
    folder = Path(tempfile.mkdtemp(prefix=f"rlmesh-relay-shards-{shards}-"))
    auth = BenchAuth(folder / "secrets")
    relays = [spawn_relay(i, auth, folder) for i in range(shards)]
    address = f"127.0.0.1:{free_port()}"
    manager = spawn_manager(
        address, auth, folder, {"RELAY_ADDRESSES": ",".join(r.address for r in relays), "QUEUE_AHEAD": str(QUEUE_AHEAD)}
    )
    children = [*relays, manager]
    try:
        await wait_started(children)
        host = spawn_service(
            "host",
            "bench.capacity_host",
            address,
            host_settings(INSTANCES, address, auth, mean_tokens, sigma),
            folder,
            str(folder),
            args=["--count", str(INSTANCES), "--out", str(folder)],
        )
        children.append(host)
        auth.use()
        await wait_for(folder / "ready.json", 120 + INSTANCES)
        fetcher = RelayedPayloads(30, 30)
        async with open_channel(address) as channel:
            stub = manager_pb2_grpc.ManagerServiceStub(channel)
            prompts = PROMPTS_PER_INSTANCE * INSTANCES
            sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=11)
            request = manager_pb2.SubmitPromptsRequest(
                batch_id="step",
                policy_version=0,
                sampling=sampling,
                prompts=[
                    manager_pb2.Prompt(prompt_id=f"p{i}", token_ids=[1, 2, 3, 4], n=GROUP_SIZE) for i in range(prompts)
                ],
            )
            processes = {"manager": manager.process.pid} | {r.name: r.process.pid for r in relays}
            idle_before = await idle_cpu_per_second(manager.process.pid)
            started_cpu = {name: cpu_seconds(pid) for name, pid in processes.items()}
            submitted = time.time()
            await stub.SubmitPrompts(request, **call_options(60))
            groups = []
            async for reply in stub.StreamRollouts(
                manager_pb2.StreamRolloutsRequest(batch_id="step", micro_batch_groups=64), **call_options(900)
            ):
                await fetcher.fill(list(reply.groups))
                groups += reply.groups
            step_seconds = time.time() - submitted
            cpu = {name: cpu_seconds(pid) - started_cpu[name] for name, pid in processes.items()}
            await stub.AcknowledgeRollouts(manager_pb2.AcknowledgeRolloutsRequest(batch_id="step"), **call_options(30))
            idle_rate = (idle_before + await idle_cpu_per_second(manager.process.pid)) / 2
        await fetcher.close()
        result = StepResult(step_seconds, groups)
        lost, duplicated = check_exactly_once(result, prompts, GROUP_SIZE)
        tokens = result.tokens
        shard_cpu = sum(seconds for name, seconds in cpu.items() if name != "manager")
        # At its ceiling a manager core serves the fleet's heartbeats and, with what is left, tokens.
        per_token = max(1e-12, cpu["manager"] - idle_rate * step_seconds) / tokens
        figures = {
            "relay_shards": shards,
            "instances": INSTANCES,
            "tokens": tokens,
            "step_seconds": step_seconds,
            "tokens_per_second": tokens / step_seconds,
            "manager_cpu_seconds": cpu["manager"],
            "manager_cpu_seconds_per_million_tokens": 1e6 * cpu["manager"] / tokens,
            "manager_idle_cpu_per_second": idle_rate,
            "manager_cpu_seconds_per_million_tokens_beyond_idle": 1e6 * per_token,
            "manager_core_ceiling_tokens_per_second": (1 - idle_rate) / per_token,
            "shard_cpu_seconds_per_million_tokens": 1e6 * shard_cpu / tokens if shards else 0.0,
            "samples_lost": lost,
            "samples_duplicated": duplicated,
        }
        print(
            f"{lengths} lengths, {shards} relay shards: {tokens:,} tokens in {step_seconds:.1f} s, manager "
            f"{figures['manager_cpu_seconds_per_million_tokens']:.2f} CPU s per 1M tokens (a core's ceiling "
            f"{figures['manager_core_ceiling_tokens_per_second']:,.0f} tok/s), shards "
            f"{figures['shard_cpu_seconds_per_million_tokens']:.2f}, {lost}/{duplicated} lost/duplicated",
            flush=True,
        )
        return figures
    finally:
        await asyncio.to_thread(stop_children, children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", type=int, default=SHARDS, help=f"relay shards of the new path (default {SHARDS})")
    args = parser.parse_args()
    runs = {name: (asyncio.run(measure(0, name)), asyncio.run(measure(args.shards, name))) for name in LENGTHS}
    ceilings = {
        name: sharded["manager_core_ceiling_tokens_per_second"] / relayed["manager_core_ceiling_tokens_per_second"]
        for name, (relayed, sharded) in runs.items()
    }
    write_result(
        "relay_shards",
        {name: sharded for name, (_, sharded) in runs.items()},
        {name: relayed for name, (relayed, _) in runs.items()},
        {f"manager_ceiling_over_single_relay_{name}": ratio for name, ratio in ceilings.items()},
        {
            "ceiling >= 10x the single relay, reference lengths": ceilings["reference"] >= 10,
            "0 samples lost or duplicated": all(
                r["samples_lost"] == r["samples_duplicated"] == 0 for pair in runs.values() for r in pair
            ),
        },
        {
            "instances": INSTANCES,
            "relay_shards": args.shards,
            "per_instance": [PROMPTS_PER_INSTANCE, GROUP_SIZE],
            "lengths": {
                name: dict(zip(("mean", "sigma", "max"), values, strict=True)) for name, values in LENGTHS.items()
            },
            "chunk_tokens": 16,
            "queue_ahead": QUEUE_AHEAD,
            "report_window_seconds": REPORT_WINDOW_SECONDS,
        },
    )


if __name__ == "__main__":
    main()
