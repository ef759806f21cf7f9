"""The vLLM rollout engine behind the real RolloutService: one rollout process running in the vLLM
virtualenv and one torch-engine instance in this process, on the same fp32 model and registered
with a real manager (a rollout instance does not serve without one), compared through gRPC."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import pytest_asyncio

from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from tests.support.credentials import loopback
from tests.support.processes import stop_process_group
from tests.support.vllm_rollout import (
    TORCH_ID,
    VLLM_MAX_BATCH,
    VLLM_PYTHON,
    PairedInstances,
    spawn_vllm_rollout,
    wait_registered,
)


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
        tmp_path_factory.mktemp("vllm-model"),
        TinyModelSpec(heads=4, kv_heads=2, max_positions=512, warmup_iterations=30),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instances(vllm_python: Path, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    manager = await start_manager(ManagerConfig(server=loopback(), lease_seconds=30, heartbeat_interval_seconds=2))
    log_path = tmp_path_factory.mktemp("vllm-rollout") / "rollout.log"
    process, port = spawn_vllm_rollout(vllm_python, vllm_model_dir, manager.server.address, log_path)
    torch_rollout = None
    channels = []
    try:
        torch_rollout = await start_rollout(
            RolloutConfig(
                server=loopback(),
                instance_id=TORCH_ID,
                manager_address=manager.server.address,
                engine=EngineConfig(kind="torch", model_dir=str(vllm_model_dir), max_batch_size=VLLM_MAX_BATCH, seed=1),
                transfer=TransferConfig(mooncake=False),
                register_timeout_seconds=10,
            )
        )
        await wait_registered(manager, process, log_path)
        channels = [open_channel(f"127.0.0.1:{port}"), open_channel(torch_rollout.server.address)]
        tokenizer = load_tokenizer(vllm_model_dir)
        yield PairedInstances(
            vllm=rollout_pb2_grpc.RolloutServiceStub(channels[0]),
            torch=rollout_pb2_grpc.RolloutServiceStub(channels[1]),
            model_dir=vllm_model_dir,
            eos=tokenizer.token_to_id(EOS_TOKEN),
            pad=tokenizer.token_to_id(PAD_TOKEN),
            log_path=log_path,
            process=process,
            manager_state=manager.state,
        )
    finally:
        for channel in channels:
            await channel.close()
        await asyncio.to_thread(stop_process_group, process)
        if torch_rollout is not None:
            await torch_rollout.stop()
        await manager.stop()
