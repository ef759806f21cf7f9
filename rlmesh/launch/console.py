"""The console of `rlmesh up`: what the mesh runs once it is up, the training progress bar (a line
per tenth of the run without a terminal) with the supervisor's events written above it, and the
summary at the end. It only reads: the supervisor's events and the trainer's status."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from tqdm import tqdm

from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.processes import describe_exit
from rlmesh.launch.supervisor import Event, Notice, ServiceEnded
from rlmesh.rpc.channels import call_options
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc

POLL_SECONDS = 0.5
INTERRUPTED = 130
"""The run's exit code after Ctrl-C (or SIGTERM)."""
SHOWN_METRICS = {"reward": "reward", "eval/sampled_reward": "held-out", "eval/exact_match": "exact"}
"""The trainer's metrics beside the progress bar, by the label they show under."""

TrainingStatus = tuple[int, dict[str, float]]
"""The trainer's step and its latest metrics."""


async def read_training_status(trainer: trainer_pb2_grpc.TrainerServiceStub) -> TrainingStatus | None:
    """None while the trainer does not answer (starting, restarting)."""
    try:
        status = await trainer.GetTrainingStatus(trainer_pb2.GetTrainingStatusRequest(), **call_options(2.0))
    except grpc.aio.AioRpcError:
        return None
    return status.step, dict(status.metrics)


async def follow_training(
    events: asyncio.Queue[Event],
    read_status: Callable[[], Awaitable[TrainingStatus | None]],
    steps: int,
    stop: asyncio.Event,
) -> int:
    """Shows the progress and the events until the trainer has ended; returns its exit code
    (INTERRUPTED once `stop` is set)."""
    interactive = sys.stderr.isatty()
    bar = tqdm(total=steps, unit="step", desc="training", dynamic_ncols=True, disable=not interactive)
    reported = 0
    try:
        while not stop.is_set():
            while not events.empty():
                event = events.get_nowait()
                if isinstance(event, ServiceEnded) and event.name == "trainer":
                    bar.update(steps - bar.n if event.code == 0 else 0)
                    return event.code
                # Through tqdm, so a redrawn progress bar does not overwrite the line.
                tqdm.write(
                    event.text
                    if isinstance(event, Notice)
                    else f"{event.name} {describe_exit(event.code)}; not started again",
                    file=sys.stderr,
                )
            status = await read_status()
            if status is not None:
                step, metrics = status
                figures = {label: f"{metrics[key]:.3f}" for key, label in SHOWN_METRICS.items() if key in metrics}
                bar.update(step - bar.n)
                bar.set_postfix(figures)
                if not interactive and step >= reported + max(1, steps // 10):
                    reported = step
                    print(f"step {step}/{steps} " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
            await asyncio.sleep(POLL_SECONDS)
        return INTERRUPTED
    finally:
        bar.close()


INSECURE_WARNING = "INSECURE: authorization is off, anyone who reaches a port may call every RPC"


def describe_mesh(plan: LaunchPlan) -> str:
    """The line `rlmesh up` prints once the services serve."""
    mesh = plan.mesh
    return (
        f"mesh up: manager {plan.manager_address}"
        + (f" (relay shards {', '.join(plan.relay_addresses)})" if plan.relay_addresses else "")
        + f", weights {plan.weights_address}, "
        f"rollout {', '.join(plan.rollout_address(i) for i in range(mesh.rollout_instances))}"
        + (
            f" (up to {mesh.instance_cap}{', autoscaled' if mesh.autoscale else ''})"
            if mesh.instance_cap > mesh.rollout_instances
            else ""
        )
        + f", trainer {plan.trainer_address}, OpenAI gateway {'https' if plan.tls_dir is not None else 'http'}://"
        + f"{plan.gateway_address}/sessions/<session>/v1"
        + (f" ({mesh.trainer_ranks} FSDP ranks)" if mesh.trainer_ranks > 1 else "")
        + f"; logs in {plan.log_dir}"
        + (f"; mutual TLS with the certificates in {plan.tls_dir}" if plan.tls_dir is not None else "")
        + (
            f"; every call authorized by role, secrets in {plan.secrets_dir}"
            if plan.secrets_dir is not None
            else f"; {INSECURE_WARNING}"
        )
        + (
            "; in their own network namespaces: "
            + ", ".join(f"rollout-{i} ({link.namespace})" for i, link in enumerate(plan.netns.links))
            if plan.netns is not None
            else ""
        )
    )


def print_summary(plan: LaunchPlan, elapsed: float) -> None:
    summary_path = plan.output_dir / "summary.json"
    if not summary_path.exists():
        return
    summary = json.loads(summary_path.read_text())
    start, end = summary["start"], summary["end"]

    def figure(values: dict, key: str) -> str:
        # A validation no instance could serve is skipped: its figures are missing.
        return f"{values[key]:.3f}" if key in values else "n/a"

    print(
        f"\ntrained {summary['steps']} steps in {elapsed:.0f} s (weight version {summary['weight_version']})\n"
        f"held-out sampled reward {figure(start, 'eval/sampled_reward')} -> {figure(end, 'eval/sampled_reward')}, "
        f"greedy exact match {figure(start, 'eval/exact_match')} -> {figure(end, 'eval/exact_match')}\n"
        f"metrics:     {summary['metrics']}\n"
        f"tensorboard: {summary['tensorboard']}\n"
        f"plot:        {summary['plot']}\n"
        f"checkpoint:  {summary['checkpoint']}\n"
        + "".join(f"{name + ':':<13}{where}\n" for name, where in summary.get("tracking", {}).items())
        + f"logs:        {plan.log_dir}"
    )


def print_failure(plan: LaunchPlan, code: int, log_path: Path) -> None:
    """Why training failed, where to look, and how to resume."""
    reason = plan.output_dir / "error.txt"
    why = f": {reason.read_text().strip()}" if reason.is_file() else ""
    print(
        f"training failed (exit {code}){why}\nsee {log_path}\n"
        f"the run resumes from its last checkpoint when started again with --output-dir {plan.output_dir}",
        file=sys.stderr,
    )
