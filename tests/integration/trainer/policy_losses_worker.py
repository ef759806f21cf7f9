"""Trainer ranks for tests/integration/trainer/test_policy_losses.py (no tests here): under torchrun, each
rank builds the sharded policy with the `tis` loss and two mini-batches per step, trains two
training steps with a held-out evaluation between them, and records the proximal log-probabilities
its share of every micro-batch was scored with, and the step-start parameters of step 2. With
`refuse` in the spec, a micro-batch with a NaN in one rank's share instead: what each rank raised.

    python -m tests.integration.trainer.policy_losses_worker SPEC.json

SPEC: model_dir, output_dir, result (a file name with {rank}), refuse (optional)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import services.trainer.ranks.policy as policy_module
from rlmesh.logging import configure_logging
from services.trainer.config import TrainerConfig
from services.trainer.ranks.distributed import init_distributed, shutdown_distributed
from services.trainer.ranks.evaluation import EvalRequest
from services.trainer.ranks.optimizing import NonFiniteUpdate
from services.trainer.ranks.policy import ShardedPolicy
from tests.support.samples import micro_batches


def run(spec: dict) -> None:
    rank = init_distributed("gloo", 120.0)
    config = TrainerConfig(
        model_dir=spec["model_dir"],
        output_dir=spec["output_dir"],
        prompts_per_step=2,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=2,
        learning_rate=1e-2,
        loss="tis",
    )
    policy = ShardedPolicy(config, rank)
    proximal_seen = []
    real_loss = policy_module.policy_loss

    def recording_loss(logprobs, *args, **kwargs):
        proximal = kwargs["proximal_logprobs"]
        proximal_seen.append(None if proximal is None else proximal.clone())
        return real_loss(logprobs, *args, **kwargs)

    policy_module.policy_loss = recording_loss
    batches = micro_batches(Path(spec["model_dir"]), 5)
    # The last micro-batch has one sample: rank 1 has no share and runs the forwards idle.
    batches[4] = batches[4][:1]
    result: dict = {"stats": []}
    policy.begin_step()
    for batch in batches[:2]:
        result["stats"].append(policy.backward(batch))
        policy.optimizer_step()
    # A held-out evaluation between steps, as the service runs: forwards without backward.
    policy.evaluate(
        EvalRequest([batches[0][0].prompt_ids], max_tokens=4, samples=1, temperature=1.0, top_p=1.0, seed=1)
    )
    policy.begin_step()
    result["step_start"] = policy.full_parameters()
    result["stats"].append(policy.backward(batches[2]))
    policy.optimizer_step()
    result["stats"].append(policy.backward(batches[3]))
    policy.optimizer_step()
    result["stats"].append(policy.backward(batches[4]))
    result["after"] = policy.full_parameters()
    result["proximal"] = proximal_seen
    torch.save(result, spec["result"].format(rank=rank.rank))
    shutdown_distributed()


def refuse(spec: dict) -> None:
    """Sample 1 (rank 1's share) has a NaN advantage: every rank refuses the step alike, naming it,
    its weights unchanged, and the ranks stay in step for the next micro-batch."""
    rank = init_distributed("gloo", 120.0)
    config = TrainerConfig(
        model_dir=spec["model_dir"],
        output_dir=spec["output_dir"],
        prompts_per_step=1,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=1,
        learning_rate=1e-2,
    )
    policy = ShardedPolicy(config, rank)
    poisoned, clean = micro_batches(Path(spec["model_dir"]), 2)
    for index, sample in enumerate(poisoned):
        sample.sample_id = f"b/p0/{index}"
    poisoned[1].advantage = float("nan")
    policy.begin_step(7)
    before = policy.full_parameters()
    result: dict = {}
    try:
        policy.backward(poisoned)
    except NonFiniteUpdate as exc:
        result["refused"] = str(exc)
    result["unchanged"] = all(torch.equal(before[name], tensor) for name, tensor in policy.full_parameters().items())
    policy.backward(clean)
    result["norm"] = policy.optimizer_step()
    torch.save(result, spec["result"].format(rank=rank.rank))
    shutdown_distributed()


if __name__ == "__main__":
    configure_logging("warning")
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("refuse"):
        refuse(spec)
    else:
        run(spec)
