"""The TCP backend: one plain connection per tensor-parallel rank carrying framed buckets. Raw
buckets are received straight into the rank's pre-faulted buffer (`recv_into`, no copy), so the
path costs what a bare socket costs; compressed buckets are decoded as they arrive; every bucket is
checked as soon as it is whole.

A connection first proves the push session: the rank sends a random nonce, the sender answers
HMAC-SHA256 under the session's secret (rlmesh.transfer.auth), and the rank answers one byte
(ACCEPTED) or closes the connection. Nothing a connection sends before that reaches a buffer.

Frame: a 41-byte header (magic, version, offset, raw length, encoded length, compression code,
base version), then the encoded bytes. An end frame (encoded length 0, raw length 0) asks the
receiver to answer with one status frame: ok flag, bytes landed, and an error message."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.transfer.auth import MAC_BYTES, NONCE_BYTES, PushSession, new_nonce, sender_session
from rlmesh.transfer.base import Frame, Superseded, TransferError, WeightSender, background_thread, finish_in_thread
from rlmesh.transfer.receiver import RankReceiver

log = structlog.get_logger()

MAGIC = b"RLW1"
HEADER = struct.Struct("<4sqQQQBq")
STATUS = struct.Struct("<?QI")
ACCEPTED = b"\x01"
CHALLENGE_TIMEOUT_SECONDS = 5.0
"""How long a connection may take to answer the challenge; a push answers in one round trip, and
each connection waits on a thread of its own, so a silent one holds up no push."""
SOCKET_BUFFER_BYTES = 512 << 10
"""Kernel socket buffers. Measured with 4 ranks receiving 2 GiB here: 512 KiB per connection
moves 4.0-4.4 GB/s, 4 MiB only 2.8-3.0 (the bytes in flight no longer stay in the CPU cache)."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        received = sock.recv_into(view)
        if received == 0:
            raise ConnectionError("the sender closed the connection mid-frame")
        view = view[received:]


class _Refused(Exception):
    """A connection did not prove the push session; the reason is logged."""


class TcpListener:
    """Accepts connections for one rank's receiver; each connection proves the push session, then
    carries one version's buckets."""

    def __init__(
        self,
        host: str,
        receiver: RankReceiver,
        advertise_host: str = "",
        challenge_timeout: float = CHALLENGE_TIMEOUT_SECONDS,
    ) -> None:
        """Binds `host` on a free port; peers are told `advertise_host` (default: `host`)."""
        self.receiver = receiver
        self.challenge_timeout = challenge_timeout
        self._server = socket.create_server((host, 0))
        self.address = f"{advertise_host or host}:{self._server.getsockname()[1]}"
        self._scratch = bytearray()
        self._one_transfer = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-rank{receiver.rank}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        if self.receiver.background:
            background_thread()
        while not self._closed:
            try:
                connection, peer = self._server.accept()
            except OSError:
                return
            threading.Thread(
                target=self._handle, args=(connection, peer), name=f"tcp-rank{self.receiver.rank}-conn", daemon=True
            ).start()

    def _handle(self, connection: socket.socket, peer: tuple) -> None:
        if self.receiver.background:
            background_thread()
        with connection:
            _tune(connection)
            try:
                session = self._authenticate(connection)
                # One transfer at a time per rank: a newer version's connection waits for the older one.
                with self._one_transfer:
                    self._serve(connection, session)
            except _Refused as exc:
                log.warning(
                    "weight connection refused: it did not prove the push session",
                    rank=self.receiver.rank,
                    peer=f"{peer[0]}:{peer[1]}",
                    reason=str(exc),
                )
            except (ConnectionError, OSError) as exc:
                log.warning("weight transfer connection broke", rank=self.receiver.rank, error=str(exc))

    def _authenticate(self, connection: socket.socket) -> PushSession:
        session = self.receiver.session
        nonce = new_nonce()
        answer = bytearray(MAC_BYTES)
        connection.settimeout(self.challenge_timeout)
        try:
            connection.sendall(nonce)
            _recv_exactly(connection, memoryview(answer))
        except TimeoutError as exc:
            raise _Refused(f"no answer to the challenge within {self.challenge_timeout} s") from exc
        except ConnectionError as exc:
            raise _Refused(f"closed before answering the challenge ({exc})") from exc
        if session is None:
            raise _Refused("no push session is open on this rank")
        if not session.accepts(nonce, bytes(answer)):
            raise _Refused(f"wrong answer to the challenge for version {session.version}")
        connection.settimeout(None)
        connection.sendall(ACCEPTED)
        return session

    def _serve(self, connection: socket.socket, session: PushSession) -> None:
        header = bytearray(HEADER.size)
        landed, error = 0, ""
        while True:
            _recv_exactly(connection, memoryview(header))
            magic, version, offset, raw_bytes, encoded_bytes, compression, base_version = HEADER.unpack(header)
            if magic != MAGIC:
                raise ConnectionError(f"not a weight frame (magic {magic!r})")
            if encoded_bytes == 0 and raw_bytes == 0:
                message = error.encode()[:65535]
                connection.sendall(STATUS.pack(not error, landed, len(message)) + message)
                return
            if error:
                self._drain(connection, encoded_bytes)
                continue
            consumed = False
            try:
                if self.receiver.session is not session:
                    raise TransferError(
                        f"the push session this connection proved (version {session.version}) was superseded"
                    )
                if compression in (common_pb2.COMPRESSION_NONE, common_pb2.COMPRESSION_UNSPECIFIED):
                    if encoded_bytes != raw_bytes:
                        raise TransferError(f"raw frame of {encoded_bytes} bytes declares {raw_bytes}")
                    target = self.receiver.view(version, offset, raw_bytes)
                    consumed = True
                    _recv_exactly(connection, target)
                    # Checked on this thread while the bucket is still in the CPU cache: queued for
                    # the verifier it was often read again from memory, which generating engines
                    # share (generation during pushes, four runs each: 0.87x on average that way,
                    # 0.92x so; the runs overlap).
                    self.receiver.landed(version, offset, raw_bytes, check_now=True)
                else:
                    if len(self._scratch) < encoded_bytes:
                        self._scratch = bytearray(encoded_bytes)
                    blob = memoryview(self._scratch)[:encoded_bytes]
                    consumed = True
                    _recv_exactly(connection, blob)
                    self.receiver.write(version, offset, blob, compression, raw_bytes, base_version)
                landed += raw_bytes
            except TransferError as exc:
                # The rest of the stream is read and dropped so the sender gets the reason.
                error = str(exc)
                if not consumed:
                    self._drain(connection, encoded_bytes)

    @staticmethod
    def _drain(connection: socket.socket, nbytes: int) -> None:
        sink = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            chunk = sink[: min(nbytes, len(sink))]
            _recv_exactly(connection, chunk)
            nbytes -= len(chunk)

    def close(self) -> None:
        self._closed = True
        self._server.close()


def send_frames(
    address: str,
    session: PushSession,
    frames: Iterable[Frame],
    timeout: float,
    cancelled: Callable[[], bool] = lambda: False,
) -> int:
    """Proves `session` to a rank, sends its version's frames and waits for its status; returns
    bytes landed. Blocking: run it on a thread. `cancelled` is polled between frames (a newer version)."""
    version = session.version
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            _tune(sock)
            nonce = bytearray(NONCE_BYTES)
            _recv_exactly(sock, memoryview(nonce))
            sock.sendall(session.answer(bytes(nonce)))
            if sock.recv(len(ACCEPTED)) != ACCEPTED:
                raise TransferError(
                    f"rank at {address} refused the answer to its challenge for version {version} "
                    "(a push session it no longer holds)"
                )
            for offset, raw_bytes, compression, base_version, data in frames:
                if cancelled():
                    raise Superseded(f"push of version {version} was superseded")
                sock.sendall(HEADER.pack(MAGIC, version, offset, raw_bytes, len(data), compression, base_version))
                sock.sendall(data)
            sock.sendall(HEADER.pack(MAGIC, version, 0, 0, 0, 0, -1))
            status = bytearray(STATUS.size)
            _recv_exactly(sock, memoryview(status))
            ok, landed, length = STATUS.unpack(status)
            message = bytearray(length)
            _recv_exactly(sock, memoryview(message))
    except OSError as exc:
        # A rank that died or was cut off mid-push: a failed push the pusher retries with backoff.
        raise TransferError(f"connection to the rank at {address} failed during version {version}: {exc}") from exc
    if not ok:
        raise TransferError(f"rank at {address} refused version {version}: {message.decode()}")
    return landed


class TcpSender(WeightSender):
    backend = rollout_pb2.TRANSFER_BACKEND_TCP

    def __init__(self, background: bool = False) -> None:
        """`background`: send on idle-class threads."""
        self._threads = ThreadPoolExecutor(
            thread_name_prefix="tcp-send", initializer=background_thread if background else None
        )

    async def send_rank(
        self,
        stub: rollout_pb2_grpc.RolloutServiceStub,
        endpoint: rollout_pb2.RankEndpoint,
        manifest: common_pb2.WeightManifest,
        payload: torch.Tensor,
        frames: Iterable[Frame],
        timeout: float,
        cancelled: Callable[[], bool],
    ) -> bytes:
        if not endpoint.data_address:
            raise TransferError(f"rank {endpoint.tp_rank} offered no TCP data address")
        session = sender_session(endpoint, manifest.version)
        landed = await finish_in_thread(
            send_frames, endpoint.data_address, session, frames, timeout, cancelled, executor=self._threads
        )
        if landed != manifest.total_bytes:
            raise TransferError(f"rank {endpoint.tp_rank} landed {landed} of {manifest.total_bytes} bytes")
        return b""

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
