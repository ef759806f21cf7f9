"""GRPO's pieces: advantages, the clipped loss and its gradient, the KL estimate."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.batching import TrainingSample, build_micro_batch
from services.trainer.grpo import group_advantages, grpo_loss, k3_kl

rewards = st.lists(st.floats(0, 1), min_size=2, max_size=16)


@settings(max_examples=100)
@given(rewards)
def test_advantages_are_centred_and_scaled_within_a_group(values):
    advantages = group_advantages(torch.tensor([values]))[0]
    assert abs(float(advantages.mean())) < 1e-4
    spread = float(torch.tensor(values).std(unbiased=False))
    if spread > 1e-6:
        # Unit spread, shrunk only by the epsilon that guards near-equal rewards.
        assert abs(float(advantages.std(unbiased=False)) - spread / (spread + 1e-6)) < 1e-3
    else:
        assert torch.all(advantages == 0)


def test_positive_advantage_raises_the_sampled_tokens_probability():
    logits = torch.zeros(2, 3, requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)[:, 0][None]
    loss, _ = grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2), 0.2, normaliser=1)
    loss.backward()
    assert torch.all(logits.grad[:, 0] < 0)


def test_ratios_beyond_the_clip_give_no_gradient():
    logprobs = torch.tensor([[0.0, -0.1]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0]])
    loss, stats = grpo_loss(logprobs, behaviour, torch.tensor([1.0]), torch.ones(1, 2), 0.2, normaliser=1)
    loss.backward()
    assert torch.all(logprobs.grad == 0)
    assert stats.clip_fraction == 1.0


def test_loss_sums_over_micro_batches_to_the_mini_batch_mean():
    torch.manual_seed(0)
    new, old = torch.randn(4, 5), torch.randn(4, 5)
    adv, mask = torch.randn(4), (torch.rand(4, 5) > 0.3).float()
    whole, _ = grpo_loss(new, old, adv, mask, 0.2, normaliser=4)
    halves = sum(grpo_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, normaliser=4)[0] for i in (0, 2))
    assert torch.allclose(whole, halves)


def test_kl_penalty_pulls_towards_the_reference():
    logprobs = torch.tensor([[-0.5]], requires_grad=True)
    reference = torch.tensor([[-2.0]])
    loss, stats = grpo_loss(logprobs, logprobs.detach(), torch.tensor([0.0]), torch.ones(1, 1), 0.2, 1, reference, kl_coef=1.0)
    loss.backward()
    assert stats.kl > 0 and logprobs.grad.item() > 0
    assert float(k3_kl(reference, reference)) == 0


def test_micro_batch_masks_exactly_the_response_tokens():
    batch = build_micro_batch([TrainingSample([5, 6, 7], [1, 2], [-0.1, -0.2], 1.0), TrainingSample([5], [3], [-0.3], -1.0)], pad_id=9)
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2], [5, 3, 9, 9, 9]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(batch.behaviour_logprobs[0, 2:], torch.tensor([-0.1, -0.2]))
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_token_rewards_add_to_each_tokens_advantage_and_each_sample_keeps_its_temperature():
    samples = [TrainingSample([5, 6], [1, 2, 3], [-0.1, -0.2, -0.3], 0.5, temperature=0.7, token_rewards=[0.0, 1.0, -1.0]),
               TrainingSample([5], [4], [-0.4], -1.0)]
    batch = build_micro_batch(samples, pad_id=0)
    assert batch.advantages[0].tolist() == [0.0, 0.5, 1.5, -0.5]
    assert batch.advantages[1].tolist() == [-1.0, 0.0, 0.0, 0.0]
    assert batch.temperatures.tolist() == [pytest.approx(0.7), 1.0]
    per_sequence = torch.tensor([0.5, -1.0])
    logprobs = torch.zeros(2, 4, requires_grad=True)
    dense, _ = grpo_loss(logprobs, torch.zeros(2, 4), batch.advantages, batch.response_mask, 0.2, 2)
    flat, _ = grpo_loss(logprobs, torch.zeros(2, 4), per_sequence, batch.response_mask, 0.2, 2)
    # The token rewards of sample 0 sum to zero: on average its tokens move as without them.
    assert float(dense) == pytest.approx(float(flat))
