"""Trainer ranks for tests/integration/trainer/test_model_families.py and tests/vllm/test_vllm_families.py
(no tests here), started by tests.support.model_families.trainer_rank_results: under torchrun, for
each model of the spec in turn, the ranks are built as the service builds them, every rank moves
its own shards away from the folder's weights (so a served version can only come from this push),
publishes a version to the model's weights service, and writes the rows it published (no rank
ever gathers a full tensor, which at 0.5 B parameters would cost 2 GB per rank).

    python -m tests.integration.trainer.model_families_worker SPEC.json

SPEC: models (each: name, model_dir, output_dir, weights_address, version, seed), result (a file
name with {rank})."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rlmesh.logging import configure_logging
from services.trainer.config import TrainerConfig
from services.trainer.main import _build
from services.trainer.ranks.commands import Publish, Stop
from services.trainer.ranks.distributed import RankInfo, TorchThread, init_distributed, shutdown_distributed
from tests.support.credentials import play_every_role


@torch.no_grad()
def perturb(policy, seed: int) -> None:
    """Scales this rank's rows of every parameter by 1 + 5 % noise, in place (the rows it hands over)."""
    generator = torch.Generator().manual_seed(seed)
    for param in policy.model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        local.mul_(1 + 0.05 * torch.randn(local.shape, generator=generator))


async def publish(model: dict, rank: RankInfo, thread: TorchThread) -> dict:
    config = TrainerConfig(
        model_dir=model["model_dir"], output_dir=model["output_dir"], weights_address=model["weights_address"], seed=3
    )
    group, channel = await _build(config, rank, thread)
    result: dict = {}
    try:
        await thread.run(perturb, group.policy, model["seed"] + 1000 * rank.rank)
        if rank.is_leader:
            result["publish"] = await group.lead(Publish(model["version"]))
            await group.lead(Stop())
        else:
            await group.follow()
        result["shards"] = {name: shard.tensor for name, shard in group.policy.local_shards().items()}
    finally:
        group.handoff.close()
        await channel.close()
    return result


async def run(spec: dict) -> None:
    rank = await asyncio.to_thread(init_distributed, "gloo", 120.0)
    thread = TorchThread()
    results = {}
    try:
        for model in spec["models"]:
            results[model["name"]] = await publish(model, rank, thread)
        torch.save(results, spec["result"].format(rank=rank.rank))
    finally:
        thread.close()
    shutdown_distributed()


if __name__ == "__main__":
    configure_logging("warning")
    play_every_role()
    torch.set_num_threads(1)
    asyncio.run(run(json.loads(Path(sys.argv[1]).read_text())))
