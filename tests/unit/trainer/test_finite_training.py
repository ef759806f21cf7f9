"""Nothing non-finite is trained: every registered advantage estimator and policy loss gives finite
outputs for any group size (a group reduced to one sample by masking included), mask and ties, and
a non-finite loss or gradient refuses the step, naming it and its samples, before the optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.rewards.base import RewardResult
from rlmesh.tasks.base import TaskPrompt
from services.trainer.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from services.trainer.algorithms.group_advantages import with_advantages
from services.trainer.algorithms.losses import policy_loss
from services.trainer.config import TrainerConfig
from services.trainer.pipeline import PromptRecord, ScoredGroup
from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.commands import CollectiveFailure, OptimizerStep, RankGroup, Train
from services.trainer.ranks.distributed import TorchThread
from services.trainer.ranks.optimizing import NonFiniteUpdate
from services.trainer.ranks.policy import ShardedPolicy
from services.trainer.trajectories import turn_credit
from tests.support.samples import micro_batches

OUTCOME_ESTIMATORS = [name for name, estimator in ADVANTAGE_ESTIMATORS.items() if not estimator.needs_critic]
CRITIC_ESTIMATORS = [name for name, estimator in ADVANTAGE_ESTIMATORS.items() if estimator.needs_critic]

# Rewards from a few values, so that ties are common; and from a wide finite range.
rewards = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5]), st.floats(-1e6, 1e6, allow_nan=False, width=32))
groups = st.lists(st.lists(rewards, min_size=1, max_size=16), min_size=1, max_size=6)


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("name", OUTCOME_ESTIMATORS)
def test_a_group_reduced_to_one_sample_teaches_nothing_and_is_finite(name):
    """A group whose other episodes were masked (deadline, environment_error) keeps one sample."""
    compute = ADVANTAGE_ESTIMATORS.get(name).compute
    [alone, pair] = compute([torch.tensor([0.7], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)])
    assert alone.tolist() == [0.0]
    assert all_finite([pair])
    [credit] = turn_credit([[{0: 1.0, 1: 0.5}]], compute)
    assert credit == [{0: 0.0, 1: 0.0}]


@settings(max_examples=150, deadline=None)
@given(groups=groups, name=st.sampled_from(OUTCOME_ESTIMATORS))
def test_every_outcome_estimator_is_finite_for_any_groups(groups, name):
    compute = ADVANTAGE_ESTIMATORS.get(name).compute
    advantages = compute([torch.tensor(g, dtype=torch.float64) for g in groups])
    assert [len(a) for a in advantages] == [len(g) for g in groups]
    assert all_finite(advantages)
    for group, group_advantages in zip(groups, advantages):
        if len(group) == 1 or len(set(group)) == 1:
            assert group_advantages.abs().max() <= 1e-9, "a group without a spread of rewards teaches nothing"


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(), name=st.sampled_from(OUTCOME_ESTIMATORS), sizes=st.lists(st.integers(1, 16), min_size=1, max_size=4)
)
def test_per_turn_credit_is_finite_for_any_groups(data, name, sizes):
    groups = [
        [data.draw(st.dictionaries(st.integers(0, 3), rewards, max_size=4)) for _ in range(size)] for size in sizes
    ]
    credit = turn_credit(groups, ADVANTAGE_ESTIMATORS.get(name).compute)
    assert all(math.isfinite(value) for group in credit for trajectory in group for value in trajectory.values())


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    name=st.sampled_from(CRITIC_ESTIMATORS),
    sequences=st.integers(1, 6),
    width=st.integers(1, 10),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_every_critic_estimator_is_finite_for_any_values_and_masks(data, name, sequences, width, gamma, lam):
    values = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    token_rewards = torch.tensor(
        data.draw(st.lists(st.lists(values, min_size=width, max_size=width), min_size=sequences, max_size=sequences))
    )
    critic_values = torch.tensor(
        data.draw(st.lists(st.lists(values, min_size=width, max_size=width), min_size=sequences, max_size=sequences))
    )
    mask = masks(data, sequences, width)
    advantages, returns = ADVANTAGE_ESTIMATORS.get(name).compute(token_rewards, critic_values, mask, gamma, lam)
    assert all_finite([advantages, returns])
    assert (advantages[mask == 0] == 0).all()


def masks(data, sequences: int, width: int) -> torch.Tensor:
    """Random response masks, rows with no trained token (all masked) among them."""
    rows = data.draw(
        st.lists(
            st.one_of(st.just([0.0] * width), st.lists(st.sampled_from([0.0, 1.0]), min_size=width, max_size=width)),
            min_size=sequences,
            max_size=sequences,
        )
    )
    return torch.tensor(rows)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    loss=st.sampled_from(POLICY_LOSSES.names()),
    sequences=st.integers(1, 6),
    width=st.integers(1, 10),
    aggregation=st.sampled_from(["sequence-mean", "token-mean"]),
    cap_mode=st.sampled_from(["truncate", "drop"]),
    per_token=st.booleans(),
    with_reference=st.booleans(),
    with_proximal=st.booleans(),
)
def test_every_policy_loss_is_finite_with_a_finite_gradient_for_any_masks(
    data, loss, sequences, width, aggregation, cap_mode, per_token, with_reference, with_proximal
):
    def logprobs() -> torch.Tensor:
        return torch.tensor(
            data.draw(
                st.lists(
                    st.lists(st.floats(-30.0, 0.0, width=32), min_size=width, max_size=width),
                    min_size=sequences,
                    max_size=sequences,
                )
            )
        )

    mask = masks(data, sequences, width)
    # Advantages as the estimators give them: one per sequence or per token, ties and zeros common.
    shape = (sequences, width) if per_token else (sequences,)
    advantage_values = data.draw(
        st.lists(
            st.one_of(st.just(0.0), st.floats(-10.0, 10.0, width=32)),
            min_size=math.prod(shape),
            max_size=math.prod(shape),
        )
    )
    advantages = torch.tensor(advantage_values).reshape(shape)
    current = logprobs().requires_grad_(True)
    total, totals = policy_loss(
        current,
        logprobs(),
        advantages,
        mask,
        loss=loss,
        proximal_logprobs=logprobs() if with_proximal else None,
        cap_mode=cap_mode,
        aggregation=aggregation,
        reference_logprobs=logprobs() if with_reference else None,
        kl_coef=0.1 if with_reference else 0.0,
    )
    assert math.isfinite(float(total.detach()))
    assert all(
        math.isfinite(value)
        for value in (
            totals.loss,
            totals.count,
            totals.tokens,
            totals.clipped_tokens,
            totals.kl,
            totals.importance_weight,
            totals.importance_weight_max,
            totals.capped_tokens,
            totals.behaviour_kl,
        )
    )
    total.backward()
    assert bool(torch.isfinite(current.grad).all())
    # Tokens off the mask (and rows without any) contribute no gradient.
    assert (current.grad[mask == 0] == 0).all()


def scored_group(rewards_of_group: list[float], index: int) -> ScoredGroup:
    record = PromptRecord(0, f"p{index}", index, "task", TaskPrompt(uid=f"u{index}", text="x"), "x", [1])
    samples = [TrainingSample([1], [2], [-0.5], 0.0, sample_id=f"b/p{index}/{k}") for k in range(len(rewards_of_group))]
    return ScoredGroup(record, "b", samples, [RewardResult(r) for r in rewards_of_group], [[0]] * len(rewards_of_group))


@settings(max_examples=60, deadline=None)
@given(groups=groups, name=st.sampled_from(OUTCOME_ESTIMATORS))
def test_a_micro_batchs_advantages_are_finite_for_every_estimator(groups, name):
    samples = with_advantages([scored_group(g, i) for i, g in enumerate(groups)], name)
    assert all(math.isfinite(s.advantage) for s in samples)


# The guard before the optimizer step ------------------------------------------------------------


def make_policy(model_dir, tmp_path, rank) -> ShardedPolicy:
    config = TrainerConfig(
        model_dir=str(model_dir),
        output_dir=str(tmp_path),
        prompts_per_step=1,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=1,
        learning_rate=1e-2,
    )
    return ShardedPolicy(config, rank)


def named(samples: list[TrainingSample], prefix: str) -> list[TrainingSample]:
    for index, sample in enumerate(samples):
        sample.sample_id = f"{prefix}/{index}"
    return samples


def weights_and_optimizer(policy: ShardedPolicy) -> tuple[dict[str, torch.Tensor], dict]:
    state = {
        key: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        for key, value in policy.optimizer.state_dict()["state"].items()
    }
    return policy.full_parameters(), state


def assert_unchanged(policy: ShardedPolicy, before) -> None:
    weights, state = weights_and_optimizer(policy)
    for name, tensor in before[0].items():
        assert torch.equal(weights[name], tensor), name
    assert state.keys() == before[1].keys()
    for key, value in before[1].items():
        for name, tensor in value.items():
            assert torch.equal(torch.as_tensor(state[key][name]), torch.as_tensor(tensor)), (key, name)


def test_a_nan_advantage_is_refused_at_its_micro_batch_naming_the_step_and_samples(
    model_dir, tmp_path, rank, monkeypatch
):
    policy = make_policy(model_dir, tmp_path, rank)
    first, second = micro_batches(model_dir, 2)
    policy.begin_step(3)
    # One optimizer step first, so the optimizer holds state that must stay as it is.
    policy.backward(named(first, "b/p0"))
    policy.optimizer_step()
    before = weights_and_optimizer(policy)
    stepped = []
    monkeypatch.setattr(policy.optimizer, "step", lambda *args, **kwargs: stepped.append(True))
    second = named(second, "b/p1")
    second[2].advantage = float("nan")
    with pytest.raises(NonFiniteUpdate, match=r"step 3: .*non-finite loss.*b/p1/2") as refused:
        policy.backward(second)
    assert "b/p1/0" not in str(refused.value), "only the samples whose loss is not finite are named"
    assert not stepped
    assert all(p.grad is None for p in policy.model.parameters()), "the poisoned gradients are cleared"
    assert policy.pending_count == 0
    assert_unchanged(policy, before)


def test_a_non_finite_gradient_never_reaches_the_optimizer(model_dir, tmp_path, rank, monkeypatch):
    policy = make_policy(model_dir, tmp_path, rank)
    first, second = micro_batches(model_dir, 2)
    policy.begin_step(5)
    policy.backward(named(first, "b/p0"))
    policy.optimizer_step()
    before = weights_and_optimizer(policy)
    stepped = []
    monkeypatch.setattr(policy.optimizer, "step", lambda *args, **kwargs: stepped.append(True))
    policy.backward(named(second, "b/p1"))
    # A gradient poisoned after a finite loss (an overflow in the backward).
    next(p for p in policy.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteUpdate, match=r"step 5: .*gradient.*not finite.*b/p1/0.*b/p1/3"):
        policy.optimizer_step()
    assert not stepped
    assert all(p.grad is None for p in policy.model.parameters())
    assert_unchanged(policy, before)
    # The next mini-batch trains as usual: the refusal left nothing behind.
    monkeypatch.undo()
    policy.backward(named(micro_batches(model_dir, 1)[0], "b/p2"))
    assert math.isfinite(policy.optimizer_step())


class RefusingPolicy:
    """Stands for the sharded policy: every training command is refused, as a non-finite loss is."""

    def backward(self, samples):
        raise NonFiniteUpdate("step 2: non-finite loss in samples b/p0/1: the optimizer step is refused")

    def optimizer_step(self):
        raise NonFiniteUpdate("step 2: the policy's gradient (norm nan) is not finite in samples b/p0/1")


async def test_a_refused_step_ends_the_job_with_every_rank_in_step(rank, tmp_path):
    """Every rank refuses alike: the refusal is a CollectiveFailure, which rank 0 raises (the job
    fails, naming the step and samples) while the other ranks wait for its Stop."""
    thread = TorchThread()
    group = RankGroup(rank, RefusingPolicy(), None, thread, tmp_path / "checkpoints")
    try:
        with pytest.raises(CollectiveFailure, match=r"step 2: non-finite loss in samples b/p0/1"):
            await group.lead(Train([]))
        with pytest.raises(CollectiveFailure, match=r"step 2: the policy's gradient"):
            await group.lead(OptimizerStep())
        assert group.in_step
    finally:
        thread.close()
