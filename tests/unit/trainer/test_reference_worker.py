"""The frozen reference apart from the trainer's ranks, in this process: a micro-batch carrying
its log-probabilities trains as the colocated reference does, and the placement setting is
checked. The reference's own process: tests/integration/trainer/test_reference_worker.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlmesh.config import ConfigError
from rlmesh.job import AlgorithmSection, load_job, parse_value
from rlmesh.models.loading import load_causal_lm
from rlmesh.settings.handover import trainer_settings
from rlmesh.settings.trainer import REFERENCE_APART, REFERENCE_COLOCATED
from services.trainer.config import TrainerConfig
from services.trainer.ranks.distributed import RankInfo
from services.trainer.ranks.policy import ShardedPolicy
from services.trainer.ranks.reference import response_logprobs
from tests.support.samples import digit_samples


def make_policy(model_dir: Path, tmp_path: Path, rank: RankInfo, placement) -> ShardedPolicy:
    config = TrainerConfig(
        model_dir=str(model_dir),
        output_dir=str(tmp_path),
        prompts_per_step=2,
        group_size=4,
        micro_batch_groups=1,
        placement=placement,
        kl_coef=0.1,
    )
    return ShardedPolicy(config, rank)


def gradients(policy: ShardedPolicy) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in policy.model.named_parameters()
    }


def test_a_micro_batch_carrying_reference_logprobs_trains_as_the_colocated_reference(model_dir, tmp_path, rank):
    colocated = make_policy(model_dir, tmp_path, rank, REFERENCE_COLOCATED)
    apart = make_policy(model_dir, tmp_path, rank, REFERENCE_APART)
    assert colocated.reference is not None and apart.reference is None, (
        "with the reference apart the ranks load no copy"
    )
    samples = digit_samples(model_dir, 8)
    # The policy moves away from the reference first, so the KL term has a gradient of its own.
    for policy in (colocated, apart):
        policy.backward([replace(s, reference_logprobs=[-1.0] * len(s.response_ids)) for s in samples[:4]])
        policy.optimizer_step()
    with_reference = [
        replace(s, reference_logprobs=r)
        for s, r in zip(samples, response_logprobs(load_causal_lm(model_dir), samples, apart.pad_id))
    ]
    expected = colocated.backward(samples)
    given = apart.backward(with_reference)
    assert given.kl > 1e-4, "the step did not move the policy from the reference"
    assert given.loss == pytest.approx(expected.loss, abs=1e-6)
    assert given.kl == pytest.approx(expected.kl, abs=1e-7)
    for name, gradient in gradients(colocated).items():
        torch.testing.assert_close(gradients(apart)[name], gradient, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="must carry its reference_logprobs"):
        apart.backward(samples)


def test_the_placement_keeps_logp_with_train_and_puts_the_reference_in_or_apart(tmp_path):
    assert AlgorithmSection().placement == [["train", "logp"], ["ref_logp"]]
    AlgorithmSection(placement=[["ref_logp"], ["logp", "train"]])
    AlgorithmSection(placement=[["logp", "ref_logp", "train"]])
    with pytest.raises(
        ValueError, match=r"logp apart from train: logp \(the proximal policy's log-probabilities\) needs the live"
    ):
        AlgorithmSection(placement=[["train"], ["logp", "ref_logp"]])
    with pytest.raises(ValueError, match=r"exactly once .* repeated: \['train'\], missing: \['ref_logp'\]"):
        AlgorithmSection(placement=[["train", "logp"], ["train"]])
    with pytest.raises(ValueError, match="exactly once"):
        AlgorithmSection(placement=[["train", "logp", "ref_logp"], []])
    with pytest.raises(ValueError, match="'train', 'logp' or 'ref_logp'"):
        AlgorithmSection(placement=[["train", "logp", "critic"]])
    with pytest.raises(ValueError, match="logp apart from train"):
        TrainerConfig(model_dir="m", placement=[["train", "ref_logp"], ["logp"]])
    # Only meaningful with a KL penalty.
    assert TrainerConfig(model_dir="m", kl_coef=0.05).reference_apart
    assert not TrainerConfig(model_dir="m", kl_coef=0.05, placement=REFERENCE_COLOCATED).reference_apart
    assert not TrainerConfig(model_dir="m").reference_apart
    # `rlmesh up --set algorithm.placement=...` reaches the trainer's config.
    job, base = load_job(
        None, {"algorithm.kl_coef": 0.05, "algorithm.placement": parse_value('[["train", "logp", "ref_logp"]]')}
    )
    config = TrainerConfig(**trainer_settings(job, base, tmp_path, tmp_path))
    assert config.placement == REFERENCE_COLOCATED and not config.reference_apart
    with pytest.raises(ConfigError, match="algorithm.placement: .*logp apart from train"):
        load_job(None, {"algorithm.placement": parse_value('[["train"], ["logp"], ["ref_logp"]]')})
