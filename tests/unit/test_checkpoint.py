"""Checkpoints restore the policy, the optimizer and the step; incomplete ones are ignored."""

import torch

from rlmesh.models.loading import load_causal_lm, trainable_tensors
from services.trainer.checkpoint import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint


def test_save_and_resume(model_dir, tmp_path):
    model = load_causal_lm(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, model, optimizer, TrainerState(step=step, version=step + 1))
    (tmp_path / "step_000020").mkdir()  # a save that died before it finished
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_000015"
    assert sorted(p.name for p in tmp_path.glob("step_??????")) == ["step_000010", "step_000015", "step_000020"]

    restored = load_causal_lm(model_dir)
    restored_optimizer = torch.optim.Adam(restored.parameters(), lr=1e-3)
    state = load_checkpoint(latest, restored, restored_optimizer)
    assert (state.step, state.version) == (15, 16)
    for name, tensor in trainable_tensors(model).items():
        assert torch.equal(trainable_tensors(restored)[name], tensor)
    assert restored_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
