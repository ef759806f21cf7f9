"""The algorithm registry's parts: lookups by name, the advantage estimators against values
computed by hand, GAE's per-token advantages and returns, the critic's clipped value loss and
explained variance, and reward shaping through the registry."""

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from rlmesh.settings.trainer import AdvantageEstimatorKind, LossConfig, LossKind
from services.trainer.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPERS, Registry, UnknownName
from services.trainer.algorithms.advantages import gae, reinforce_pp, rloo
from services.trainer.algorithms.losses import clipped_value_loss
from services.trainer.algorithms.shaping import ShapingInput, shape
from services.trainer.ranks.critic import CriticSums


def test_every_part_is_registered_by_name_and_settable_by_it():
    assert POLICY_LOSSES.names() == ["decoupled", "ppo", "tis"]
    assert ADVANTAGE_ESTIMATORS.names() == ["gae", "grpo", "reinforce_pp", "rloo"]
    # The settings (which import no service) list the same names, so a job is checked when it loads.
    assert sorted(get_args(LossKind)) == POLICY_LOSSES.names()
    assert sorted(get_args(AdvantageEstimatorKind)) == ADVANTAGE_ESTIMATORS.names()
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_critic] == ["gae"]
    assert REWARD_SHAPERS.names() == ["overlong_penalty"]


def test_an_unknown_name_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(
        UnknownName, match=r"unknown advantage estimator 'ppo': known are gae, grpo, reinforce_pp, rloo"
    ):
        ADVANTAGE_ESTIMATORS.get("ppo")
    with pytest.raises(UnknownName, match=r"unknown policy loss 'grpo': known are decoupled, ppo, tis"):
        POLICY_LOSSES.get("grpo")
    with pytest.raises(ValidationError, match="advantage_estimator"):
        LossConfig(advantage_estimator="a2c")


def test_a_name_is_registered_once():
    registry: Registry[int] = Registry("thing")
    registry.register("one")(1)
    with pytest.raises(ValueError, match="thing 'one' is registered twice"):
        registry.register("one")(2)


def test_rloo_subtracts_the_mean_of_the_groups_other_samples():
    first, second = rloo([torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])])
    # 1 - (0 + 0 + 1) / 3 = 2/3; 0 - (1 + 0 + 1) / 3 = -2/3; 1 - 0 = 1; 0 - 1/3 = -1/3.
    torch.testing.assert_close(first, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    torch.testing.assert_close(second, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert torch.equal(rloo([torch.tensor([0.5, 0.5])])[0], torch.zeros(2))


def test_reinforce_pp_centres_each_group_then_scales_by_the_whole_batch():
    # Centred: [1, -1] and [0, 0] (the second group teaches nothing); batch mean 0, standard
    # deviation sqrt((1 + 1 + 0 + 0) / 4) = 1 / sqrt(2).
    first, second = reinforce_pp([torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0])])
    scale = 2**0.5 / (1 + 2**0.5 * 1e-6)
    torch.testing.assert_close(first, torch.tensor([scale, -scale]), rtol=0, atol=1e-7)
    assert torch.equal(second, torch.zeros(2))
    # A group of spread 2 beside one of spread 1: GRPO would scale both to unit spread; here they keep their ratio.
    wide, narrow = reinforce_pp([torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])])
    assert float(wide[0] / narrow[0]) == pytest.approx(2.0)
    assert all(torch.equal(a, torch.zeros(2)) for a in reinforce_pp([torch.ones(2), torch.zeros(2)]))


def test_gae_matches_the_recursion_worked_by_hand():
    # Three response tokens after one prompt position (masked), then a pad; reward 1 on the last token.
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.75, 0.25, 9.0]])
    # gamma 1, lambda 0.5: delta_3 = 1 - 0.25 = 0.75, A_3 = 0.75; delta_2 = 0.25 - 0.75 = -0.5,
    # A_2 = -0.5 + 0.5 * 0.75 = -0.125; delta_1 = 0.75 - 0.5 = 0.25, A_1 = 0.25 + 0.5 * -0.125 = 0.1875.
    advantages, returns = gae(rewards, values, mask, 1.0, 0.5)
    assert advantages.tolist() == [[0.0, 0.1875, -0.125, 0.75, 0.0]]
    assert returns.tolist() == [[0.0, 0.6875, 0.625, 1.0, 0.0]]
    # gamma 0.5, lambda 1: the returns are the discounted rewards, 1, 0.5, 0.25, whatever the values.
    advantages, returns = gae(rewards, values, mask, 0.5, 1.0)
    assert returns.tolist() == [[0.0, 0.25, 0.5, 1.0, 0.0]]
    assert advantages.tolist() == [[0.0, -0.25, -0.25, 0.75, 0.0]]
    # Per-token rewards count where they fall: gamma 1, lambda 1, zero values: the rewards to go.
    _, returns = gae(torch.tensor([[0.5, -0.25, 1.0]]), torch.zeros(1, 3), torch.ones(1, 3), 1.0, 1.0)
    assert returns.tolist() == [[1.25, 0.75, 1.0]]


def test_the_value_loss_is_clipped_around_the_old_values():
    old, returns, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.25, 2.0]], requires_grad=True)
    loss = clipped_value_loss(values, old, returns, mask, clip=0.5)
    # Token 1: max((0.25 - 1)^2, (0.25 - 1)^2) = 0.5625. Token 2: max((2 - 1)^2, (0.5 - 1)^2) = 1.
    assert float(loss.detach()) == pytest.approx(0.5 * (0.5625 + 1.0))
    loss.backward()
    assert values.grad.tolist() == [[-0.75, 1.0]]
    # Clipped past the old value in the wrong direction: the clipped error is larger, and gives no gradient.
    values = torch.tensor([[1.5]], requires_grad=True)
    clipped_value_loss(values, torch.tensor([[0.0]]), torch.tensor([[1.25]]), torch.ones(1, 1), clip=0.5).backward()
    assert values.grad.tolist() == [[0.0]]


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([0.0, 1.0, 1.0, 0.0])

    def sums(values: torch.Tensor) -> CriticSums:
        residuals = returns - values
        return CriticSums(
            4.0,
            0.0,
            float(values.sum()),
            float(returns.sum()),
            float((returns**2).sum()),
            float(residuals.sum()),
            float((residuals**2).sum()),
        )

    assert sums(returns).metrics()["critic/explained_variance"] == pytest.approx(1.0)
    assert sums(torch.full((4,), 0.5)).metrics()["critic/explained_variance"] == pytest.approx(0.0)
    # Micro-batches' sums add up: the same critic over twice the tokens explains as much.
    twice = sums(torch.full((4,), 0.25)) + sums(torch.full((4,), 0.25))
    assert twice.metrics() == pytest.approx(sums(torch.full((4,), 0.25)).metrics())


def test_reward_shaping_goes_through_the_registry():
    off = LossConfig()
    assert shape(ShapingInput(response_length=100, max_tokens=100), off) == {}
    on = LossConfig(overlong_buffer_tokens=10, overlong_penalty=2.0)
    assert shape(ShapingInput(response_length=95, max_tokens=100), on) == {"overlong_penalty": pytest.approx(-1.0)}
    assert shape(ShapingInput(response_length=50, max_tokens=100), on) == {"overlong_penalty": 0.0}
