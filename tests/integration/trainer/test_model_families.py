"""Every supported family end to end: an FSDP trainer of two ranks (torchrun) hands its shards of a
new version to a real weights service, which reshards them and pushes each rank of a real
two-rank torch-engine instance, registered at a real manager, its own bytes; the instance's greedy
tokens then equal HF `generate` on the trainer's weights and its logprobs a HF forward. Random-init
models from each family's real configuration: scaled down (Llama untied, Qwen3 tied) in `make
test`, and Qwen2.5-0.5B at its real shape in `make test-large`. A rollout process given a folder of
another architecture stops at start, naming the supported ones."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import GPT2Config

from rlmesh.models.random_init import real_config, scaled_config, write_random_model
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from tests.support.credentials import loopback
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.model_families import (
    PUSHED_VERSION,
    Pushed,
    assert_served_as_hf,
    greedy_responses,
    published_tensors,
    trainer_rank_results,
)
from tests.support.samples import DIGIT_PROMPTS
from tests.support.tp_instances import TP
from tests.support.waiting import wait_for

FAMILIES = {"llama": {"tie_word_embeddings": False}, "qwen3": {"tie_word_embeddings": True}}


async def push_and_generate(rank_runner, models: dict[str, Path], directory: Path, timeout: float) -> dict[str, Pushed]:
    """One mesh (manager, weights service, a TP-2 instance) per model, one trainer for all of them."""
    meshes, rollouts, seconds = {}, {}, {}
    try:
        for name, model_dir in models.items():
            started = time.monotonic()
            meshes[name] = await build_mesh(model_dir, "tcp", instances=0)
            rollouts[name] = await start_rollout(
                RolloutConfig(
                    server=loopback(),
                    instance_id=f"{name}-tp",
                    manager_address=meshes[name].manager_address,
                    engine=EngineConfig(model_dir=str(model_dir), max_batch_size=8, tensor_parallel_size=TP),
                    transfer=TransferConfig(mooncake=False, tcp=True),
                    register_timeout_seconds=timeout,
                )
            )
            seconds[f"{name} instance start"] = time.monotonic() - started
        specs = [
            {
                "name": name,
                "model_dir": str(model_dir),
                "output_dir": str(directory / f"trainer-{name}"),
                "weights_address": meshes[name].weights_address,
                "version": PUSHED_VERSION,
                "seed": 17,
            }
            for name, model_dir in models.items()
        ]
        started = time.monotonic()
        published = await trainer_rank_results(rank_runner, specs, directory, timeout)
        seconds["trainer (start, publish)"] = time.monotonic() - started
        out = {}
        for name, model_dir in models.items():
            await wait_for(
                lambda engine=rollouts[name].engine: engine.weight_version == PUSHED_VERSION, timeout=timeout
            )
            push = meshes[name].weights.pusher.instances[f"{name}-tp"]
            seconds[f"{name} push"] = push.last_push_ms / 1000
            seconds[f"{name} version stored to served"] = push.last_version_latency_ms / 1000
            tokenizer = load_tokenizer(model_dir)
            prompts = [tokenizer.encode(text).ids for text in DIGIT_PROMPTS]
            eos = tokenizer.token_to_id(EOS_TOKEN)
            started = time.monotonic()
            responses = await greedy_responses(rollouts[name].server.address, prompts, eos, timeout)
            seconds[f"{name} generate"] = time.monotonic() - started
            ranks = [result[name] for result in published]
            out[name] = Pushed(
                model_dir, published_tensors(ranks), prompts, eos, responses, ranks[0]["publish"].rank_bytes, seconds
            )
        return out
    finally:
        for rollout in rollouts.values():
            await rollout.stop()
        for mesh in meshes.values():
            await stop_mesh(mesh)


@pytest.fixture(scope="module")
def pushed_small(rank_runner, tmp_path_factory) -> dict[str, Pushed]:
    directory = tmp_path_factory.mktemp("families")
    models = {
        name: write_random_model(directory / name, scaled_config(name, **settings), seed=11)
        for name, settings in FAMILIES.items()
    }
    return asyncio.run(push_and_generate(rank_runner, models, directory, timeout=120))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_pushed_version_serves_hf_greedy_tokens_and_logprobs(pushed_small, family):
    pushed = pushed_small[family]
    assert_served_as_hf(pushed)
    assert any(len(set(tokens)) > 3 for tokens, _, _ in pushed.responses), "greedy decoding only repeated a few tokens"
    # Each trainer rank handed over about half of the model, never all of it.
    model_bytes = sum(p.numel() * p.element_size() for p in pushed.params.values())
    assert len(pushed.rank_bytes) == TP and all(b < 0.6 * model_bytes for b in pushed.rank_bytes)


@pytest.mark.large
@pytest.mark.timeout(900)
def test_qwen25_half_billion_at_its_real_shape(rank_runner, tmp_path):
    """Qwen2.5-0.5B's shape (494 M parameters, tied, fp32, random init): one push, one generate."""
    started = time.monotonic()
    try:
        model_dir = write_random_model(tmp_path / "qwen2.5-0.5b", real_config("qwen2"), seed=5)
        written = time.monotonic() - started
        pushed = asyncio.run(push_and_generate(rank_runner, {"qwen2.5-0.5b": model_dir}, tmp_path, timeout=600))[
            "qwen2.5-0.5b"
        ]
        assert sum(p.numel() for p in pushed.params.values()) == 494_032_768
        assert_served_as_hf(pushed)
    finally:
        # 4 GB of model and trainer files; pytest keeps the last runs' temporary folders.
        shutil.rmtree(tmp_path, ignore_errors=True)
    print(
        f"\nQwen2.5-0.5B shape: model folder written in {written:.1f} s; "
        + "; ".join(f"{what} {value:.1f} s" for what, value in pushed.seconds.items())
    )


def test_a_rollout_process_refuses_another_architecture_at_start(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(
        tmp_path
    )
    env = {
        **os.environ,
        "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(tmp_path),
        "RLMESH_ROLLOUT_SERVER__PORT": "0",
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.rollout"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"rlmesh rollout: model folder {tmp_path}: architecture 'GPT2LMHeadModel' (model_type 'gpt2') "
        "is not supported; supported: qwen2 (Qwen2ForCausalLM), llama (LlamaForCausalLM), qwen3 (Qwen3ForCausalLM)"
    ) in done.stderr
