"""Remote rewards: the default job's training throughput with its reward computed by a verifier over
gRPC that takes 50 ms per sample, against the same job with the instant built-in reward in the same
run. The verifier scores a call's samples concurrently, as a service would; the trainer scores each
micro-batch as it arrives, so the latency overlaps generation and training."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
from pathlib import Path

import grpc

from bench.common import write_result
from bench.training_runs import TrainingRun, run_up
from rlmesh.launch.ports import free_port
from rlmesh.logging import configure_logging
from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.tasks.increment import reward

TARGET_RATIO = 0.9
WARMUP_STEPS = 3
"""Left out: the first steps pay for the processes' first calls."""


class SlowVerifier(reward_pb2_grpc.RewardServiceServicer):
    """The increment reward, each sample taking `delay` seconds (all of a call's samples at once)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.samples = 0

    async def _one(self, item: reward_pb2.ScoreItem) -> reward_pb2.ScoreResult:
        await asyncio.sleep(self.delay)
        answer = json.loads(item.metadata_json)["answer"]
        return reward_pb2.ScoreResult(sample_id=item.sample_id, reward=reward(item.completion.strip(), answer))

    async def Score(self, request, context):
        self.samples += len(request.items)
        return reward_pb2.ScoreResponse(results=await asyncio.gather(*(self._one(i) for i in request.items)))


def serve_verifier(delay: float) -> tuple[str, SlowVerifier, threading.Event]:
    """The verifier on a thread of its own (the training run is a subprocess); set the event to stop it."""
    address = f"127.0.0.1:{free_port()}"
    verifier = SlowVerifier(delay)
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        reward_pb2_grpc.add_RewardServiceServicer_to_server(verifier, server)
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    ready.wait(30)
    return address, verifier, stop


def steady_steps(run: TrainingRun) -> list[dict]:
    return [r for r in run.steps if WARMUP_STEPS < r["step"] < run.summary["steps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    args = parser.parse_args()
    configure_logging(service="bench")
    common = [f"algorithm.checkpoint_every={args.steps}", f"algorithm.eval_every={args.steps}"]
    address, verifier, stop = serve_verifier(args.delay_ms / 1000)
    try:
        with tempfile.TemporaryDirectory(prefix="rlmesh-bench-rewards-") as scratch:
            instant = run_up(Path(scratch) / "instant", args.steps, common)
            # --insecure: the bench's verifier checks no secret (the Node verifier shows how one does).
            remote = run_up(
                Path(scratch) / "remote", args.steps, common + [f"tasks.0.reward.remote={address}"], ["--insecure"]
            )
    finally:
        stop.set()
    instant_steps, remote_steps = steady_steps(instant), steady_steps(remote)
    instant_seconds = statistics.mean(r["step_seconds"] for r in instant_steps)
    remote_seconds = statistics.mean(r["step_seconds"] for r in remote_steps)
    figures = {
        "remote_step_seconds": remote_seconds,
        "remote_steps_per_second": 1 / remote_seconds,
        "remote_reward_mean": statistics.mean(r["reward"] for r in remote_steps),
        "remote_reward_failures": sum(r["reward_failures"] for r in remote.steps),
        "samples_scored_by_verifier": verifier.samples,
    }
    baseline = {
        "instant_step_seconds": instant_seconds,
        "instant_steps_per_second": 1 / instant_seconds,
        "instant_reward_mean": statistics.mean(r["reward"] for r in instant_steps),
    }
    ratios = {"remote_over_instant_throughput": instant_seconds / remote_seconds}
    targets = {
        f"remote_over_instant_throughput >= {TARGET_RATIO}": ratios["remote_over_instant_throughput"] >= TARGET_RATIO
    }
    write_result(
        "rewards",
        figures,
        baseline,
        ratios,
        targets,
        {
            "steps": args.steps,
            "verifier_delay_ms_per_sample": args.delay_ms,
            "warmup_steps_left_out": WARMUP_STEPS,
            "job": "the default job (increment task, tiny model)",
        },
    )


if __name__ == "__main__":
    main()
