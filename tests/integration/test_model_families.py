"""Every supported family end to end: an FSDP trainer of two ranks (torchrun) hands its shards of a
new version to a real weights service, which reshards them and pushes each rank of a real
two-rank torch-engine instance, registered at a real manager, its own bytes; the instance's greedy
tokens then equal HF `generate` on the trainer's weights and its logprobs a HF forward. Random-init
models from each family's real configuration: scaled down (Llama untied, Qwen3 tied) in `make
test`, and Qwen2.5-0.5B at its real shape in `make test-large`. A rollout process given a folder of
another architecture stops at start, naming the supported ones."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from rlmesh.common.v1 import common_pb2
from rlmesh.launcher import free_port, torchrun_args
from rlmesh.models.loading import copy_into, load_causal_lm
from rlmesh.models.random_init import real_config, scaled_config, write_random_model
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc import open_channel
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from tests.support import build_mesh, loopback, stop_mesh, wait_for

WORKER = "tests.integration.test_model_families_worker"
TP = 2
VERSION = 1
TEXTS = ["1234=", "98765432=", "50=", "7="]
MAX_TOKENS = 16
ATOL = 1e-4
FAMILIES = {"llama": {"tie_word_embeddings": False}, "qwen3": {"tie_word_embeddings": True}}


@dataclass
class Pushed:
    """What one model's instance served after the push, and the weights the trainer published."""

    model_dir: Path
    params: dict[str, torch.Tensor]
    prompts: list[list[int]]
    eos: int
    responses: list[tuple[list[int], list[float], list[int]]]
    """(tokens, logprobs, versions) per prompt, greedy, through the instance's gRPC API."""
    rank_bytes: list[int]
    seconds: dict[str, float]


async def run_trainer(models: list[dict], directory: Path, timeout: float) -> list[dict]:
    """Each trainer rank's results, in rank order."""
    spec_path, result = directory / "trainer-spec.json", directory / "trainer-rank{rank}.pt"
    spec_path.write_text(json.dumps({"models": models, "result": str(result)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = await asyncio.create_subprocess_exec(sys.executable, *torchrun_args(TP, free_port()), "-m", WORKER, str(spec_path),
                                                   env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode == 0, output.decode()[-6000:]
    return [torch.load(str(result).format(rank=rank), weights_only=False) for rank in range(TP)]


def full_tensors(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The published parameters, put together from every rank's rows."""
    return {name: torch.cat([rank["shards"][name] for rank in ranks]) for name in ranks[0]["shards"]}


async def greedy(address: str, prompts: list[list[int]], eos: int, timeout: float) -> list[tuple[list[int], list[float], list[int]]]:
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    async def one(index: int, prompt: list[int]):
        tokens, logprobs, versions = [], [], []
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[eos])
        request = rollout_pb2.GenerateRequest(request_id=f"greedy-{index}", prompt_token_ids=prompt, sampling=sampling)
        async for reply in stub.Generate(request, timeout=timeout):
            tokens += reply.chunk.token_ids
            logprobs += reply.chunk.logprobs
            versions += reply.chunk.weight_versions
        return tokens, logprobs, versions

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await channel.close()


async def push_and_generate(models: dict[str, Path], directory: Path, timeout: float) -> dict[str, Pushed]:
    """One mesh (manager, weights service, a TP-2 instance) per model, one trainer for all of them."""
    meshes, rollouts, seconds = {}, {}, {}
    try:
        for name, model_dir in models.items():
            started = time.monotonic()
            meshes[name] = await build_mesh(model_dir, "tcp", instances=0)
            rollouts[name] = await start_rollout(RolloutConfig(
                server=loopback(), instance_id=f"{name}-tp", manager_address=meshes[name].manager_address,
                engine=EngineConfig(model_dir=str(model_dir), max_batch_size=8, tensor_parallel_size=TP),
                transfer=TransferConfig(mooncake=False, tcp=True), register_timeout_seconds=timeout,
            ))
            seconds[f"{name} instance start"] = time.monotonic() - started
        specs = [{"name": name, "model_dir": str(model_dir), "output_dir": str(directory / f"trainer-{name}"),
                  "weights_address": meshes[name].weights_address, "version": VERSION, "seed": 17} for name, model_dir in models.items()]
        started = time.monotonic()
        published = await run_trainer(specs, directory, timeout)
        seconds["trainer (start, publish)"] = time.monotonic() - started
        out = {}
        for name, model_dir in models.items():
            await wait_for(lambda engine=rollouts[name].engine: engine.weight_version == VERSION, timeout=timeout)
            push = meshes[name].weights.pusher.instances[f"{name}-tp"]
            seconds[f"{name} push"] = push.last_push_ms / 1000
            seconds[f"{name} version stored to served"] = push.last_version_latency_ms / 1000
            tokenizer = load_tokenizer(model_dir)
            prompts = [tokenizer.encode(text).ids for text in TEXTS]
            eos = tokenizer.token_to_id(EOS_TOKEN)
            started = time.monotonic()
            responses = await greedy(rollouts[name].server.address, prompts, eos, timeout)
            seconds[f"{name} generate"] = time.monotonic() - started
            ranks = [result[name] for result in published]
            out[name] = Pushed(model_dir, full_tensors(ranks), prompts, eos, responses, ranks[0]["publish"].rank_bytes, seconds)
        return out
    finally:
        for rollout in rollouts.values():
            await rollout.stop()
        for mesh in meshes.values():
            await stop_mesh(mesh)


def assert_served_as_hf(pushed: Pushed) -> None:
    model = load_causal_lm(pushed.model_dir)
    # The trainer's version is not the folder's: only the push can make the instance agree with it.
    assert all(not torch.equal(p, pushed.params[n]) for n, p in model.named_parameters())
    copy_into(model, pushed.params)
    for prompt, (tokens, logprobs, versions) in zip(pushed.prompts, pushed.responses, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=pushed.eos,
                                  pad_token_id=pushed.eos)[0, len(prompt):].tolist()
            assert tokens == want
            assert versions == [VERSION] * len(tokens)
            reference = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        expected = reference.gather(1, torch.tensor(tokens)[:, None]).flatten()
        assert torch.allclose(torch.tensor(logprobs), expected, atol=ATOL), f"largest difference {(torch.tensor(logprobs) - expected).abs().max():.2e}"


@pytest.fixture(scope="module")
def pushed_small(tmp_path_factory) -> dict[str, Pushed]:
    directory = tmp_path_factory.mktemp("families")
    models = {name: write_random_model(directory / name, scaled_config(name, **settings), seed=11) for name, settings in FAMILIES.items()}
    return asyncio.run(push_and_generate(models, directory, timeout=120))


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
def test_qwen25_half_billion_at_its_real_shape(tmp_path):
    """Qwen2.5-0.5B's shape (494 M parameters, tied, fp32, random init): one push, one generate."""
    started = time.monotonic()
    try:
        model_dir = write_random_model(tmp_path / "qwen2.5-0.5b", real_config("qwen2"), seed=5)
        written = time.monotonic() - started
        pushed = asyncio.run(push_and_generate({"qwen2.5-0.5b": model_dir}, tmp_path, timeout=600))["qwen2.5-0.5b"]
        assert sum(p.numel() for p in pushed.params.values()) == 494_032_768
        assert_served_as_hf(pushed)
    finally:
        # 4 GB of model and trainer files; pytest keeps the last runs' temporary folders.
        shutil.rmtree(tmp_path, ignore_errors=True)
    print(f"\nQwen2.5-0.5B shape: model folder written in {written:.1f} s; "
          + "; ".join(f"{what} {value:.1f} s" for what, value in pushed.seconds.items()))


def test_a_rollout_process_refuses_another_architecture_at_start(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)
    env = {**os.environ, "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(tmp_path), "RLMESH_ROLLOUT_SERVER__PORT": "0",
           "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false"}
    done = subprocess.run([sys.executable, "-m", "services.rollout"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"rlmesh rollout: model folder {tmp_path}: architecture 'GPT2LMHeadModel' (model_type 'gpt2') is not supported; "
            "supported: qwen2 (Qwen2ForCausalLM), llama (LlamaForCausalLM), qwen3 (Qwen3ForCausalLM)") in done.stderr
