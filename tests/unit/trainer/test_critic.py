"""PPO with a critic on one rank in this process: the value model trains beside the policy
(forward and backward per micro-batch, optimizer step per mini-batch), its figures reach the
step's metrics, the policy waits for the critic's warm-up, and a checkpoint restores the value
model and its optimizer bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.ranks.checkpoint import BackgroundCheckpoints, TrainerState, latest_checkpoint
from services.trainer.ranks.policy import ShardedPolicy
from services.trainer.step_totals import StepTotals
from tests.support.samples import rewarded_micro_batches
from tests.support.tensors import full_parameters


def critic_policy(model_dir, tmp_path, rank, **algorithm) -> ShardedPolicy:
    config = TrainerConfig(
        model_dir=str(model_dir),
        output_dir=str(tmp_path),
        prompts_per_step=2,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=2,
        learning_rate=1e-2,
        advantage_estimator="gae",
        critic_learning_rate=1e-2,
        **algorithm,
    )
    return ShardedPolicy(config, rank)


def test_the_critic_trains_beside_the_policy_and_reports_its_figures(model_dir, tmp_path, rank):
    policy = critic_policy(model_dir, tmp_path, rank)
    batches = rewarded_micro_batches(model_dir, 2)
    critic_before, policy_before = full_parameters(policy.critic.model), full_parameters(policy.model)
    policy.begin_step(0)
    totals = StepTotals()
    for batch in batches:
        totals.add_micro_batch(policy.backward(batch))
        policy.optimizer_step()
        totals.end_mini_batch()
    totals.grad_norm.append(0.0)
    figures = totals.figures()
    assert {"critic/value_loss", "critic/explained_variance", "critic/values_mean"} <= set(figures)
    assert all(math.isfinite(figures[name]) for name in figures)
    # The value head starts at 0: the first micro-batch's values are 0 and its loss half the mean squared reward.
    assert figures["critic/value_loss"] > 0
    assert any(not torch.equal(critic_before[n], p) for n, p in full_parameters(policy.critic.model).items())
    assert any(not torch.equal(policy_before[n], p) for n, p in full_parameters(policy.model).items())


def test_the_policy_waits_for_the_critics_warm_up(model_dir, tmp_path, rank):
    policy = critic_policy(model_dir, tmp_path, rank, critic_warmup_steps=1)
    batch = rewarded_micro_batches(model_dir, 1)[0]
    policy_before, critic_before = full_parameters(policy.model), full_parameters(policy.critic.model)
    policy.begin_step(0)
    policy.backward(batch)
    policy.optimizer_step()
    assert all(torch.equal(policy_before[n], p) for n, p in full_parameters(policy.model).items()), (
        "the policy stepped in warm-up"
    )
    assert any(not torch.equal(critic_before[n], p) for n, p in full_parameters(policy.critic.model).items())
    policy.begin_step(1)
    policy.backward(batch)
    policy.optimizer_step()
    assert any(not torch.equal(policy_before[n], p) for n, p in full_parameters(policy.model).items())


@pytest.mark.parametrize("writer", ["background", "final"])
def test_a_checkpoint_restores_the_value_model_and_its_optimizer_bit_for_bit(model_dir, tmp_path, rank, writer):
    """`background`: the periodic checkpoints a killed trainer resumes from; `final`: the run's last,
    with its export."""
    trained = critic_policy(model_dir, tmp_path / "a", rank)
    batches = rewarded_micro_batches(model_dir, 3)
    trained.begin_step(0)
    for batch in batches[:2]:
        trained.backward(batch)
        trained.optimizer_step()
    state = TrainerState(step=1, version=1)
    if writer == "background":
        background = BackgroundCheckpoints(tmp_path / "checkpoints", None)
        background.save(trained.model, trained.optimizer, state, critic=trained.trained_critic)
        background.close()
    else:
        trained.save(tmp_path / "checkpoints", state, export_hf=True)
    resumed = critic_policy(model_dir, tmp_path / "b", rank)
    assert any(
        not torch.equal(resumed_p, trained_p)
        for resumed_p, trained_p in zip(
            full_parameters(resumed.critic.model).values(), full_parameters(trained.critic.model).values()
        )
    ), "nothing to restore"
    state = resumed.load(latest_checkpoint(tmp_path / "checkpoints"))
    assert state.step == 1
    for (name, saved), restored in zip(
        full_parameters(trained.critic.model).items(), full_parameters(resumed.critic.model).values()
    ):
        assert torch.equal(saved, restored), name
    # The optimizer's moments came back too: the same next step lands on the same weights.
    for policy in (trained, resumed):
        policy.begin_step(1)
        policy.backward(batches[2])
        policy.optimizer_step()
    for (name, one), other in zip(
        full_parameters(trained.critic.model).items(), full_parameters(resumed.critic.model).values()
    ):
        assert torch.equal(one, other), name
    for (name, one), other in zip(full_parameters(trained.model).items(), full_parameters(resumed.model).values()):
        assert torch.equal(one, other), name
