"""Services and trainer ranks as real processes: a rollout instance or a manager started as
`rlmesh up` starts them, worker modules on N trainer ranks (RankRunner), and what a test reads of
a process (its parent, its log's tail) or does to one (stop its whole group)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from rlmesh.cli.main import WARM_FORK_SERVER_ENV
from rlmesh.forking.forkserver import ForkServer
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, ServiceSpec, spawn, spawn_service
from tests.support.credentials import suite_auth_env


def spawn_rollout(
    log_dir, manager_address: str, instance_id: str, forks: ForkServer | None = None, **settings: str
) -> Child:
    """A rollout instance as a real process, forked by `forks` when given (as `rlmesh up` starts
    it), else started by exec; `settings` are RolloutConfig fields by their environment names
    without the prefix (ENGINE__KIND="synthetic")."""
    port = free_port()
    env = {
        "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
        "RLMESH_ROLLOUT_SERVER__PORT": str(port),
        "RLMESH_ROLLOUT_INSTANCE_ID": instance_id,
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        **suite_auth_env("RLMESH_ROLLOUT_", "instance"),
        **{f"RLMESH_ROLLOUT_{key}": value for key, value in settings.items()},
    }
    return spawn(
        ServiceSpec(instance_id, "services.rollout", f"127.0.0.1:{port}", env), Path(log_dir), str(log_dir), forks
    )


def spawn_manager(log_dir, address: str, journal) -> Child:
    """A manager as a real process on `address`, keeping its journal at `journal` (a restarted one
    given the same path goes on from it)."""
    return spawn_service(
        "manager",
        "services.manager",
        address,
        {
            "RLMESH_MANAGER_SERVER__HOST": "127.0.0.1",
            **suite_auth_env("RLMESH_MANAGER_", "manager"),
            "RLMESH_MANAGER_SERVER__PORT": address.rsplit(":", 1)[1],
            "RLMESH_MANAGER_JOURNAL_PATH": str(journal),
            "RLMESH_MANAGER_LEASE_SECONDS": "10",
        },
        log_dir,
        mesh_id=str(log_dir),
    )


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, for a failure message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM (the instance drains, deregisters and stops its engine core), then SIGKILL to the
    whole group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def parent_pid(pid: int) -> int | None:
    """The pid of `pid`'s parent, from /proc; None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def suite_warm_fork_server() -> Path | None:
    """The test worker's warm fork server (conftest), which the fork servers tests start are forked from."""
    return Path(os.environ[WARM_FORK_SERVER_ENV]) if WARM_FORK_SERVER_ENV in os.environ else None


RANK_IMPORTS = (
    "services.trainer.main",
    "services.trainer.ranks.commands",
    "torch.distributed.checkpoint.state_dict",
    "transformers.initialization",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "tests.support.credentials",
    "tests.support.samples",
    "tests.support.tensors",
)
"""What a trainer rank's worker module imports, for the rank fork server to import once."""


class RankRunner:
    """Runs a worker module on N trainer ranks as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in each rank's environment), each rank a process forked from a fork
    server that has imported torch, transformers and FSDP: some 5 CPU-seconds less per rank, and no
    launcher process. torchrun itself runs in `rlmesh up --trainer-ranks` (tests/e2e)."""

    def __init__(self, log_dir: Path) -> None:
        self._forks = ForkServer(
            list(RANK_IMPORTS),
            {**os.environ, "OMP_NUM_THREADS": "1"},
            log_dir / "forkserver.log",
            suite_warm_fork_server(),
        )

    def run(
        self, module: str, args: list[str], ranks: int, log_dir: Path, timeout: float, distributed: bool = True
    ) -> None:
        """`python -m module args` on `ranks` processes (`distributed` False: one process, no
        process-group environment); fails with the ranks' logs when one fails or the time runs out,
        and a rank left waiting on a failed one is killed."""
        port = str(free_port())
        processes = []
        for rank in range(ranks):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if distributed:
                env |= {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
            log_path = log_dir / f"{module.rsplit('.', 1)[-1]}-{port}-rank{rank}.log"
            processes.append((self._forks.spawn(module, args, env, log_path), log_path))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                codes = [process.poll() for process, _ in processes]
                if None not in codes or any(code not in (None, 0) for code in codes):
                    break
                time.sleep(0.05)
        finally:
            for process, _ in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
        codes = [process.returncode for process, _ in processes]
        assert codes == [0] * ranks, f"{module} on {ranks} ranks exited {codes}:\n" + "\n".join(
            f"--- rank {rank} ---\n{log_tail(log_path, 60)}" for rank, (_, log_path) in enumerate(processes)
        )

    def close(self) -> None:
        self._forks.close()
