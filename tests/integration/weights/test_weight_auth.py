"""The weights data plane accepts only the push session's writers, on a real two-rank instance:
TCP connections that do not answer the rank's challenge with the session's secret are closed
before a byte lands, and bytes injected through the Mooncake transfer engine (crc32 intact) make
the commit be refused; either way the instance keeps its version and the real push then commits."""

import asyncio
import socket

import grpc
import numpy as np
import pytest
import structlog

from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.transfer.auth import NONCE_BYTES, PushSession, new_secret
from rlmesh.transfer.base import TransferError, raw_frames
from rlmesh.transfer.mooncake import MooncakeEndpoint, MooncakeSender
from rlmesh.transfer.payload import crc32
from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import HEADER, MAGIC, TcpListener, TcpSender
from tests.support.engines import greedy_outputs
from tests.support.tensors import perturbed_weights
from tests.support.tp_instances import (
    TCP,
    assert_serves_the_reference,
    begin_update,
    commit_version,
    rank_payloads,
    send_all,
)

on_the_instance_loop = pytest.mark.asyncio(loop_scope="module")
MOONCAKE = rollout_pb2.TRANSFER_BACKEND_MOONCAKE


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def challenged(address: str) -> tuple[socket.socket, bytes]:
    sock = connect(address)
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        nonce += sock.recv(NONCE_BYTES - len(nonce))
    return sock, nonce


def closed_by_the_rank(sock: socket.socket) -> bool:
    """The rank hung up without accepting: no ACCEPTED byte, only the end of the stream."""
    with sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


async def next_version(instance, tag: str):
    """What the instance decodes now, and the next version: its number, weights and rank payloads."""
    before = await greedy_outputs(instance.engine, instance.prompts(), f"before-{tag}")
    version = instance.version + 1
    weights = perturbed_weights(instance.served, version)
    return before, version, weights, rank_payloads(weights, instance.model_dir, version)


async def assert_still_serves(instance, before, tag: str) -> None:
    info = await instance.stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=5)
    assert info.weight_version == instance.version
    assert await greedy_outputs(instance.engine, instance.prompts(), f"after-{tag}") == before


def forged_bucket(data: np.ndarray) -> np.ndarray:
    """`data` with some of its first 64 bits flipped so that its crc32 stays the same: crc32 is
    affine, so flips whose contributions cancel out are invisible to it (not to the commit MAC)."""
    zero = crc32(bytes(len(data)))
    basis: dict[int, tuple[int, int]] = {}
    for bit in range(64):
        flip = bytearray(len(data))
        flip[bit // 8] = 1 << (bit % 8)
        vector, flips = crc32(bytes(flip)) ^ zero, 1 << bit
        while vector and vector.bit_length() - 1 in basis:
            pivot_vector, pivot_flips = basis[vector.bit_length() - 1]
            vector, flips = vector ^ pivot_vector, flips ^ pivot_flips
        if not vector:
            break
        basis[vector.bit_length() - 1] = (vector, flips)
    forged = data.copy()
    for bit in range(64):
        if flips >> bit & 1:
            forged[bit // 8] ^= 1 << (bit % 8)
    assert crc32(forged) == crc32(data) and not np.array_equal(forged, data)
    return forged


def test_every_mac_is_bound_to_its_secret_version_and_rank():
    secret, nonce, tags = new_secret(), b"n" * NONCE_BYTES, [b"a" * 16, b"b" * 16]
    session = PushSession(secret, 5, 1)
    assert session.accepts(nonce, session.answer(nonce))
    for other in (PushSession(new_secret(), 5, 1), PushSession(secret, 6, 1), PushSession(secret, 5, 0)):
        assert not session.accepts(nonce, other.answer(nonce))
        assert not session.proves(tags, other.commit_proof(tags))
    assert not session.proves([tags[0], b"c" * 16], session.commit_proof(tags))
    assert session.bucket_tag(0, b"x") != session.bucket_tag(1, b"x")
    with pytest.raises(TransferError, match="32 bytes, not 3"):
        PushSession(b"abc", 5, 1)


def test_a_connection_silent_past_the_deadline_is_closed_and_logged():
    receiver = RankReceiver(0)
    listener = TcpListener("127.0.0.1", receiver, challenge_timeout=0.2)
    try:
        with structlog.testing.capture_logs() as logs:
            silent, _ = challenged(listener.address)
            assert closed_by_the_rank(silent)
        assert [e["reason"] for e in logs if "refused" in e["event"]] == ["no answer to the challenge within 0.2 s"]
    finally:
        listener.close()
        receiver.close()


@on_the_instance_loop
async def test_tcp_connections_without_the_session_answer_are_refused_and_the_push_still_commits(instance):
    before, version, weights, payloads = await next_version(instance, "tcp")
    reply = await begin_update(instance, payloads, TCP)
    rank0, rank1 = reply.ranks
    assert len(rank0.session_secret) == len(rank1.session_secret) == 32 and rank0.session_secret != rank1.session_secret
    bucket = bytes(payloads[0][0].bucket_bytes)
    frame = HEADER.pack(MAGIC, version, 0, len(bucket), len(bucket), 0, -1) + bucket

    def attack() -> list[bool]:
        refused = []
        for address, answer in (
            (rank0.data_address, lambda nonce: new_secret() + frame),  # a wrong MAC
            (
                rank0.data_address,
                lambda nonce: PushSession(rank0.session_secret, version + 1, 0).answer(nonce),
            ),  # another version
            (
                rank0.data_address,
                lambda nonce: PushSession(rank1.session_secret, version, 0).answer(nonce),
            ),  # another rank's secret
            (rank0.data_address, lambda nonce: frame),  # no answer: frames at once
            (rank1.data_address, lambda nonce: new_secret() + frame),
        ):
            sock, nonce = challenged(address)
            try:
                sock.sendall(answer(nonce))
            except ConnectionError:
                pass
            refused.append(closed_by_the_rank(sock))
        garbage, _ = challenged(rank0.data_address)
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n")
        garbage.shutdown(socket.SHUT_WR)
        refused.append(closed_by_the_rank(garbage))
        return refused

    with structlog.testing.capture_logs() as logs:
        assert await asyncio.to_thread(attack) == [True] * 6
    reasons = [e["reason"] for e in logs if e["event"].startswith("weight connection refused")]
    assert len(reasons) == 5 and sum("wrong answer" in r for r in reasons) == 4, reasons
    assert instance.engine.ranks[0].receiver.progress() == (0, len(payloads[0][0].bucket_crc32))
    await assert_still_serves(instance, before, "tcp")

    # A connection that holds its challenge unanswered holds up no push.
    silent, _ = await asyncio.to_thread(challenged, rank0.data_address)
    with silent:
        await send_all(TcpSender(), instance, reply, payloads, raw_frames)
        await commit_version(instance, version, weights, payloads)
    await assert_serves_the_reference(instance, "tcp-after-attack")


@on_the_instance_loop
async def test_bytes_injected_through_the_transfer_engine_make_the_commit_refused(instance):
    before, version, weights, payloads = await next_version(instance, "mooncake")
    bucket_bytes = payloads[1][0].bucket_bytes
    reply = await begin_update(instance, payloads, MOONCAKE)
    proofs = await send_all(MooncakeSender(MooncakeEndpoint()), instance, reply, payloads, raw_frames)
    # An attacker with its own transfer engine overwrites bucket 1 of rank 1 (a worker process)
    # with bytes whose crc32 is the manifest's, after the push and before its commit.
    attacker = MooncakeEndpoint()
    injected = payloads[1][1].clone()
    injected.numpy()[bucket_bytes : 2 * bucket_bytes] = forged_bucket(injected[bucket_bytes : 2 * bucket_bytes].numpy())
    attacker.register(injected)
    target = reply.ranks[1]

    def inject() -> None:
        attacker.write(
            target.transfer_session, injected.data_ptr(), target.buffer_address, [(bucket_bytes, 2 * bucket_bytes)]
        )

    await asyncio.to_thread(inject)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await instance.stub.CommitWeightUpdate(
            rollout_pb2.CommitWeightUpdateRequest(version=version, rank_proofs=proofs), timeout=30
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "rank 1" in caught.value.details() and "not all the push session's" in caught.value.details()
    assert f"version {instance.version} is still served" in caught.value.details()
    await assert_still_serves(instance, before, "mooncake")
    # Once its commit began, the buffer is out of the engine's reach.
    with pytest.raises(TransferError, match="failed with status"):
        await asyncio.to_thread(inject)

    # A commit without proofs proves nothing.
    reply = await begin_update(instance, payloads, MOONCAKE)
    await send_all(MooncakeSender(MooncakeEndpoint()), instance, reply, payloads, raw_frames)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await instance.stub.CommitWeightUpdate(rollout_pb2.CommitWeightUpdateRequest(version=version), timeout=30)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED and "carries no proof" in caught.value.details()

    reply = await begin_update(instance, payloads, MOONCAKE)
    proofs = await send_all(MooncakeSender(MooncakeEndpoint()), instance, reply, payloads, raw_frames)
    await commit_version(instance, version, weights, payloads, proofs)
    await assert_serves_the_reference(instance, "mooncake-after-attack")
    # The buffer just switched to is served, and no transfer engine may write it.
    target = reply.ranks[1]
    with pytest.raises(TransferError, match="failed with status"):
        await asyncio.to_thread(inject)
