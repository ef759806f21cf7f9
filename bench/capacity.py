"""The manager's real capacity: the manager process against hundreds of real rollout instances
(the synthetic engine) served from one host process (bench/capacity_host.py), each on its own
port with its own registration, heartbeats and GenerateMany stream: 50, 200 and 500 instances.
Figures: heartbeats answered a second against those the instances are asked for (one each every
2 s) with every lease held, dispatch latency of a
step's first requests, relay tok/s to the trainer side, the manager's CPU per instance idle and
during the step, its memory; the 50-instance run is the baseline the others are compared with."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import BenchAuth, StepResult, check_exactly_once, spawn_manager, write_result
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import spawn_service, stop_children, wait_started
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel

COUNTS = (50, 200, 500)
HOST_TOKENS_PER_SECOND = 60_000.0
"""What the host process's synthetic engines generate together at most: one Python process makes
every instance's chunks, so each instance's rate is this over the count."""
PROMPTS_PER_INSTANCE, GROUP_SIZE = 1, 8
MEAN_TOKENS, MAX_TOKENS = 48, 192
IDLE_SECONDS = 12.0
HEARTBEAT_SECONDS = 2.0
LEASE_SECONDS = 10.0
"""The manager's default: an instance whose heartbeats stop for this long is dropped."""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def host_settings(
    count: int, manager_address: str, auth: BenchAuth, mean_tokens: int = MEAN_TOKENS, sigma: float = 0.5
) -> dict[str, str]:
    rate = HOST_TOKENS_PER_SECOND / count
    batch = PROMPTS_PER_INSTANCE * GROUP_SIZE
    return {
        "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
        "RLMESH_ROLLOUT_SERVER__PORT": "0",
        "RLMESH_ROLLOUT_SERVER__LOG_LEVEL": "warning",
        "RLMESH_ROLLOUT_INSTANCE_ID": "hosted",
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        "RLMESH_ROLLOUT_ENGINE__KIND": "synthetic",
        "RLMESH_ROLLOUT_ENGINE__MAX_BATCH_SIZE": str(batch),
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": str(rate),
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__MIN_STEP_SECONDS": str(batch / rate),
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__LENGTH": "lognormal",
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__MEAN_TOKENS": str(mean_tokens),
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__SIGMA": str(sigma),
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__STREAM_INTERVAL": "16",
        # Every engine wakes once a tick: at hundreds in one process, a coarser tick keeps the host's
        # CPU for the gRPC work being measured.
        "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__TICK_SECONDS": "0.05",
        **auth.settings("RLMESH_ROLLOUT_", "instance"),
    }


async def wait_for(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        await asyncio.sleep(0.2)
    return json.loads(path.read_text())


async def measure(count: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"rlmesh-capacity-{count}-"))
    auth = BenchAuth(folder / "secrets")
    address = f"127.0.0.1:{free_port()}"
    manager = spawn_manager(address, auth, folder, {"HEARTBEAT_INTERVAL_SECONDS": str(HEARTBEAT_SECONDS)})
    children = [manager]
    try:
        auth.use()
        await wait_started([manager])
        registering = time.perf_counter()
        host = spawn_service(
            "host",
            "bench.capacity_host",
            address,
            host_settings(count, address, auth),
            folder,
            str(folder),
            args=["--count", str(count), "--out", str(folder)],
        )
        children.append(host)
        ready = await wait_for(folder / "ready.json", 120 + count)
        async with open_channel(address) as channel:
            stub = manager_pb2_grpc.ManagerServiceStub(channel)
            status = await stub.GetStatus(manager_pb2.GetStatusRequest(), **call_options(30))
            assert len(status.instances) == count, f"{len(status.instances)} of {count} registered; logs in {folder}"
            registered_seconds = time.perf_counter() - registering
            pid = manager.process.pid
            idle_cpu, idle_started = cpu_seconds(pid), time.time()
            await asyncio.sleep(IDLE_SECONDS)
            idle_cpu, idle_wall = cpu_seconds(pid) - idle_cpu, time.time() - idle_started
            beats = json.loads((folder / "heartbeats.json").read_text())
            window = [(t, n) for t, n in beats if t >= idle_started]
            heartbeats_per_second = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
            status = await stub.GetStatus(manager_pb2.GetStatusRequest(), **call_options(30))
            held = len(status.instances)
            prompts = PROMPTS_PER_INSTANCE * count
            sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11)
            request = manager_pb2.SubmitPromptsRequest(
                batch_id="step",
                policy_version=0,
                sampling=sampling,
                prompts=[
                    manager_pb2.Prompt(prompt_id=f"p{i}", token_ids=[1, 2, 3, 4], n=GROUP_SIZE) for i in range(prompts)
                ],
            )
            step_cpu = cpu_seconds(pid)
            submitted = time.time()
            await stub.SubmitPrompts(request, **call_options(60))
            groups = []
            stream = stub.StreamRollouts(
                manager_pb2.StreamRolloutsRequest(batch_id="step", micro_batch_groups=64), **call_options(900)
            )
            async for reply in stream:
                groups += reply.groups
            step_seconds = time.time() - submitted
            step_cpu = cpu_seconds(pid) - step_cpu
            status = await stub.GetStatus(manager_pb2.GetStatusRequest(), **call_options(30))
            held = min(held, len(status.instances))
            await stub.AcknowledgeRollouts(manager_pb2.AcknowledgeRolloutsRequest(batch_id="step"), **call_options(30))
        host.process.terminate()
        arrivals = await wait_for(folder / "arrivals.json", 120)
        first_wave = sorted(t - submitted for rid, t in arrivals.items() if rid.endswith("@1"))
        tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
        lost, duplicated = check_exactly_once(StepResult(step_seconds, groups), prompts, GROUP_SIZE)
        figures = {
            "instances": count,
            "instances_held": held,
            "lease_seconds": LEASE_SECONDS,
            "host_start_seconds": ready["start_seconds"],
            "registered_seconds": registered_seconds,
            "heartbeats_per_second": heartbeats_per_second,
            "heartbeats_per_second_asked": count / HEARTBEAT_SECONDS,
            "dispatch_latency_p50_ms": 1000 * statistics.median(first_wave),
            "dispatch_latency_p99_ms": 1000 * first_wave[min(len(first_wave) - 1, int(0.99 * len(first_wave)))],
            "relay_tokens_per_second": tokens / step_seconds,
            "step_seconds": step_seconds,
            "tokens": tokens,
            "manager_idle_cpu_per_second": idle_cpu / idle_wall,
            "manager_idle_cpu_per_instance": idle_cpu / idle_wall / count,
            "manager_step_cpu_per_second": step_cpu / step_seconds,
            "manager_cpu_seconds_per_million_tokens": 1e6 * step_cpu / tokens,
            "manager_peak_memory_mb": memory_mb(pid, "VmHWM"),
            "samples_lost": lost,
            "samples_duplicated": duplicated,
        }
        print(
            f"{count} instances: {held} held, {heartbeats_per_second:.0f} heartbeats/s answered "
            f"(asked for {count / HEARTBEAT_SECONDS:.0f}), dispatch p50 {figures['dispatch_latency_p50_ms']:.0f} ms "
            f"p99 {figures['dispatch_latency_p99_ms']:.0f} ms, relay {figures['relay_tokens_per_second']:.0f} tok/s, "
            f"manager {figures['manager_idle_cpu_per_second']:.3f} CPU idle, "
            f"{figures['manager_step_cpu_per_second']:.2f} in the step, {figures['manager_peak_memory_mb']:.0f} MB, "
            f"{lost}/{duplicated} lost/duplicated",
            flush=True,
        )
        return figures
    finally:
        await asyncio.to_thread(stop_children, children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)), help="instance counts (default 50,200,500)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    runs = {str(count): asyncio.run(measure(count)) for count in counts}
    base, largest = runs[str(counts[0])], runs[str(counts[-1])]
    write_result(
        "capacity",
        {"runs": {k: v for k, v in runs.items() if k != str(counts[0])}},
        {"runs": {str(counts[0]): base}},
        {
            "idle_cpu_per_instance_largest_over_smallest": largest["manager_idle_cpu_per_instance"]
            / base["manager_idle_cpu_per_instance"],
            "heartbeats_answered_over_asked_largest": largest["heartbeats_per_second"]
            / largest["heartbeats_per_second_asked"],
        },
        {
            f"{counts[-1]} instances held through the idle window and the step": largest["instances_held"]
            == counts[-1],
            "every lease held in every run": all(r["instances_held"] == r["instances"] for r in runs.values()),
            "0 samples lost or duplicated": all(
                r["samples_lost"] == r["samples_duplicated"] == 0 for r in runs.values()
            ),
        },
        {
            "counts": counts,
            "host_tokens_per_second": HOST_TOKENS_PER_SECOND,
            "per_instance": [PROMPTS_PER_INSTANCE, GROUP_SIZE],
            "lengths": {"mean": MEAN_TOKENS, "max": MAX_TOKENS, "sigma": 0.5},
            "heartbeat_seconds": HEARTBEAT_SECONDS,
            "idle_seconds": IDLE_SECONDS,
        },
    )


if __name__ == "__main__":
    main()
