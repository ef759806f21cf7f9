"""The sharded policy's side of the loss, on one rank in this process: micro-batches trained after
an optimizer step are scored against the policy as it was when the training step began, and the
accumulated gradients are divided by the mini-batch's size at the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

import services.trainer.ranks.policy as policy_module
from rlmesh.models.loading import load_causal_lm
from services.trainer.config import TrainerConfig
from services.trainer.ranks.batching import build_micro_batch, token_logprobs
from services.trainer.ranks.policy import ShardedPolicy
from tests.support.samples import micro_batches


def make_policy(model_dir, tmp_path, rank, **loss) -> ShardedPolicy:
    config = TrainerConfig(
        model_dir=str(model_dir),
        output_dir=str(tmp_path),
        prompts_per_step=2,
        group_size=4,
        micro_batch_groups=1,
        mini_batches_per_step=2,
        learning_rate=1e-2,
        **loss,
    )
    return ShardedPolicy(config, rank)


def full_gradients(policy: ShardedPolicy) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in policy.model.named_parameters()
    }


@pytest.mark.parametrize("loss", ["decoupled", "tis"])
def test_micro_batches_after_an_optimizer_step_are_scored_with_the_step_start_policy(
    model_dir, tmp_path, rank, monkeypatch, loss
):
    policy = make_policy(model_dir, tmp_path, rank, loss=loss)
    batches = micro_batches(model_dir, 4)
    with pytest.raises(RuntimeError, match="must send BeginStep"):
        policy.backward(batches[0])
    seen = []

    def recording_loss(logprobs, *args, **kwargs):
        proximal = kwargs["proximal_logprobs"]
        seen.append((logprobs.detach().clone(), None if proximal is None else proximal.clone()))
        return real_loss(logprobs, *args, **kwargs)

    real_loss = policy_module.policy_loss
    monkeypatch.setattr(policy_module, "policy_loss", recording_loss)
    # A first training step moves the policy away from the folder's weights.
    policy.begin_step()
    for batch in batches[:2]:
        policy.backward(batch)
        policy.optimizer_step()
    policy.begin_step()
    step_start = load_causal_lm(model_dir)
    step_start.train()
    with torch.no_grad():
        parameters = policy.full_parameters()
        for name, param in step_start.named_parameters():
            param.copy_(parameters[name])
    policy.backward(batches[2])
    policy.optimizer_step()
    stats = policy.backward(batches[3])
    assert [proximal is None for _, proximal in seen] == [True, False, True, False], (
        "the current policy is pi_prox until the step's first optimizer step, then the snapshot"
    )
    tensors = build_micro_batch(batches[3], policy.pad_id)
    with torch.no_grad():
        expected = token_logprobs(step_start, tensors)
    current, proximal = seen[3]
    mask = tensors.response_mask.bool()
    torch.testing.assert_close(proximal[mask], expected[mask], rtol=0, atol=1e-6)
    assert (current[mask] - expected[mask]).abs().max() > 1e-3, "the optimizer step did not change the policy"
    with torch.no_grad():
        first_step_start = token_logprobs(load_causal_lm(model_dir), tensors)
    assert (first_step_start[mask] - expected[mask]).abs().max() > 1e-3, "step 1 did not change the policy"
    weights = (expected - tensors.behaviour_logprobs).exp()[mask]
    assert stats.importance_weight_mean == pytest.approx(float(weights.mean()), rel=1e-5)
    assert stats.importance_weight_max == pytest.approx(float(weights.max()), rel=1e-5)
    assert stats.capped_fraction == pytest.approx(float((weights > 2.0).float().mean()))
    assert stats.tokens == int(mask.sum()) and stats.behaviour_kl > 0


@pytest.mark.parametrize("aggregation", ["sequence-mean", "token-mean"])
def test_the_optimizer_step_divides_the_accumulated_gradients_by_the_mini_batch_size(
    model_dir, tmp_path, rank, aggregation
):
    policy = make_policy(
        model_dir, tmp_path, rank, loss_aggregation=aggregation, clip_epsilon_high=0.28, max_grad_norm=1e6
    )
    batches = micro_batches(model_dir, 2)
    streamed = [policy.backward(batch) for batch in batches]
    count = policy.pending_count
    gradients = {name: g / count for name, g in full_gradients(policy).items()}
    policy.optimizer.zero_grad(set_to_none=True)
    policy.pending_count = 0.0
    whole = policy.backward(batches[0] + batches[1])
    assert whole.loss_count == count == sum(s.loss_count for s in streamed)
    tokens = sum(len(s.response_ids) for batch in batches for s in batch)
    assert count == (tokens if aggregation == "token-mean" else 8)
    # The mini-batch's loss is its micro-batches' losses weighted by what each averages over.
    assert sum(s.loss * s.loss_count for s in streamed) / count == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    for name, gradient in full_gradients(policy).items():
        torch.testing.assert_close(gradient / count, gradients[name], rtol=1e-5, atol=1e-7, msg=name)
    norm = policy.optimizer_step()
    assert norm == pytest.approx(float(torch.stack([g.norm() for g in gradients.values()]).norm()), rel=1e-5)
    assert policy.pending_count == 0


def test_bf16_precision_computes_in_bf16_on_float32_master_weights_and_a_float32_loss(
    model_dir, tmp_path, rank, monkeypatch
):
    config = TrainerConfig(
        model_dir=str(model_dir),
        output_dir=str(tmp_path),
        precision="bf16",
        weights_dtype="bfloat16",
        learning_rate=1e-2,
    )
    policy = ShardedPolicy(config, rank)
    assert (policy.compute_dtype, policy.weights_dtype) == (torch.bfloat16, torch.bfloat16)
    computed_in = set()
    linear = next(m for m in policy.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_pre_hook(lambda module, args: computed_in.add(module.weight.dtype))
    loss_inputs = []
    real_loss = policy_module.policy_loss

    def recording_loss(logprobs, *args, **kwargs):
        loss_inputs.append(logprobs.dtype)
        return real_loss(logprobs, *args, **kwargs)

    monkeypatch.setattr(policy_module, "policy_loss", recording_loss)
    before = policy.full_parameters()
    stats = policy.backward(micro_batches(model_dir, 1)[0])
    assert all(p.grad.dtype == torch.float32 for p in policy.model.parameters()), "gradients reduced in float32"
    norm = policy.optimizer_step()
    assert computed_in == {torch.bfloat16} and loss_inputs == [torch.float32]
    assert math.isfinite(stats.loss) and math.isfinite(norm) and norm > 0
    after = policy.full_parameters()
    assert all(t.dtype == torch.float32 for t in after.values()), "the master weights stay float32"
    assert any(not torch.equal(before[name], after[name]) for name in after)
    assert {shard.tensor.dtype for shard in policy.local_shards().values()} == {torch.float32}, (
        "the hand-off casts the shards, not the policy"
    )
