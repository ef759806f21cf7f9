"""A trainer rank without the mesh, for tests/integration/trainer/test_fsdp_trainer.py (no tests here):
run under torchrun (N ranks) or alone (one rank), it builds the ranks exactly as the service does
and drives them through rank 0's commands, then writes what the test compares.

    python -m tests.integration.trainer.fsdp_trainer_worker SPEC.json

SPEC: model_dir, output_dir, weights_address, handoff, samples (a torch.save file of micro-batches
of TrainingSample), scenario ("train" or "resume"), versions (to publish), result (a file)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from rlmesh.logging import configure_logging
from rlmesh.tasks.increment import held_out_problems
from services.trainer.config import TrainerConfig
from services.trainer.main import _build
from services.trainer.ranks.checkpoint import TrainerState, latest_checkpoint
from services.trainer.ranks.commands import Checkpoint, Evaluate, OptimizerStep, Publish, Resume, Stop, Train
from services.trainer.ranks.distributed import TorchThread, init_distributed, shutdown_distributed
from services.trainer.ranks.evaluation import EvalRequest
from tests.support.credentials import play_every_role


def config_for(spec: dict) -> TrainerConfig:
    return TrainerConfig(
        model_dir=spec["model_dir"],
        output_dir=spec["output_dir"],
        weights_address=spec["weights_address"],
        handoff=spec["handoff"],
        prompts_per_step=2,
        group_size=8,
        micro_batch_groups=1,
        seed=3,
    )


def full_state(policy) -> dict:
    """Every parameter and optimizer tensor gathered whole (test only; a collective)."""
    optimizer = get_optimizer_state_dict(policy.model, policy.optimizer, options=StateDictOptions(full_state_dict=True))
    params = policy.full_parameters()
    optim = {
        name: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
        for name, state in optimizer["state"].items()
    }
    return {"params": params, "optimizer": optim}


async def run(spec: dict) -> None:
    config = config_for(spec)
    rank = await asyncio.to_thread(init_distributed, "gloo", 120.0)
    thread = TorchThread()
    group, channel = await _build(config, rank, thread)
    result: dict = {"world_size": rank.world_size}
    try:
        if rank.is_leader:
            if spec["scenario"] == "train":
                result["publish"] = [await group.lead(Publish(spec["versions"][0]))]
                micro_batches = torch.load(spec["samples"], weights_only=False)
                result["stats"] = [await group.lead(Train(samples)) for samples in micro_batches]
                result["grad_norm"] = await group.lead(OptimizerStep())
                result["publish"].append(await group.lead(Publish(spec["versions"][1])))
                prompts = [group.policy.tokenizer.encode(p.prompt) for p in held_out_problems(4)]
                result["eval"] = await group.lead(
                    Evaluate(EvalRequest(prompts, max_tokens=12, samples=1, temperature=1.0, top_p=1.0, seed=4))
                )
                result["checkpoint"] = str(
                    await group.lead(
                        Checkpoint(TrainerState(1, spec["versions"][1], {"increment": 32}), export_hf=True)
                    )
                )
            else:
                checkpoint = latest_checkpoint(Path(config.output_dir) / "checkpoints")
                result["state"] = await group.lead(Resume(str(checkpoint)))
                result["publish"] = [await group.lead(Publish(v)) for v in spec["versions"]]
            result["slots"] = [str(s.path) for s in group.handoff._slots]
            await group.lead(Stop())
        else:
            await group.follow()
        # After the protocol: every rank gathers the whole state for the test to compare.
        state = await thread.run(full_state, group.policy)
        if rank.is_leader:
            result.update(state)
            result["pid"] = os.getpid()
            torch.save(result, spec["result"])
    finally:
        group.handoff.close()
        await channel.close()
        thread.close()
    shutdown_distributed()


if __name__ == "__main__":
    configure_logging("warning")
    play_every_role()
    torch.set_num_threads(1)
    asyncio.run(run(json.loads(Path(sys.argv[1]).read_text())))
