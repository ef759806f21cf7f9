"""A rollout instance split over TP ranks (the integration `instance` fixture): what it must
serve, the payloads each rank receives, and a weight update driven through its API step by step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.models.tp_layout import ModelShape, shard_full_tensors
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.payload import pack
from services.rollout.torch.engine import TorchEngine
from tests.support.engines import greedy_outputs
from tests.support.samples import DIGIT_PROMPTS

TP = 2
"""Ranks of the tensor-parallel instances and trainers in these tests."""
TCP = rollout_pb2.TRANSFER_BACKEND_TCP


@dataclass
class TpInstance:
    """A rollout instance split over TP ranks (the `instance` fixture), and what it must serve."""

    model_dir: object
    rollout: object
    stub: rollout_pb2_grpc.RolloutServiceStub
    reference: TorchEngine
    """One process, same weights: what the split instance must decode."""
    served: dict[str, torch.Tensor]
    """Full tensors of the version the instance serves."""
    held: list[tuple[common_pb2.WeightManifest, torch.Tensor]] = field(default_factory=list)
    """Each rank's payload of that version, as its buffer holds it."""
    version: int = 0

    @property
    def engine(self):
        return self.rollout.engine

    def prompts(self) -> list[list[int]]:
        tokenizer = load_tokenizer(self.model_dir)
        return [tokenizer.encode(t).ids for t in DIGIT_PROMPTS]


def rank_payloads(weights, model_dir, version: int, bucket_bytes: int = 64 << 10):
    """What the weights service sends each rank: only that rank's tensors, packed."""
    shape = ModelShape.from_hf_config(load_causal_lm(model_dir).config)
    payloads = []
    for rank in range(TP):
        manifest, payload = pack(shard_full_tensors(weights, shape, TP, rank), version, bucket_bytes)
        manifest.tensor_parallel_size, manifest.tensor_parallel_rank = TP, rank
        payloads.append((manifest, payload))
    return payloads


async def begin_update(instance, payloads, backend, link=common_pb2.COMPRESSION_NONE):
    request = rollout_pb2.BeginWeightUpdateRequest(
        rank_manifests=[m for m, _ in payloads], backend=backend, link_compression=link
    )
    return await instance.stub.BeginWeightUpdate(request, timeout=10)


async def send_all(sender, instance, reply, payloads, frames) -> list[bytes]:
    """Each rank's commit proof (empty unless the sender proves commits)."""
    assert [r.tp_rank for r in reply.ranks] == list(range(TP))
    return await asyncio.gather(
        *(
            sender.send_rank(instance.stub, endpoint, m, p, frames(m, p), 30, lambda: False)
            for endpoint, (m, p) in zip(reply.ranks, payloads)
        )
    )


async def commit_version(instance, version, weights, payloads, proofs=()) -> None:
    reply = await instance.stub.CommitWeightUpdate(
        rollout_pb2.CommitWeightUpdateRequest(version=version, rank_proofs=proofs), timeout=30
    )
    assert reply.weight_version == version
    instance.version, instance.served, instance.held = version, weights, payloads
    await asyncio.to_thread(instance.reference.stage_weights, version, weights)
    await instance.reference.commit_staged(version)


async def assert_serves_the_reference(instance, tag):
    prompts = instance.prompts()
    expected = await greedy_outputs(instance.reference, prompts, f"{tag}-reference")
    for (tokens, logprobs, versions), (want, want_logprobs, _) in zip(
        await greedy_outputs(instance.engine, prompts, tag), expected
    ):
        assert tokens == want
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        assert set(versions) == {instance.version}
