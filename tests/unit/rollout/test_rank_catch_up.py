"""On a delta link, a rank's standby copy catches up with the served version after each switch:
not at once (the other instances are likely still receiving the same version, and the copy would
compete with them for memory bandwidth), but after a delay, or as soon as the next version begins."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from rlmesh.transfer.payload import pack, unpack
from services.rollout.torch.rank import RankTransfer, RankWeights, build_rank
from services.rollout.torch.tp_model import Collectives


@pytest.fixture
def rank(model_dir, request):
    transfer = dataclasses.replace(RankTransfer(), background=False, catch_up_delay_seconds=request.param)
    runner, weights = build_rank(model_dir, Collectives.single(), transfer, version=0)
    yield runner, weights
    weights.close()


def land_and_switch(runner, weights: RankWeights, version: int, keep_base: bool = True) -> None:
    """Receives a version with every value moved into the standby copy, as a push does, and serves it."""
    served = unpack(weights.standby.manifest, weights.standby.buffer.tensor)
    manifest, payload = pack({name: t + 0.25 * version for name, t in served.items()}, version)
    weights.prepare(manifest, load=True, after_version=runner.version, keep_base=keep_base)
    weights.write(version, 0, payload.numpy().tobytes())
    assert weights.verify(version, timeout=10) == []
    weights.finish(version)
    runner.switch(version)


def slot_bytes(weights: RankWeights, model) -> torch.Tensor:
    slot = weights._slots[id(model)]
    return slot.buffer.tensor[: slot.manifest.total_bytes]


@pytest.mark.parametrize("rank", [60.0], indirect=True)
def test_the_catch_up_waits_its_delay_but_not_past_the_next_version(rank):
    runner, weights = rank
    land_and_switch(runner, weights, 1)
    time.sleep(0.5)
    assert weights.standby.held_version != 1
    assert not torch.equal(slot_bytes(weights, runner.standby), slot_bytes(weights, runner.active))

    next_manifest, _ = pack(unpack(weights.standby.manifest, weights.standby.buffer.tensor), 2)
    started = time.monotonic()
    port = weights.prepare(next_manifest, load=True, after_version=1, keep_base=True)
    # The next version needs the base now: it did not wait out the 60 s.
    assert time.monotonic() - started < 30
    assert port.held_version == 1
    assert torch.equal(slot_bytes(weights, runner.standby), slot_bytes(weights, runner.active))


@pytest.mark.parametrize("rank", [0.0], indirect=True)
def test_without_a_delay_the_standby_copy_catches_up_on_its_own(rank):
    runner, weights = rank
    land_and_switch(runner, weights, 1)
    deadline = time.monotonic() + 30
    while weights.standby.held_version != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert weights.standby.held_version == 1
    assert torch.equal(slot_bytes(weights, runner.standby), slot_bytes(weights, runner.active))


@pytest.mark.parametrize("rank", [0.0], indirect=True)
def test_a_raw_link_keeps_no_copy(rank):
    runner, weights = rank
    land_and_switch(runner, weights, 1, keep_base=False)
    time.sleep(0.3)
    assert weights.standby.held_version != 1
