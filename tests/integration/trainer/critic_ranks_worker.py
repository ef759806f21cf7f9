"""Trainer ranks for tests/integration/trainer/test_critic_ranks.py (no tests here): under torchrun, each
rank builds the sharded policy with a critic (advantage_estimator gae) and two mini-batches per
step, trains two training steps, the last micro-batch one sample (a second rank has no share),
and records every micro-batch's figures and the critic's parameters after them.

    python -m tests.integration.trainer.critic_ranks_worker SPEC.json

SPEC: model_dir, output_dir, result (a file name with {rank})."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlmesh.logging import configure_logging
from services.trainer.config import TrainerConfig
from services.trainer.ranks.distributed import init_distributed, shutdown_distributed
from services.trainer.ranks.policy import ShardedPolicy
from tests.support.samples import rewarded_micro_batches
from tests.support.tensors import full_parameters


def run(spec: dict) -> None:
    rank = init_distributed("gloo", 120.0)
    config = TrainerConfig(
        model_dir=spec["model_dir"],
        output_dir=spec["output_dir"],
        prompts_per_step=2,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=2,
        learning_rate=1e-3,
        advantage_estimator="gae",
        critic_learning_rate=1e-3,
    )
    policy = ShardedPolicy(config, rank)
    batches = rewarded_micro_batches(Path(spec["model_dir"]), 4)
    batches[3] = batches[3][:1]
    stats = []
    for step, step_batches in enumerate((batches[:2], batches[2:])):
        policy.begin_step(step)
        for batch in step_batches:
            stats.append(policy.backward(batch))
            policy.optimizer_step()
    torch.save({"stats": stats, "critic": full_parameters(policy.critic.model)}, spec["result"].format(rank=rank.rank))
    shutdown_distributed()


if __name__ == "__main__":
    configure_logging("warning")
    torch.set_num_threads(1)
    run(json.loads(Path(sys.argv[1]).read_text()))
