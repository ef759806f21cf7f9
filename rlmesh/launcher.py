"""`rlmesh up`: the whole mesh as local processes on loopback: start in dependency order, wait on
each health service, show training progress, and stop every process at the end or on Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from rlmesh.lifecycle import die_with_parent
from rlmesh.rpc import call_options, open_channel, wait_healthy
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc

MESH_ID_ENV = "RLMESH_MESH_ID"
"""Set in every process of a mesh (to its output folder) so its processes can be found."""
STOP_TIMEOUT_SECONDS = 15.0
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
"""The vLLM engine's own virtualenv (`make setup-vllm`)."""


@dataclass(frozen=True, slots=True)
class MeshPlan:
    output_dir: Path
    model_dir: Path
    steps: int
    rollout_instances: int
    host: str
    base_port: int
    max_staleness: int
    transfer_backend: str
    trainer_ranks: int = 1
    """FSDP ranks of the trainer; more than one runs it under torchrun on this machine."""
    rollout_tp: int = 1
    """Tensor-parallel processes per rollout instance."""
    compression: str = "none"
    """Link compression of weight pushes."""
    trainer_config: Path | None = None
    """The trainer's config file, written from the job (tasks, algorithm, outputs)."""
    engine: str = "torch"
    """Rollout engine: `torch`, or `vllm` run with the vLLM virtualenv's Python."""

    @property
    def manager_address(self) -> str:
        return f"{self.host}:{self.base_port}"

    @property
    def weights_address(self) -> str:
        return f"{self.host}:{self.base_port + 1}"

    @property
    def trainer_address(self) -> str:
        return f"{self.host}:{self.base_port + 2}"

    def rollout_address(self, index: int) -> str:
        return f"{self.host}:{self.base_port + 10 + index}"


@dataclass(slots=True)
class Child:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def torchrun_args(ranks: int, master_port: int, master_addr: str = "127.0.0.1") -> list[str]:
    """`python -m torch.distributed.run ...` arguments that run a module on `ranks` local processes."""
    return ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--master-addr", master_addr, "--master-port", str(master_port)]


def spawn_service(name: str, module: str, address: str, settings: dict[str, str], log_dir: Path, mesh_id: str,
                  python: str | None = None, launcher: list[str] | None = None, args: list[str] | None = None) -> Child:
    """Starts `python -m module args...` as its own process group with `settings` in its
    environment and its output in `log_dir/name.log`; `python` picks another virtualenv (the
    vLLM one); `launcher` runs the module through another module (`torchrun_args`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, **settings, MESH_ID_ENV: mesh_id, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [python or sys.executable, *(launcher or []), "-m", module, *(args or [])],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # If the launching process itself is killed, the kernel sends SIGTERM to its services too.
            preexec_fn=die_with_parent,
        )
    return Child(name, address, process, log_path)


async def wait_started(children: list[Child], timeout: float = 120.0) -> None:
    """Waits until every child's health service says SERVING; fails fast if one exits."""

    async def one(child: Child) -> None:
        waiting = asyncio.create_task(wait_healthy(child.address, timeout))
        while not waiting.done():
            if child.process.poll() is not None:
                waiting.cancel()
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} while starting; see {child.log_path}")
            await asyncio.sleep(0.1)
        waiting.result()

    await asyncio.gather(*(one(c) for c in children))


def stop_children(children: list[Child]) -> None:
    """SIGTERM in reverse start order, SIGKILL after a timeout."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


class Mesh:
    def __init__(self, plan: MeshPlan) -> None:
        self.plan = plan
        self.children: list[Child] = []
        self.log_dir = plan.output_dir / "logs"

    def _spawn(self, name: str, module: str, address: str, settings: dict[str, str], launcher: list[str] | None = None,
               python: str | None = None, args: list[str] | None = None) -> Child:
        child = spawn_service(name, module, address, settings, self.log_dir, str(self.plan.output_dir), python=python,
                              launcher=launcher, args=args)
        self.children.append(child)
        return child

    async def start_services(self) -> None:
        plan = self.plan
        manager = self._spawn("manager", "services.manager", plan.manager_address, {
            "RLMESH_MANAGER_SERVER__HOST": plan.host,
            "RLMESH_MANAGER_SERVER__PORT": _port(plan.manager_address),
            "RLMESH_MANAGER_MAX_STALENESS": str(plan.max_staleness),
        })
        await wait_started([manager])
        weights = self._spawn("weights", "services.weights", plan.weights_address, {
            "RLMESH_WEIGHTS_SERVER__HOST": plan.host,
            "RLMESH_WEIGHTS_SERVER__PORT": _port(plan.weights_address),
            "RLMESH_WEIGHTS_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_WEIGHTS_BACKEND": plan.transfer_backend,
            "RLMESH_WEIGHTS_COMPRESSION": plan.compression,
        })
        rollouts = [
            self._spawn(f"rollout-{i}", "services.rollout", plan.rollout_address(i), {
                "RLMESH_ROLLOUT_SERVER__HOST": plan.host,
                "RLMESH_ROLLOUT_SERVER__PORT": _port(plan.rollout_address(i)),
                "RLMESH_ROLLOUT_INSTANCE_ID": f"rollout-{i}",
                "RLMESH_ROLLOUT_MANAGER_ADDRESS": plan.manager_address,
                "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(plan.model_dir),
                "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "true" if plan.transfer_backend == "mooncake" else "false",
                "RLMESH_ROLLOUT_ENGINE__TENSOR_PARALLEL_SIZE": str(plan.rollout_tp),
                "RLMESH_ROLLOUT_ENGINE__KIND": plan.engine,
            }, python=str(VLLM_PYTHON) if plan.engine == "vllm" else None)
            for i in range(plan.rollout_instances)
        ]
        await wait_started([weights, *rollouts])

    async def start_trainer(self) -> Child:
        """One trainer process, or torchrun with `trainer_ranks` of them (rank 0 serves the port)."""
        plan = self.plan
        launcher = torchrun_args(plan.trainer_ranks, free_port(plan.host), plan.host) if plan.trainer_ranks > 1 else None
        trainer = self._spawn("trainer", "services.trainer", plan.trainer_address, {
            "RLMESH_TRAINER_SERVER__HOST": plan.host,
            "RLMESH_TRAINER_SERVER__PORT": _port(plan.trainer_address),
            "RLMESH_TRAINER_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_TRAINER_WEIGHTS_ADDRESS": plan.weights_address,
            "RLMESH_TRAINER_MODEL_DIR": str(plan.model_dir),
            "RLMESH_TRAINER_OUTPUT_DIR": str(plan.output_dir),
            "RLMESH_TRAINER_STEPS": str(plan.steps),
        }, launcher, args=["--config", str(plan.trainer_config)] if plan.trainer_config else None)
        await wait_started([trainer])
        return trainer

    def crashed(self) -> Child | None:
        return next((c for c in self.children if c.name != "trainer" and c.process.poll() is not None), None)

    def stop(self) -> None:
        """Trainer first, manager last."""
        stop_children(self.children)


async def follow_training(mesh: Mesh, trainer: Child, stop: asyncio.Event) -> int:
    """Shows a progress bar until the trainer exits; returns its exit code (130 if interrupted)."""
    channel = open_channel(trainer.address)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    interactive = sys.stderr.isatty()
    bar = tqdm(total=mesh.plan.steps, unit="step", desc="training", dynamic_ncols=True, disable=not interactive)
    reported = 0
    try:
        while trainer.process.poll() is None:
            if stop.is_set():
                return 130
            crashed = mesh.crashed()
            if crashed:
                print(f"\n{crashed.name} exited with code {crashed.process.returncode}; see {crashed.log_path}", file=sys.stderr)
                return 1
            try:
                status = await stub.GetTrainingStatus(trainer_pb2.GetTrainingStatusRequest(), **call_options(2.0))
                shown = {"reward": "reward", "eval/sampled_reward": "held-out", "eval/exact_match": "exact"}
                figures = {label: f"{status.metrics[key]:.3f}" for key, label in shown.items() if key in status.metrics}
                bar.update(status.step - bar.n)
                bar.set_postfix(figures)
                # Without a terminal, a line per tenth of the run instead of a redrawn bar.
                if not interactive and status.step >= reported + max(1, mesh.plan.steps // 10):
                    reported = status.step
                    print(f"step {status.step}/{mesh.plan.steps} " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
        bar.update(mesh.plan.steps - bar.n if trainer.process.returncode == 0 else 0)
        return trainer.process.returncode
    finally:
        bar.close()
        await channel.close()


def print_summary(plan: MeshPlan, elapsed: float) -> None:
    summary_path = plan.output_dir / "summary.json"
    if not summary_path.exists():
        return
    summary = json.loads(summary_path.read_text())
    start, end = summary["start"], summary["end"]
    print(
        f"\ntrained {summary['steps']} steps in {elapsed:.0f} s (weight version {summary['weight_version']})\n"
        f"held-out sampled reward {start['eval/sampled_reward']:.3f} -> {end['eval/sampled_reward']:.3f}, "
        f"greedy exact match {start['eval/exact_match']:.3f} -> {end['eval/exact_match']:.3f}\n"
        f"metrics:     {summary['metrics']}\n"
        f"tensorboard: {summary['tensorboard']}\n"
        f"plot:        {summary['plot']}\n"
        f"checkpoint:  {summary['checkpoint']}\n"
        f"logs:        {plan.output_dir / 'logs'}"
    )


async def run_mesh(plan: MeshPlan) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    mesh = Mesh(plan)
    started = time.perf_counter()
    try:
        starting = asyncio.create_task(mesh.start_services())
        interrupted = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        starting.result()
        interrupted.cancel()
        print(f"mesh up: manager {plan.manager_address}, weights {plan.weights_address}, "
              f"rollout {', '.join(plan.rollout_address(i) for i in range(plan.rollout_instances))}, "
              f"trainer {plan.trainer_address}"
              + (f" ({plan.trainer_ranks} FSDP ranks)" if plan.trainer_ranks > 1 else "") + f"; logs in {mesh.log_dir}")
        trainer = await mesh.start_trainer()
        code = await follow_training(mesh, trainer, stop)
        if code == 0:
            print_summary(plan, time.perf_counter() - started)
        elif code != 130:
            reason = plan.output_dir / "error.txt"
            why = f": {reason.read_text().strip()}" if reason.is_file() else ""
            print(f"training failed (exit {code}){why}\nsee {trainer.log_path}", file=sys.stderr)
        return code
    except (RuntimeError, TimeoutError) as exc:
        print(f"rlmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        await asyncio.to_thread(mesh.stop)
