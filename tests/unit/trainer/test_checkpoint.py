"""Checkpoints restore the policy, the optimizer and the step; incomplete ones are ignored; rows
saved by any number of ranks reassemble for any other."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.tp_layout import fsdp_rows
from services.trainer.ranks.checkpoint import (
    TrainerState,
    gather_rows,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


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
    assert {p.name for p in latest.glob("shards_rank*.pt")} == {"shards_rank0.pt"}


@settings(max_examples=200)
@given(
    rows=st.integers(0, 40), saved_world=st.integers(1, 6), loaded_world=st.integers(1, 6), columns=st.integers(1, 3)
)
def test_rows_saved_by_n_ranks_reassemble_for_m(rows, saved_world, loaded_world, columns):
    full = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns)
    pieces = []
    for rank in reversed(range(saved_world)):  # the files' order must not matter
        start, stop = fsdp_rows(rows, saved_world, rank)
        pieces.append(((start, stop), full[start:stop].clone()))
    for rank in range(loaded_world):
        wanted = fsdp_rows(rows, loaded_world, rank)
        assert torch.equal(gather_rows(pieces, wanted), full[wanted[0] : wanted[1]])


def test_rows_no_shard_holds_are_an_error():
    pieces = [((0, 4), torch.zeros(4, 2)), ((6, 8), torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="rows 4-6 are in no shard"):
        gather_rows(pieces, (2, 8))
    with pytest.raises(ValueError, match="rows 8-10 are in no shard"):
        gather_rows(pieces, (6, 10))
