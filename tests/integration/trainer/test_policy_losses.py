"""The proximal policy on two FSDP ranks (a gloo process group): micro-batches trained after an
optimizer step of a training step are scored with the parameters of the step's start, gathered
afresh from every rank's shards, including on a rank whose share of a micro-batch is empty. A NaN
in one rank's share refuses the step on every rank alike, naming the sample.

The ranks run tests/integration/trainer/policy_losses_worker.py."""

from __future__ import annotations

import json

import pytest
import torch

from rlmesh.models.loading import load_causal_lm
from services.trainer.ranks.batching import build_micro_batch, token_logprobs
from tests.support.samples import micro_batches

WORKER = "tests.integration.trainer.policy_losses_worker"


def test_two_ranks_score_late_micro_batches_with_the_step_start_policy(rank_runner, model_dir, tmp_path):
    spec = {"model_dir": str(model_dir), "output_dir": str(tmp_path), "result": str(tmp_path / "result-{rank}.pt")}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    rank_runner.run(WORKER, [str(spec_path)], 2, tmp_path, timeout=120)
    results = [torch.load(spec["result"].format(rank=r), weights_only=False) for r in (0, 1)]
    batches = micro_batches(model_dir, 5)
    batches[4] = batches[4][:1]
    step_start = load_causal_lm(model_dir)
    step_start.train()
    with torch.no_grad():
        for name, param in step_start.named_parameters():
            param.copy_(results[0]["step_start"][name])
    folder = load_causal_lm(model_dir)
    for rank, result in enumerate(results):
        proximal = result["proximal"]
        # Micro-batches 0 and 2 open a step (pi_prox is the current policy); 1 follows step 1's
        # optimizer step, 3 and 4 step 2's. Rank 1 has no share of micro-batch 4.
        assert [p is None for p in proximal] == [True, False, True, False] + ([False] if rank == 0 else [])
        for index, scored in ((3, proximal[3]), *(((4, proximal[4]),) if rank == 0 else ())):
            share = batches[index][rank::2]
            tensors = build_micro_batch(share, pad_id=0)
            mask = tensors.response_mask.bool()
            with torch.no_grad():
                expected = token_logprobs(step_start, tensors)
                stale = token_logprobs(folder, tensors)
            torch.testing.assert_close(
                scored[mask], expected[mask], rtol=0, atol=1e-5, msg=f"rank {rank}, micro-batch {index}"
            )
            assert (stale[mask] - expected[mask]).abs().max() > 1e-3, "step 1 did not move the policy"
    # The figures are merged over the ranks: both report the same.
    assert results[0]["stats"] == results[1]["stats"]
    tensors = build_micro_batch(batches[3], pad_id=0)
    mask = tensors.response_mask.bool()
    with torch.no_grad():
        weights = (token_logprobs(step_start, tensors) - tensors.behaviour_logprobs).exp()[mask]
    stats = results[0]["stats"][3]
    assert stats.tokens == int(mask.sum())
    assert stats.importance_weight_mean == pytest.approx(float(weights.mean()), rel=1e-5)
    assert stats.importance_weight_max == pytest.approx(float(weights.max()), rel=1e-5)


def test_a_nan_in_one_ranks_share_is_refused_alike_on_every_rank(rank_runner, model_dir, tmp_path):
    spec = {
        "model_dir": str(model_dir),
        "output_dir": str(tmp_path),
        "result": str(tmp_path / "refused-{rank}.pt"),
        "refuse": True,
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    rank_runner.run(WORKER, [str(spec_path)], 2, tmp_path, timeout=120)
    results = [torch.load(spec["result"].format(rank=r), weights_only=False) for r in (0, 1)]
    # Rank 0's share (samples 0 and 2) is finite: it refuses too, with the same message.
    assert results[0]["refused"] == results[1]["refused"]
    assert "step 7: non-finite loss in samples b/p0/1:" in results[0]["refused"]
    assert all(r["unchanged"] for r in results)
    # Still in step: the next micro-batch trains and steps on both ranks.
    assert results[0]["norm"] == results[1]["norm"] and results[0]["norm"] > 0
