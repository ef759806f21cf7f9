"""PPO's critic on two FSDP ranks (a gloo process group) computes what one rank computes: the values,
GAE's advantages whitened over the whole micro-batch, the value loss and the critic's update,
including for a micro-batch of one sample, which leaves the second rank idle (its forwards and
all-reduces must still match the first's). The ranks run tests/integration/trainer/critic_ranks_worker.py."""

from __future__ import annotations

import json

import pytest
import torch

WORKER = "tests.integration.trainer.critic_ranks_worker"


def train(rank_runner, model_dir, folder, ranks: int) -> list[dict]:
    folder.mkdir()
    spec = {"model_dir": str(model_dir), "output_dir": str(folder), "result": str(folder / "result-{rank}.pt")}
    (folder / "spec.json").write_text(json.dumps(spec))
    rank_runner.run(WORKER, [str(folder / "spec.json")], ranks, folder, timeout=180)
    return [torch.load(spec["result"].format(rank=r), weights_only=False) for r in range(ranks)]


def test_two_ranks_train_the_critic_as_one_rank_does(rank_runner, model_dir, tmp_path):
    one = train(rank_runner, model_dir, tmp_path / "one", 1)[0]
    two = train(rank_runner, model_dir, tmp_path / "two", 2)
    assert two[0]["stats"] == two[1]["stats"], "the figures are merged over the ranks"
    # Float32 sums over the ranks' shares come in another order than one rank's: equal to rounding.
    for index, (alone, shared) in enumerate(zip(one["stats"], two[0]["stats"])):
        assert shared.critic.tokens == alone.critic.tokens
        assert shared.critic.as_list() == pytest.approx(alone.critic.as_list(), rel=1e-4, abs=1e-6), (
            f"micro-batch {index}"
        )
        assert shared.loss == pytest.approx(alone.loss, rel=1e-4, abs=1e-6), f"micro-batch {index}"
    for name, value in one["critic"].items():
        torch.testing.assert_close(two[0]["critic"][name], value, rtol=1e-4, atol=1e-5, msg=name)
