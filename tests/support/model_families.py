"""A version of each model family pushed from trainer ranks to an instance, and checked against HF:
the ranks' results, the tensors they published, the instance's greedy responses through its API."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.models.loading import copy_into, load_causal_lm
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.channels import open_channel
from tests.support.processes import RankRunner
from tests.support.tp_instances import TP

FAMILY_TRAINER_WORKER = "tests.integration.trainer.model_families_worker"
PUSHED_VERSION = 1
GREEDY_MAX_TOKENS = 16
HF_LOGPROB_ATOL = 1e-4


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


async def trainer_rank_results(
    rank_runner: RankRunner, models: list[dict], directory: Path, timeout: float
) -> list[dict]:
    """Each trainer rank's results, in rank order, from TP ranks of FAMILY_TRAINER_WORKER publishing a
    version of each of `models` (specs as the worker reads them)."""
    spec_path, result = directory / "trainer-spec.json", directory / "trainer-rank{rank}.pt"
    spec_path.write_text(json.dumps({"models": models, "result": str(result)}))
    await asyncio.to_thread(rank_runner.run, FAMILY_TRAINER_WORKER, [str(spec_path)], TP, directory, timeout)
    return [torch.load(str(result).format(rank=rank), weights_only=False) for rank in range(TP)]


def published_tensors(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The published parameters, put together from every rank's rows."""
    return {name: torch.cat([rank["shards"][name] for rank in ranks]) for name in ranks[0]["shards"]}


async def greedy_responses(
    address: str, prompts: list[list[int]], eos: int, timeout: float
) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, weight versions) of each prompt decoded greedily through a rollout instance's gRPC API."""
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    async def one(index: int, prompt: list[int]):
        tokens, logprobs, versions = [], [], []
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=GREEDY_MAX_TOKENS, stop_token_ids=[eos])
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


def assert_served_as_hf(pushed: Pushed) -> None:
    model = load_causal_lm(pushed.model_dir)
    # The trainer's version is not the folder's: only the push can make the instance agree with it.
    assert all(not torch.equal(p, pushed.params[n]) for n, p in model.named_parameters())
    copy_into(model, pushed.params)
    for prompt, (tokens, logprobs, versions) in zip(pushed.prompts, pushed.responses, strict=True):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=GREEDY_MAX_TOKENS,
                do_sample=False,
                eos_token_id=pushed.eos,
                pad_token_id=pushed.eos,
            )[0, len(prompt) :].tolist()
            assert tokens == want
            assert versions == [PUSHED_VERSION] * len(tokens)
            reference = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        expected = reference.gather(1, torch.tensor(tokens)[:, None]).flatten()
        assert torch.allclose(torch.tensor(logprobs), expected, atol=HF_LOGPROB_ATOL), (
            f"largest difference {(torch.tensor(logprobs) - expected).abs().max():.2e}"
        )
