"""A host of many rollout instances in one process, for bench.capacity: each is the real rollout
service on the synthetic engine (its own gRPC server and port, registration, heartbeats and
GenerateMany streams), started side by side on one event loop. It writes when each request
arrived and how many heartbeats the manager answered, and drains every instance on SIGTERM.

    python -m bench.capacity_host --count 200 --out DIR   (settings from RLMESH_ROLLOUT_* as for one instance)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

from rlmesh.config import load_config
from rlmesh.logging import configure_logging
from rlmesh.rpc.channels import use_server_identity
from services.rollout.config import RolloutConfig
from services.rollout.main import RunningRollout, start

STARTS_AT_ONCE = 25
"""Instances registering at the same moment: a whole fleet at once would be a registration storm
this benchmark does not measure."""


class Recorded:
    """Arrivals of requests by engine request id, and heartbeats answered, over every instance."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.heartbeats = 0

    def watch(self, running: RunningRollout) -> None:
        engine, membership = running.engine, running.membership
        generate, heartbeat = engine.generate, membership._heartbeat

        def arriving(request):
            self.arrivals.setdefault(request.request_id, time.time())
            return generate(request)

        async def answered() -> None:
            await heartbeat()
            self.heartbeats += 1

        engine.generate = arriving
        membership._heartbeat = answered


async def host(count: int, out: Path) -> None:
    base = load_config(RolloutConfig, os.environ.get("RLMESH_ROLLOUT_CONFIG"), env_prefix="RLMESH_ROLLOUT_")
    use_server_identity(base.server)
    recorded = Recorded()
    running: list[RunningRollout] = []
    started = time.perf_counter()
    for first in range(0, count, STARTS_AT_ONCE):
        configs = [
            base.model_copy(update={"instance_id": f"{base.instance_id}-{index}"})
            for index in range(first, min(count, first + STARTS_AT_ONCE))
        ]
        running += await asyncio.gather(*(start(config) for config in configs))
    for instance in running:
        recorded.watch(instance)
    (out / "ready.json").write_text(json.dumps({"instances": count, "start_seconds": time.perf_counter() - started}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    heartbeats_at = [(time.time(), 0)]

    async def sample_heartbeats() -> None:
        while True:
            await asyncio.sleep(1.0)
            heartbeats_at.append((time.time(), recorded.heartbeats))
            (out / "heartbeats.json").write_text(json.dumps(heartbeats_at))

    sampler = asyncio.create_task(sample_heartbeats())
    await stop.wait()
    sampler.cancel()
    (out / "arrivals.json").write_text(json.dumps(recorded.arrivals))
    await asyncio.gather(*(instance.stop() for instance in running), return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    configure_logging("warning", service="rollout")
    asyncio.run(host(args.count, args.out))


if __name__ == "__main__":
    main()
