"""The algorithm registry's parts: lookups by name, the advantage estimators against values
computed by hand, and reward shaping through the registry."""

import pytest
import torch
from pydantic import ValidationError

from services.trainer.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPERS, Registry, UnknownName
from services.trainer.algorithms.advantages import reinforce_pp, rloo
from services.trainer.algorithms.shaping import ShapingInput, shape
from services.trainer.config import GrpoConfig


def test_every_part_is_registered_by_name():
    assert POLICY_LOSSES.names() == ["decoupled", "ppo", "tis"]
    assert ADVANTAGE_ESTIMATORS.names() == ["grpo", "reinforce_pp", "rloo"]
    assert REWARD_SHAPERS.names() == ["overlong_penalty"]


def test_an_unknown_name_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(UnknownName, match=r"unknown advantage estimator 'ppo': known are grpo, reinforce_pp, rloo"):
        ADVANTAGE_ESTIMATORS.get("ppo")
    with pytest.raises(UnknownName, match=r"unknown policy loss 'grpo': known are decoupled, ppo, tis"):
        POLICY_LOSSES.get("grpo")
    with pytest.raises(ValidationError, match=r"advantage_estimator[\s\S]*unknown advantage estimator 'a2c'"):
        GrpoConfig(advantage_estimator="a2c")


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
    scale = 2 ** 0.5 / (1 + 2 ** 0.5 * 1e-6)
    torch.testing.assert_close(first, torch.tensor([scale, -scale]), rtol=0, atol=1e-7)
    assert torch.equal(second, torch.zeros(2))
    # A group of spread 2 beside one of spread 1: GRPO would scale both to unit spread; here they keep their ratio.
    wide, narrow = reinforce_pp([torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])])
    assert float(wide[0] / narrow[0]) == pytest.approx(2.0)
    assert all(torch.equal(a, torch.zeros(2)) for a in reinforce_pp([torch.ones(2), torch.zeros(2)]))


def test_reward_shaping_goes_through_the_registry():
    off = GrpoConfig()
    assert shape(ShapingInput(response_length=100, max_tokens=100), off) == {}
    on = GrpoConfig(overlong_buffer_tokens=10, overlong_penalty=2.0)
    assert shape(ShapingInput(response_length=95, max_tokens=100), on) == {"overlong_penalty": pytest.approx(-1.0)}
    assert shape(ShapingInput(response_length=50, max_tokens=100), on) == {"overlong_penalty": 0.0}
