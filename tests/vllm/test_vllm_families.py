"""A Llama model (Llama-3.2-1B's configuration scaled down, tied, random init) on the vLLM engine:
an FSDP trainer of two ranks publishes a version through a real weights service, which pushes it
to the vLLM rollout process (full tensors; vLLM cuts its own layout); the instance's greedy tokens
then equal HF `generate` on the trainer's weights and its logprobs a HF forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlmesh.models.random_init import scaled_config, write_random_model
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.model_families import (
    PUSHED_VERSION,
    Pushed,
    assert_served_as_hf,
    greedy_responses,
    published_tensors,
    trainer_rank_results,
)
from tests.support.processes import stop_process_group
from tests.support.samples import DIGIT_PROMPTS
from tests.support.vllm_rollout import VLLM_START_SECONDS, spawn_vllm_rollout, wait_registered

MAX_MODEL_LEN = 512
"""Far below Llama's 131,072 positions: vLLM would otherwise size its start-up runs for that."""


async def wait_served(address: str, version: int, timeout: float) -> None:
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while (await stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=5)).weight_version != version:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the vLLM instance does not serve version {version} after {timeout} s")
            await asyncio.sleep(0.2)
    finally:
        await channel.close()


async def push_to_vllm(rank_runner, python: Path, model_dir: Path, directory: Path) -> Pushed:
    mesh = await build_mesh(model_dir, "tcp", instances=0)
    log_path = directory / "vllm-rollout.log"
    process, port = spawn_vllm_rollout(python, model_dir, mesh.manager_address, log_path, max_model_len=MAX_MODEL_LEN)
    try:
        # The trainer starts while vLLM does; an instance that registers later still gets the latest version.
        spec = {
            "name": "llama",
            "model_dir": str(model_dir),
            "output_dir": str(directory / "trainer"),
            "weights_address": mesh.weights_address,
            "version": PUSHED_VERSION,
            "seed": 23,
        }
        trainer = asyncio.create_task(trainer_rank_results(rank_runner, [spec], directory, timeout=VLLM_START_SECONDS))
        await wait_registered(mesh.manager, process, log_path)
        ranks = [result["llama"] for result in await trainer]
        address = f"127.0.0.1:{port}"
        await wait_served(address, PUSHED_VERSION, timeout=60)
        tokenizer = load_tokenizer(model_dir)
        prompts = [tokenizer.encode(text).ids for text in DIGIT_PROMPTS]
        eos = tokenizer.token_to_id(EOS_TOKEN)
        responses = await greedy_responses(address, prompts, eos, timeout=60)
        return Pushed(model_dir, published_tensors(ranks), prompts, eos, responses, ranks[0]["publish"].rank_bytes, {})
    finally:
        await asyncio.to_thread(stop_process_group, process)
        await stop_mesh(mesh)


def test_a_llama_version_pushed_to_vllm_serves_hf_greedy_tokens_and_logprobs(rank_runner, vllm_python, tmp_path):
    model_dir = write_random_model(tmp_path / "llama", scaled_config("llama"), seed=13)
    pushed = asyncio.run(push_to_vllm(rank_runner, vllm_python, model_dir, tmp_path))
    assert_served_as_hf(pushed)
    assert any(len(set(tokens)) > 3 for tokens, _, _ in pushed.responses), "greedy decoding only repeated a few tokens"
