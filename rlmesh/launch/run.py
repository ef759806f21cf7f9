"""`rlmesh up`'s run: the whole mesh as local processes: network namespaces set up, the services
started in dependency order, then the supervisor, the autoscaler and the console side by side
until the trainer has ended or Ctrl-C, and every process stopped at the end."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial

from rlmesh.launch.autoscale import autoscale
from rlmesh.launch.console import (
    INSECURE_WARNING,
    INTERRUPTED,
    describe_mesh,
    follow_training,
    print_failure,
    print_summary,
    read_training_status,
)
from rlmesh.launch.netns import create_netns, remove_netns, sweep_netns
from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.starter import JobRefused, ServiceStarter
from rlmesh.launch.supervisor import Supervisor
from rlmesh.rpc.channels import open_channel, use_secret, use_tls
from rlmesh.rpc.credentials import read_secret
from rlmesh.tasks.check import CHECK_FAILED
from rlmesh.trainer.v1 import trainer_pb2_grpc


async def _start_services(supervisor: Supervisor, stop: asyncio.Event, prepare: Callable[[], Awaitable[None]]) -> bool:
    """False when interrupted before every service served; `prepare` is awaited first."""

    async def start() -> None:
        await prepare()
        await supervisor.start_services()

    starting = asyncio.create_task(start())
    interrupted = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if not starting.done():
        starting.cancel()
        return False
    starting.result()
    return True


async def _train(plan: LaunchPlan, supervisor: Supervisor, stop: asyncio.Event) -> int:
    """The trainer's exit code once it has ended, with the supervisor (and the autoscaler) running
    beside the console; a background task that fails ends the run with its error."""
    await supervisor.start_trainer()
    background = [asyncio.create_task(supervisor.run())]
    if plan.mesh.autoscale:
        background.append(asyncio.create_task(autoscale(plan, supervisor)))
    try:
        async with open_channel(plan.trainer_address) as channel:
            trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
            console = asyncio.create_task(
                follow_training(supervisor.events, partial(read_training_status, trainer), plan.steps, stop)
            )
            await asyncio.wait({console, *background}, return_when=asyncio.FIRST_COMPLETED)
            if not console.done():
                console.cancel()
                for task in background:
                    if task.done():
                        task.result()
                raise RuntimeError("the supervisor stopped")
            return console.result()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


async def run_mesh(plan: LaunchPlan) -> int:
    """Runs the plan's mesh to the end of training; returns `rlmesh up`'s exit code."""
    # The launcher's own calls (health checks, progress, autoscaling) are an operator's.
    use_tls(plan.tls_files("client"))
    operator_secret = plan.secret_file("operator")
    use_secret(read_secret(operator_secret) if operator_secret is not None else "")
    if plan.secrets_dir is None:
        print(f"rlmesh up: {INSECURE_WARNING}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starter = ServiceStarter(plan)
    supervisor = Supervisor(plan, spawn_service=starter)
    started = time.perf_counter()
    try:
        if plan.netns is not None:
            swept = sweep_netns()
            if swept:
                print(f"removed what killed meshes left: {', '.join(swept)}", file=sys.stderr)
            create_netns(plan.netns)
        if not await _start_services(supervisor, stop, starter.prepare):
            return INTERRUPTED
        print(describe_mesh(plan))
        code = await _train(plan, supervisor, stop)
        if code == 0:
            print_summary(plan, time.perf_counter() - started)
        elif code != INTERRUPTED:
            print_failure(plan, code, supervisor.trainer.child.log_path)
        return code
    except JobRefused as exc:
        print(str(exc), file=sys.stderr)
        return CHECK_FAILED
    except (RuntimeError, TimeoutError) as exc:
        print(f"rlmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        await asyncio.to_thread(supervisor.stop)
        starter.close()
        if plan.netns is not None:
            remove_netns(plan.netns)
