"""The vLLM rollout process (run in the vLLM virtualenv), started and awaited until it registers,
and the pair of instances the vLLM tests compare: it and a torch-engine instance on one model."""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rlmesh.launch.ports import free_port
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2_grpc
from tests.support.credentials import suite_auth_env
from tests.support.paths import REPO_ROOT
from tests.support.processes import log_tail

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_START_SECONDS = 150
"""Importing vLLM and starting its engine core takes 30-40 s on two cores; more when busy."""
VLLM_ID = "vllm-0"
TORCH_ID = "torch-0"
VLLM_MAX_BATCH = 16


@dataclass
class PairedInstances:
    """Both instances and what they serve; tests that push a version update `version` and
    `tensors` (None: the model folder's weights)."""

    vllm: rollout_pb2_grpc.RolloutServiceStub
    torch: rollout_pb2_grpc.RolloutServiceStub
    model_dir: Path
    eos: int
    pad: int
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    """The vLLM rollout process."""
    manager_state: object = field(repr=False)
    """The manager's ManagerState, which both instances registered with."""
    version: int = 0
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return load_tokenizer(self.model_dir).encode(text).ids


def spawn_vllm_rollout(
    python: Path, model_dir: Path, manager_address: str, log_path: Path, max_model_len: int = 0
) -> tuple[subprocess.Popen, int]:
    """The vLLM rollout process and its port; `max_model_len` 0: the model's own limit."""
    port = free_port()
    config = log_path.with_suffix(".toml")
    config.write_text(
        f'instance_id = "{VLLM_ID}"\n'
        f'manager_address = "{manager_address}"\n'
        f"register_timeout_seconds = {VLLM_START_SECONDS}\n"
        f"drain_timeout_seconds = 5\n"
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ngrace_seconds = 0.5\n'
        f'[engine]\nkind = "vllm"\nmodel_dir = "{model_dir}"\nmax_batch_size = {VLLM_MAX_BATCH}\nseed = 1\n'
        f"[engine.vllm]\nmax_model_len = {max_model_len}\n"
        f"[transfer]\nmooncake = false\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **suite_auth_env("RLMESH_ROLLOUT_", "instance"),
    }
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [str(python), "-m", "services.rollout", "--config", str(config)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Its own group: vLLM's engine core is a child of the rollout process.
            start_new_session=True,
        )
    return process, port


async def wait_registered(manager, process: subprocess.Popen, log_path: Path) -> None:
    deadline = asyncio.get_running_loop().time() + VLLM_START_SECONDS
    while VLLM_ID not in manager.state.instances:
        if process.poll() is not None:
            pytest.fail(
                f"the vLLM rollout process exited with code {process.returncode} while starting; "
                f"its log ({log_path}) ends:\n{log_tail(log_path)}",
                pytrace=False,
            )
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(
                f"the vLLM rollout process did not register within {VLLM_START_SECONDS}s; "
                f"its log ({log_path}) ends:\n{log_tail(log_path)}",
                pytrace=False,
            )
        await asyncio.sleep(0.2)
