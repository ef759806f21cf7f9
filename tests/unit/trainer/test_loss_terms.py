"""The algorithm's terms: advantages, the three clipped losses (ppo, decoupled, tis) and their gradients,
clip-higher, sequence- and token-mean aggregation over streamed micro-batches, the KL estimate,
the overlong penalty and the loss settings."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.trainer.algorithms.advantages import group_advantages
from services.trainer.algorithms.losses import k3_kl, policy_loss
from services.trainer.algorithms.shaping import overlong_penalty
from services.trainer.config import LossConfig
from services.trainer.ranks.batching import TrainingSample, build_micro_batch

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
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.all(logits.grad[:, 0] < 0)


def test_ratios_beyond_the_clip_give_no_gradient():
    logprobs = torch.tensor([[0.0, -0.1]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0]])
    loss, totals = policy_loss(logprobs, behaviour, torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.all(logprobs.grad == 0)
    assert totals.clipped_tokens == totals.tokens == 2


def test_kl_penalty_pulls_towards_the_reference():
    logprobs = torch.tensor([[-0.5]], requires_grad=True)
    reference = torch.tensor([[-2.0]])
    loss, totals = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([0.0]), torch.ones(1, 1), reference_logprobs=reference, kl_coef=1.0
    )
    loss.backward()
    assert totals.kl > 0 and logprobs.grad.item() > 0
    assert float(k3_kl(reference, reference)) == 0


def loss_inputs(data, sequences: int, width: int, spread: float = 0.5):
    """Random log-probabilities of a policy, its behaviour policy and proximal policy, advantages and a mask."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(sequences, width, generator=generator) * 3).requires_grad_()
    behaviour = logprobs.detach() + spread * torch.randn(sequences, width, generator=generator)
    proximal = logprobs.detach() + spread * torch.randn(sequences, width, generator=generator)
    advantages = torch.randn(sequences, generator=generator)
    mask = (torch.rand(sequences, width, generator=generator) > 0.3).float()
    return logprobs, behaviour, proximal, advantages, mask


def loss_and_gradient(logprobs, *args, **kwargs):
    logprobs.grad = None
    loss, totals = policy_loss(logprobs, *args, **kwargs)
    loss.backward()
    return loss.detach(), logprobs.grad.clone(), totals


@settings(max_examples=40)
@given(
    st.data(),
    st.integers(1, 6),
    st.integers(1, 8),
    st.floats(0.05, 0.5),
    st.floats(0.05, 0.5),
    st.sampled_from(["sequence-mean", "token-mean"]),
)
def test_decoupled_and_tis_are_ppo_when_the_proximal_policy_is_the_behaviour_policy(
    data, sequences, width, low, high, aggregation
):
    logprobs, behaviour, _, advantages, mask = loss_inputs(data, sequences, width)
    options = dict(clip_low=low, clip_high=high, aggregation=aggregation, importance_cap=2.0)
    ppo = loss_and_gradient(logprobs, behaviour, advantages, mask, loss="ppo", **options)
    for kind in ("decoupled", "tis"):
        other = loss_and_gradient(
            logprobs, behaviour, advantages, mask, loss=kind, proximal_logprobs=behaviour.clone(), **options
        )
        assert torch.equal(other[0], ppo[0]) and torch.equal(other[1], ppo[1]), kind
        assert other[2].capped_tokens == 0 and other[2].behaviour_kl == 0
        assert other[2].importance_weight == pytest.approx(other[2].tokens)


@settings(max_examples=40)
@given(st.data(), st.integers(1, 6), st.integers(1, 8))
def test_both_cap_modes_agree_while_no_weight_reaches_the_cap(data, sequences, width):
    logprobs, behaviour, proximal, advantages, mask = loss_inputs(data, sequences, width)
    largest = float((proximal - behaviour).exp().max())
    options = dict(proximal_logprobs=proximal, importance_cap=largest + 1)
    dropping = loss_and_gradient(logprobs, behaviour, advantages, mask, loss="decoupled", cap_mode="drop", **options)
    for kind in ("decoupled", "tis"):
        truncating = loss_and_gradient(logprobs, behaviour, advantages, mask, loss=kind, **options)
        assert torch.equal(dropping[0], truncating[0]) and torch.equal(dropping[1], truncating[1]), kind
    assert dropping[2].capped_tokens == 0


def test_decoupled_truncates_or_drops_the_tokens_beyond_the_cap_and_tis_truncates():
    weights = torch.tensor([[0.5, 1.5, 2.5, 3.0]])
    behaviour = torch.full((1, 4), -1.0)
    proximal = behaviour + weights.log()
    # The policy a little above the proximal policy: inside the clip, every token has a gradient.
    logprobs = (proximal + 0.05).requires_grad_()
    advantage, mask, cap = torch.tensor([1.0]), torch.ones(1, 4), 2.0
    options = dict(proximal_logprobs=proximal, importance_cap=cap, aggregation="token-mean")
    # The gradient against the proximal policy alone: w = 1 everywhere.
    _, unweighted, _ = loss_and_gradient(logprobs, proximal, advantage, mask, loss="ppo", aggregation="token-mean")
    _, truncated, totals = loss_and_gradient(logprobs, behaviour, advantage, mask, loss="decoupled", **options)
    _, dropped, dropped_totals = loss_and_gradient(
        logprobs, behaviour, advantage, mask, loss="decoupled", cap_mode="drop", **options
    )
    _, tis, tis_totals = loss_and_gradient(logprobs, behaviour, advantage, mask, loss="tis", **options)
    torch.testing.assert_close(truncated, unweighted * torch.tensor([[0.5, 1.5, 2.0, 2.0]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(dropped, unweighted * torch.tensor([[0.5, 1.5, 0.0, 0.0]]), rtol=1e-6, atol=0)
    assert torch.equal(tis, truncated)
    for figures in (totals, dropped_totals, tis_totals):
        assert figures.capped_tokens == 2 and figures.tokens == 4
        assert figures.importance_weight == pytest.approx(7.5) and figures.importance_weight_max == pytest.approx(3.0)
        expected_kl = sum(w - math.log(w) - 1 for w in (0.5, 1.5, 2.5, 3.0))
        assert figures.behaviour_kl == pytest.approx(expected_kl, rel=1e-5)
    # Masked tokens count nowhere, not even in the maximum.
    _, _, masked = loss_and_gradient(
        logprobs, behaviour, advantage, torch.tensor([[1.0, 1.0, 0.0, 0.0]]), loss="tis", **options
    )
    assert masked.capped_tokens == 0 and masked.importance_weight_max == pytest.approx(1.5)


def test_an_unknown_cap_mode_is_refused():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="unknown importance cap mode 'clamp'"):
        policy_loss(logprobs, logprobs.detach(), torch.ones(1), torch.ones(1, 2), loss="decoupled", cap_mode="clamp")


def test_tis_refuses_to_drop():
    with pytest.raises(ValidationError, match="tis truncates by definition"):
        LossConfig(loss="tis", importance_cap_mode="drop")
    assert LossConfig(loss="decoupled", importance_cap_mode="drop").importance_cap_mode == "drop"


def test_without_proximal_log_probabilities_the_current_policy_is_the_proximal_one():
    logprobs = torch.tensor([[-0.3, -1.2, -0.7]], requires_grad=True)
    behaviour = torch.tensor([[-0.5, -1.0, -0.6]])
    advantages, mask = torch.tensor([0.7]), torch.ones(1, 3)
    for kind in ("decoupled", "tis"):
        implicit = loss_and_gradient(logprobs, behaviour, advantages, mask, loss=kind)
        explicit = loss_and_gradient(
            logprobs, behaviour, advantages, mask, loss=kind, proximal_logprobs=logprobs.detach().clone()
        )
        assert torch.equal(implicit[0], explicit[0]) and torch.equal(implicit[1], explicit[1])
        assert implicit[2].clipped_tokens == 0, "the ratio to the current policy is 1"
    # Under ppo the figures describe pi / pi_behav and the loss ignores them.
    _, _, ppo = loss_and_gradient(logprobs, behaviour, advantages, mask, loss="ppo")
    assert ppo.importance_weight == pytest.approx(float((logprobs.detach() - behaviour).exp().sum()))


def test_clip_higher_bounds_the_ratio_asymmetrically():
    def gradient(ratio: float, advantage: float) -> float:
        logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
        loss, _ = policy_loss(
            logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28
        )
        loss.backward()
        return logprobs.grad.item()

    # A good token may grow to 1.28, not beyond; a bad one may shrink to 0.8, not beyond.
    assert gradient(1.25, 1.0) < 0 and gradient(1.30, 1.0) == 0
    assert gradient(0.85, -1.0) > 0 and gradient(0.75, -1.0) == 0
    # The other side does not clip what it does not limit (min(r A, clip(r) A)).
    assert gradient(0.5, 1.0) < 0 and gradient(1.5, -1.0) > 0


def one_shot_loss(logprobs, behaviour, advantages, mask, aggregation: str) -> torch.Tensor:
    """The mini-batch loss written directly: the mean of per-sequence token means, or the mean of all tokens."""
    ratio = (logprobs - behaviour).exp()
    adv = advantages[:, None]
    token_loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * mask
    if aggregation == "token-mean":
        return token_loss.sum() / mask.sum()
    return (token_loss.sum(-1) / mask.sum(-1)).mean()


@settings(max_examples=60)
@given(st.data(), st.lists(st.integers(1, 7), min_size=1, max_size=9), st.sampled_from(["sequence-mean", "token-mean"]))
def test_streamed_micro_batches_give_the_gradient_of_the_whole_mini_batch(data, lengths, aggregation):
    """Micro-batches of any size, each padded to its own longest sequence; their loss sums
    backpropagated one by one and the accumulated gradient divided by the mini-batch's count
    equals the gradient of the mini-batch's loss taken at once."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    vocab, hidden = 11, 5
    # A shared parameter every token's log-probability depends on, as in a model.
    embedding = torch.randn(vocab, hidden, generator=generator)
    head = torch.randn(hidden, vocab, generator=generator).requires_grad_()
    tokens = [torch.randint(vocab, (n,), generator=generator) for n in lengths]
    behaviour = [torch.randn(n, generator=generator) * 0.3 - 2.4 for n in lengths]
    advantages = torch.randn(len(lengths), generator=generator)

    def batch(indices: list[int]):
        width = max(lengths[i] for i in indices)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        old = torch.zeros(len(indices), width)
        mask = torch.zeros(len(indices), width)
        for row, i in enumerate(indices):
            ids[row, : lengths[i]], old[row, : lengths[i]], mask[row, : lengths[i]] = tokens[i], behaviour[i], 1
        logprobs = torch.log_softmax(embedding[ids] @ head, -1).gather(-1, ids[..., None]).squeeze(-1)
        return logprobs, old, advantages[indices], mask

    whole = list(range(len(lengths)))
    expected = torch.autograd.grad(one_shot_loss(*batch(whole), aggregation), head)[0]
    cuts = sorted(
        data.draw(st.sets(st.integers(1, len(lengths) - 1), max_size=len(lengths) - 1)) if len(lengths) > 1 else set()
    )
    count = 0.0
    head.grad = None
    for start, end in zip([0, *cuts], [*cuts, len(lengths)]):
        loss, totals = policy_loss(*batch(whole[start:end]), clip_low=0.2, clip_high=0.28, aggregation=aggregation)
        loss.backward()
        count += totals.count
    assert count == (sum(lengths) if aggregation == "token-mean" else len(lengths))
    torch.testing.assert_close(head.grad / count, expected, rtol=1e-5, atol=1e-6)


def test_token_mean_weighs_sequences_by_length_and_sequence_mean_does_not():
    # One short sequence with a positive advantage, one long one with a negative advantage.
    logprobs = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0])
    sequence, _, per_sequence = loss_and_gradient(logprobs, logprobs.detach(), advantages, mask)
    token, _, per_token = loss_and_gradient(logprobs, logprobs.detach(), advantages, mask, aggregation="token-mean")
    assert (per_sequence.count, per_token.count) == (2, 5)
    assert float(sequence) / per_sequence.count == pytest.approx(0.0)  # (-1 + 1) / 2
    assert float(token) / per_token.count == pytest.approx(3 / 5)  # (-1 + 4) / 5


def test_micro_batch_masks_exactly_the_response_tokens():
    batch = build_micro_batch(
        [TrainingSample([5, 6, 7], [1, 2], [-0.1, -0.2], 1.0), TrainingSample([5], [3], [-0.3], -1.0)], pad_id=9
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2], [5, 3, 9, 9, 9]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(batch.behaviour_logprobs[0, 2:], torch.tensor([-0.1, -0.2]))
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_token_rewards_add_to_each_tokens_advantage_and_each_sample_keeps_its_temperature():
    samples = [
        TrainingSample([5, 6], [1, 2, 3], [-0.1, -0.2, -0.3], 0.5, temperature=0.7, token_rewards=[0.0, 1.0, -1.0]),
        TrainingSample([5], [4], [-0.4], -1.0),
    ]
    batch = build_micro_batch(samples, pad_id=0)
    assert batch.advantages[0].tolist() == [0.0, 0.5, 1.5, -0.5]
    assert batch.advantages[1].tolist() == [-1.0, 0.0, 0.0, 0.0]
    assert batch.temperatures.tolist() == [pytest.approx(0.7), 1.0]
    per_sequence = torch.tensor([0.5, -1.0])
    logprobs = torch.zeros(2, 4, requires_grad=True)
    dense, _ = policy_loss(logprobs, torch.zeros(2, 4), batch.advantages, batch.response_mask)
    flat, _ = policy_loss(logprobs, torch.zeros(2, 4), per_sequence, batch.response_mask)
    # The token rewards of sample 0 sum to zero: on average its tokens move as without them.
    assert float(dense.detach()) == pytest.approx(float(flat.detach()))


def test_overlong_penalty_is_zero_up_to_the_buffer_then_falls_linearly_to_the_penalty():
    assert overlong_penalty(0, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(81, 100, 20, 1.0) == pytest.approx(-0.05)
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(130, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0, "no buffer: off"
    assert overlong_penalty(1, 100, 100, 2.0) == pytest.approx(-0.02), "the whole length as buffer"
    with pytest.raises(ValueError, match="buffer_tokens must be in"):
        overlong_penalty(10, 100, 101, 1.0)


def test_the_loss_settings_default_to_ppo_with_a_symmetric_clip_and_check_their_ranges():
    default = LossConfig()
    assert (default.loss, default.loss_aggregation, default.importance_cap) == ("ppo", "sequence-mean", 2.0)
    assert default.clip_low == default.clip_high == default.clip_epsilon == 0.2
    assert (LossConfig(clip_epsilon=0.3).clip_low, LossConfig(clip_epsilon=0.3).clip_high) == (0.3, 0.3)
    higher = LossConfig(clip_epsilon_high=0.28)
    assert (higher.clip_low, higher.clip_high) == (0.2, 0.28)
    assert LossConfig(clip_epsilon=0.3, clip_epsilon_low=0.1).clip_low == 0.1
    for values, field in (
        ({"clip_epsilon_low": 1.0}, "clip_epsilon_low"),
        ({"clip_epsilon_high": 0.0}, "clip_epsilon_high"),
        ({"importance_cap": 0.5}, "importance_cap"),
        ({"loss": "grpo"}, "loss"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"overlong_buffer_tokens": -1}, "overlong_buffer_tokens"),
    ):
        with pytest.raises(ValidationError, match=field):
            LossConfig(**values)
