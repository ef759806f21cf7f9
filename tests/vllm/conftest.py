"""The vLLM rollout engine behind the real RolloutService: one rollout process running in the vLLM
virtualenv and one torch-engine instance in this process, on the same fp32 model and registered
with a real manager (a rollout instance does not serve without one), compared through gRPC."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rlmesh.config import ServerConfig
from rlmesh.launch.ports import free_port
from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2_grpc
from rlmesh.rpc import open_channel
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_START_SECONDS = 150
"""Importing vLLM and starting its engine core takes 30-40 s on two cores; more when busy."""
VLLM_ID = "vllm-0"
TORCH_ID = "torch-0"
MAX_BATCH = 16


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(
            f"{VLLM_PYTHON} is missing: the vLLM rollout tests run the rollout service in the vLLM "
            "virtualenv; create it with `make setup-vllm` (or run them with `make test-vllm`)",
            pytrace=False,
        )
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's shape, except: vLLM's CPU attention takes head sizes 32, 64, ... only
    (the default has 16), and 512 positions leave room for requests long enough to pause or abort
    mid-stream and for prompts longer than one 128-token KV block (prefix caching)."""
    return create_default_model(
        tmp_path_factory.mktemp("vllm-model"), TinyModelSpec(heads=4, kv_heads=2, max_positions=512, warmup_iterations=30)
    )


def loopback() -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5)


@dataclass
class Instances:
    """Both instances and what they serve; tests that push a version update `version` and
    `tensors` (None: the model folder's weights)."""

    vllm: rollout_pb2_grpc.RolloutServiceStub
    torch: rollout_pb2_grpc.RolloutServiceStub
    model_dir: Path
    eos: int
    pad: int
    log_path: Path
    version: int = 0
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return load_tokenizer(self.model_dir).encode(text).ids


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _spawn_vllm_rollout(python: Path, model_dir: Path, manager_address: str, log_path: Path,
                        max_model_len: int = 0) -> tuple[subprocess.Popen, int]:
    """`max_model_len` 0: the model's own limit."""
    port = free_port()
    config = log_path.with_suffix(".toml")
    config.write_text(
        f'instance_id = "{VLLM_ID}"\n'
        f'manager_address = "{manager_address}"\n'
        f"register_timeout_seconds = {VLLM_START_SECONDS}\n"
        f"drain_timeout_seconds = 5\n"
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ngrace_seconds = 0.5\n'
        f'[engine]\nkind = "vllm"\nmodel_dir = "{model_dir}"\nmax_batch_size = {MAX_BATCH}\nseed = 1\n'
        f"[engine.vllm]\nmax_model_len = {max_model_len}\n"
        f"[transfer]\nmooncake = false\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [str(python), "-m", "services.rollout", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Its own group: vLLM's engine core is a child of the rollout process.
            start_new_session=True,
        )
    return process, port


def _stop_process(process: subprocess.Popen) -> None:
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


async def _wait_registered(manager, process: subprocess.Popen, log_path: Path) -> None:
    deadline = asyncio.get_running_loop().time() + VLLM_START_SECONDS
    while VLLM_ID not in manager.state.instances:
        if process.poll() is not None:
            pytest.fail(f"the vLLM rollout process exited with code {process.returncode} while starting; "
                        f"its log ({log_path}) ends:\n{_tail(log_path)}", pytrace=False)
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"the vLLM rollout process did not register within {VLLM_START_SECONDS}s; "
                        f"its log ({log_path}) ends:\n{_tail(log_path)}", pytrace=False)
        await asyncio.sleep(0.2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instances(vllm_python: Path, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    manager = await start_manager(ManagerConfig(server=loopback(), lease_seconds=30, heartbeat_interval_seconds=2))
    log_path = tmp_path_factory.mktemp("vllm-rollout") / "rollout.log"
    process, port = _spawn_vllm_rollout(vllm_python, vllm_model_dir, manager.server.address, log_path)
    torch_rollout = None
    channels = []
    try:
        torch_rollout = await start_rollout(RolloutConfig(
            server=loopback(),
            instance_id=TORCH_ID,
            manager_address=manager.server.address,
            engine=EngineConfig(kind="torch", model_dir=str(vllm_model_dir), max_batch_size=MAX_BATCH, seed=1),
            transfer=TransferConfig(mooncake=False),
            register_timeout_seconds=10,
        ))
        await _wait_registered(manager, process, log_path)
        channels = [open_channel(f"127.0.0.1:{port}"), open_channel(torch_rollout.server.address)]
        tokenizer = load_tokenizer(vllm_model_dir)
        yield Instances(
            vllm=rollout_pb2_grpc.RolloutServiceStub(channels[0]),
            torch=rollout_pb2_grpc.RolloutServiceStub(channels[1]),
            model_dir=vllm_model_dir,
            eos=tokenizer.token_to_id(EOS_TOKEN),
            pad=tokenizer.token_to_id(PAD_TOKEN),
            log_path=log_path,
        )
    finally:
        for channel in channels:
            await channel.close()
        await asyncio.to_thread(_stop_process, process)
        if torch_rollout is not None:
            await torch_rollout.stop()
        await manager.stop()
