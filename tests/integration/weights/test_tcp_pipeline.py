"""One rank's TCP link, bucket by bucket: the receiving rank checks each bucket as it lands, while
the sender is still sending the next ones (receiving, checking and sending overlap)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rlmesh.launch.ports import free_port
from rlmesh.transfer.auth import PushSession, new_secret
from rlmesh.transfer.base import ReceiveBuffer, TransferError, raw_frames
from rlmesh.transfer.payload import pack
from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import TcpListener, send_frames
from services.weights.store import RankPayload
from tests.support.waiting import wait_until

BUCKET_BYTES = 64 << 10
BUCKETS = 8
WAIT_SECONDS = 30
SECRET = new_secret()


def payload(version: int) -> RankPayload:
    torch.manual_seed(version)
    tensors = {f"w{i}": torch.randn(BUCKET_BYTES // 4 // 128, 128) for i in range(BUCKETS)}
    return RankPayload(*pack(tensors, version, bucket_bytes=BUCKET_BYTES))


def armed_rank(rank: RankPayload) -> tuple[RankReceiver, TcpListener, ReceiveBuffer]:
    receiver = RankReceiver(0)
    listener = TcpListener("127.0.0.1", receiver)
    buffer = ReceiveBuffer()
    buffer.ensure(rank.manifest.total_bytes)
    receiver.prepare(rank.manifest, buffer, -1, SECRET)
    return receiver, listener, buffer


def test_each_bucket_is_checked_as_it_lands_while_the_rest_is_still_being_sent() -> None:
    rank = payload(3)
    receiver, listener, buffer = armed_rank(rank)
    release = threading.Event()

    def first_bucket_then_the_rest():
        for index, frame in enumerate(raw_frames(rank.manifest, rank.payload)):
            yield frame
            if index == 0:
                assert release.wait(WAIT_SECONDS)

    version = rank.manifest.version
    landed: list[int] = []
    sending = threading.Thread(
        target=lambda: landed.append(
            send_frames(listener.address, PushSession(SECRET, version, 0), first_bucket_then_the_rest(), WAIT_SECONDS)
        )
    )
    sending.start()
    try:
        wait_until(
            lambda: receiver.progress() == (1, BUCKETS),
            WAIT_SECONDS,
            "the first bucket checked while the others are held",
            interval=0.01,
        )
    finally:
        release.set()
        sending.join()
        listener.close()
    assert landed == [rank.manifest.total_bytes]
    assert receiver.wait_verified(version, WAIT_SECONDS) == []
    assert np.array_equal(buffer.tensor[: rank.manifest.total_bytes].numpy(), rank.payload.numpy())


def test_a_rank_gone_mid_push_is_a_transfer_error_the_pusher_retries():
    """A refused or reset connection surfaces as TransferError (counted, backed off), not a bare OSError."""
    rank = payload(4)
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(TransferError, match=f"connection to the rank at {address} failed during version 4"):
        send_frames(address, PushSession(SECRET, 4, 0), raw_frames(rank.manifest, rank.payload), WAIT_SECONDS)
