"""Spawning the mesh's processes: each service as its own process group with its log file (forked
by the fork server where it can be), waiting until they serve, stopping them, and finding a mesh's
processes by the marker each one carries."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlmesh.entrypoint import service_process_name
from rlmesh.forking.forkserver import ForkServer
from rlmesh.lifecycle import die_with_parent
from rlmesh.rpc.channels import wait_healthy

MESH_ID_ENV = "RLMESH_MESH_ID"
"""Set in every process of a mesh (to its output folder) so its processes can be found."""
STOP_TIMEOUT_SECONDS = 15.0


class Process(Protocol):
    """What the launcher uses of a spawned process: subprocess.Popen's interface (tests give fakes)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass(slots=True)
class Child:
    name: str
    address: str
    process: Process
    log_path: Path


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """How to start one service: `python -m module args...` with `settings` in its environment."""

    name: str
    module: str
    address: str
    settings: dict[str, str]
    python: str | None = None
    """Another virtualenv's interpreter (the vLLM one); None: this one's."""
    launcher: list[str] | None = None
    """Runs the module through another module (`torchrun_args`)."""
    args: list[str] | None = None
    netns: str | None = None
    """The network namespace it runs in (a rollout instance of `mesh.rollout_netns`)."""

    @property
    def forkable(self) -> bool:
        """Whether the fork server can start it: this interpreter, no launcher."""
        return self.python is None and self.launcher is None


def torchrun_args(ranks: int, master_port: int, master_addr: str = "127.0.0.1") -> list[str]:
    """`python -m torch.distributed.run ...` arguments that run a module on `ranks` local processes."""
    return [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
    ]


def service_environment(settings: dict[str, str], mesh_id: str) -> dict[str, str]:
    """A service's environment: this process's, its settings, the mesh's marker, one OpenMP thread."""
    return {**os.environ, **settings, MESH_ID_ENV: mesh_id, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _log_path(log_dir: Path, name: str) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{name}.log"


def spawn_service(
    name: str,
    module: str,
    address: str,
    settings: dict[str, str],
    log_dir: Path,
    mesh_id: str,
    python: str | None = None,
    launcher: list[str] | None = None,
    args: list[str] | None = None,
    netns: str | None = None,
) -> Child:
    """Starts `python -m module args...` as its own process group with `settings` in its
    environment and its output in `log_dir/name.log`; `python`, `launcher` and `netns` as in
    ServiceSpec."""
    log_path = _log_path(log_dir, name)
    env = service_environment(settings, mesh_id)
    # `ip netns exec` execs the rest, so the pid is the service's.
    wrapper = ["ip", "netns", "exec", netns] if netns else []
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [*wrapper, python or sys.executable, *(launcher or []), "-m", module, *(args or [])],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # If the launching process itself is killed, the kernel sends SIGTERM to its services too.
            preexec_fn=die_with_parent,
        )
    return Child(name, address, process, log_path)


def spawn(spec: ServiceSpec, log_dir: Path, mesh_id: str, forks: ForkServer | None = None) -> Child:
    """Forked by `forks` when given and the spec allows it, else started by exec."""
    if forks is not None and spec.forkable:
        log_path = _log_path(log_dir, spec.name)
        process = forks.spawn(
            spec.module, spec.args or [], service_environment(spec.settings, mesh_id), log_path, spec.netns
        )
        return Child(spec.name, spec.address, process, log_path)
    return spawn_service(
        spec.name,
        spec.module,
        spec.address,
        spec.settings,
        log_dir,
        mesh_id,
        python=spec.python,
        launcher=spec.launcher,
        args=spec.args,
        netns=spec.netns,
    )


async def wait_started(children: list[Child], timeout: float = 120.0) -> None:
    """Waits until every child's health service says SERVING; fails fast if one exits."""

    async def one(child: Child) -> None:
        waiting = asyncio.create_task(wait_healthy(child.address, timeout))
        while not waiting.done():
            if child.process.poll() is not None:
                waiting.cancel()
                raise RuntimeError(
                    f"{child.name} exited with code {child.process.returncode} while starting; see {child.log_path}"
                )
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


def describe_exit(code: int | None) -> str:
    return f"exited (killed by signal {-code})" if code is not None and code < 0 else f"exited (exit code {code})"


def process_name(pid: int) -> str | None:
    """/proc/<pid>/comm; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    except OSError:
        return None


def mesh_processes(output_dir: Path, service: str | None = None) -> list[int]:
    """Pids of live processes started for the mesh writing to `output_dir` (only the `service`'s
    when given: "manager", "rollout", ...), found by the MESH_ID_ENV each one carries."""
    marker = f"{MESH_ID_ENV}={output_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if service is not None and process_name(int(entry.name)) != service_process_name(service):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found
