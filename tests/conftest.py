"""Shared fixtures (a small model folder created once per session), the suite's Hypothesis settings,
and what `make test`'s pytest-xdist workers (--dist loadfile) need: the slowest files first, and
mesh ports that no other worker draws."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# As in `rlmesh up` (rlmesh/cli/run_commands.py): a worker starts processes (fork, then exec) while its in-process
# servers' gRPC threads run. gRPC's fork handlers would restart its pollers in the child before the
# exec, where closing the inherited descriptors makes a poller abort the child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# The node and kubectl `make test` put into the virtualenv where the host lacks them
# (scripts/host_tools.py), for a pytest run by hand as much as one the Makefile starts.
os.environ["PATH"] = f"{Path(sys.prefix) / 'tools' / 'bin'}{os.pathsep}{os.environ['PATH']}"

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

from rlmesh.cli.main import WARM_FORK_SERVER_ENV
from rlmesh.config import METRICS_PORT_OFFSET
from rlmesh.launch import ports as launch_ports
from rlmesh.lifecycle import die_with_parent
from rlmesh.models.builtin import ensure_model
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model
from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
from services.trainer.ranks.distributed import RankInfo
from tests.support.credentials import play_every_role
from tests.support.processes import RankRunner
from tests.support.waiting import wait_until

torch.set_num_threads(1)

# No per-example deadline: on a busy 2-core machine one slow example (a GC pause, a tokenizer
# built) is timing, not a failed property.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

SLOWEST_FILES = (
    "e2e/test_gpu_check.py",
    "e2e/test_chaos.py",
    "vllm/test_vllm_rollout.py",
    "e2e/test_trainer_resume.py",
    "e2e/test_jobs.py",
    "e2e/test_episodes.py",
    "e2e/test_mesh_resume.py",
    "e2e/test_mesh_up.py",
    "vllm/test_vllm_families.py",
    "e2e/test_elastic_launcher.py",
    "integration/rollout/test_tp_engine.py",
    "e2e/test_sync_equivalence.py",
    "integration/rlmesh/test_cli_bad_input.py",
    "integration/trainer/test_model_families.py",
    "e2e/test_mesh_tls.py",
    "integration/manager/test_exactly_once.py",
    "integration/rollout/test_tp_rollout.py",
    "integration/trainer/test_fsdp_trainer.py",
    "integration/trainer/test_reference_worker.py",
    "e2e/test_critic_resume.py",
    "e2e/test_dynamic_sampling.py",
)
"""The files that take longest, longest first: the workers take files in this order as they run
out of work, so no long one is left to start last while the others idle."""
FIRST_DIRECTORIES = ("e2e", "vllm", "integration", "fuzz")
"""After those, whole directories, the slowest first."""


def _worker_base_ports(worker: int) -> range | None:
    """Worker `worker`'s mesh base ports: a mesh takes its base's first 26 ports and as many
    METRICS_PORT_OFFSET above, so worker k draws from the first thousand ports after
    20000 + 2000 k and its metrics ports land in the thousand after; none for a seventh worker on."""
    start = launch_ports.BASE_PORTS.start + 2 * METRICS_PORT_OFFSET * worker
    if start + 2 * METRICS_PORT_OFFSET > launch_ports.BASE_PORTS.stop + METRICS_PORT_OFFSET:
        return None
    return range(start, start + METRICS_PORT_OFFSET - max(launch_ports.MESH_PORT_OFFSETS))


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    ports = _worker_base_ports(int(worker.removeprefix("gw"))) if worker else None
    if ports is not None:
        launch_ports.BASE_PORTS = ports


def _run_order(item: pytest.Item) -> tuple[int, int]:
    path = Path(str(item.path))
    relative = path.relative_to(Path(__file__).parent).as_posix()
    if relative in SLOWEST_FILES:
        return 0, SLOWEST_FILES.index(relative)
    return 1, next((rank for rank, name in enumerate(FIRST_DIRECTORIES) if name in path.parts), len(FIRST_DIRECTORIES))


play_every_role()


@pytest.fixture(autouse=True)
def _plays_every_role():
    """Each test, and each fixture set up after it, calls with the suite's credentials, whatever a
    test or a mesh it started made the process present."""
    play_every_role()
    yield
    play_every_role()


E2E_TIMEOUT_SECONDS = 600
"""The hang guard of an e2e test: it shares two cores with the other workers' tests, and runs up
to three times as long as alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: every worker collects the same order, as pytest-xdist requires. xdist keeps it
    # only with --no-loadscope-reorder (pyproject.toml): by default it hands out the files with the
    # most tests first, which left the e2e files, one to four tests each, to the end.
    items.sort(key=_run_order)
    for item in items:
        if "e2e" in Path(str(item.path)).parts and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_SECONDS))


@dataclass(frozen=True, slots=True)
class WarmForkServer:
    socket: Path
    pid: int


@pytest.fixture(scope="session", autouse=True)
def warm_fork_server():
    """One warm fork server per test worker (`rlmesh fork-server`), from which each `rlmesh up` the
    worker's tests start forks its services (RLMESH_FORK_SERVER in the environment they inherit):
    each run would otherwise import torch, transformers and FSDP anew, some 8 CPU-seconds."""
    # A short path: a Unix socket's is at most 107 bytes.
    folder = Path(tempfile.mkdtemp(prefix="rlmesh-warm-"))
    socket = folder / "fork-server.sock"
    with (folder / "fork-server.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlmesh.cli.main", "fork-server", "--socket", str(socket)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            preexec_fn=die_with_parent,
        )
    # It listens before its imports, which a run connecting meanwhile waits for.
    wait_until(lambda: socket.exists() or process.poll() is not None, 60, "the warm fork server to listen")
    assert process.poll() is None, (folder / "fork-server.log").read_text()
    os.environ[WARM_FORK_SERVER_ENV] = str(socket)
    yield WarmForkServer(socket, process.pid)
    os.environ.pop(WARM_FORK_SERVER_ENV, None)
    process.terminate()
    process.wait(30)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's architecture with a short warm-up: enough for real forward passes. One
    folder for the run, in the folder the xdist workers' temporary folders share: the first worker
    to need it makes it, the others wait for it (some 4 CPU-seconds each)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return ensure_model(
        shared / "model",
        lambda folder: create_default_model(folder, TinyModelSpec(warmup_iterations=30)),
        "of the tests",
        announce=lambda line: None,
    )


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model (ASCII tokenizer, ChatML template) after a token warm-up: real forward
    passes through a chat template, shared by the xdist workers like `model_dir`."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return ensure_model(
        shared / "chat-model",
        lambda folder: create_chat_model(folder, ChatModelSpec(warmup_iterations=2, warmup_batch=2)),
        "of the tests",
        announce=lambda line: None,
    )


@pytest.fixture(scope="session")
def rank_runner(tmp_path_factory: pytest.TempPathFactory):
    """Runs worker modules on trainer ranks forked from one server per test worker
    (tests.support.processes.RankRunner)."""
    runner = RankRunner(tmp_path_factory.mktemp("ranks"))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def rank():
    """A one-rank process group, as the trainer forms without torchrun."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield RankInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), control=None)
    if owned:
        dist.destroy_process_group()
