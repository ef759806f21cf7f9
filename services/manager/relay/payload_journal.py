"""A relay shard's payloads on disk: an append-only log of each attempt's start, every accepted chunk,
finishes and releases, flushed before each report, so a shard restarted on it holds every token it
reported and keeps its incarnation (the manager then has nothing to generate again)."""

from __future__ import annotations

import os
import secrets
import struct
from array import array
from pathlib import Path
from typing import BinaryIO

from rlmesh.atomic_file import write_atomically
from rlmesh.common.v1 import common_pb2
from services.manager.domain.records import FINISHED
from services.manager.relay.payloads import Payload

HEADER, START, CHUNK, FINISH, RELEASE = b"H", b"S", b"C", b"F", b"R"
_COUNT = struct.Struct("<I")
_START = struct.Struct("<II")
RESTARTED = "the relay shard restarted while the attempt ran"


def _text(value: str) -> bytes:
    data = value.encode()
    return _COUNT.pack(len(data)) + data


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise EOFError
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def count(self) -> int:
        return _COUNT.unpack(self.take(_COUNT.size))[0]

    def text(self) -> str:
        return self.take(self.count()).decode()

    def values(self, typecode: str, count: int) -> list:
        items = array(typecode)
        items.frombytes(self.take(count * items.itemsize))
        return items.tolist()


def replay(data: bytes) -> tuple[str, dict[str, Payload]]:
    """The incarnation and payloads a log holds. A record cut short by a crash ends the log; an
    attempt that had not finished is ended, to run again."""
    reader, incarnation, payloads = _Reader(data), "", {}
    while reader.at < len(data):
        start = reader.at
        try:
            kind = reader.take(1)
            if kind == HEADER:
                incarnation = reader.text()
            elif kind == START:
                request_id = reader.text()
                attempt, max_tokens = _START.unpack(reader.take(_START.size))
                payload = payloads.setdefault(request_id, Payload(request_id, attempt, max_tokens))
                payload.attempt, payload.max_tokens = attempt, max_tokens
                payload.continued_from = len(payload.token_ids)
                payload.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
            elif kind == CHUNK:
                request_id, count = reader.text(), reader.count()
                payload = payloads[request_id]
                payload.token_ids += reader.values("I", count)
                payload.logprobs += reader.values("f", count)
                payload.weight_versions += reader.values("q", count)
            elif kind == FINISH:
                request_id = reader.text()
                payloads[request_id].finish_reason = reader.take(1)[0]
            elif kind == RELEASE:
                payloads.pop(reader.text(), None)
            else:
                raise EOFError
        except (EOFError, KeyError, UnicodeDecodeError):
            reader.at = start
            break
    for payload in payloads.values():
        if payload.finish_reason not in FINISHED:
            payload.finish_reason, payload.ended, payload.code, payload.message = (
                common_pb2.FINISH_REASON_UNSPECIFIED,
                True,
                1,
                RESTARTED,
            )
    return incarnation, payloads


class PayloadJournal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        data = self.path.read_bytes() if self.path.is_file() else b""
        self.incarnation, self.payloads = replay(data)
        self.incarnation = self.incarnation or secrets.token_hex(8)
        self._compact()
        self._file: BinaryIO = self.path.open("ab")

    def _compact(self) -> None:
        """Rewrites the log as what it holds: released payloads and superseded records go."""
        parts = [HEADER + _text(self.incarnation)]
        for payload in self.payloads.values():
            parts.append(START + _text(payload.request_id) + _START.pack(payload.attempt, payload.max_tokens))
            parts.append(self._chunk(payload.request_id, payload.token_ids, payload.logprobs, payload.weight_versions))
            if payload.finish_reason in FINISHED:
                parts.append(FINISH + _text(payload.request_id) + bytes([payload.finish_reason]))
        write_atomically(self.path, b"".join(parts))

    @staticmethod
    def _chunk(request_id: str, token_ids, logprobs, weight_versions) -> bytes:
        return (
            CHUNK
            + _text(request_id)
            + _COUNT.pack(len(token_ids))
            + array("I", token_ids).tobytes()
            + array("f", logprobs).tobytes()
            + array("q", weight_versions).tobytes()
        )

    def started(self, payload: Payload) -> None:
        self._file.write(START + _text(payload.request_id) + _START.pack(payload.attempt, payload.max_tokens))

    def appended(self, request_id: str, token_ids, logprobs, weight_versions) -> None:
        self._file.write(self._chunk(request_id, token_ids, logprobs, weight_versions))

    def finished(self, payload: Payload) -> None:
        self._file.write(FINISH + _text(payload.request_id) + bytes([payload.finish_reason]))

    def released(self, request_id: str) -> None:
        self._file.write(RELEASE + _text(request_id))

    def flush(self) -> None:
        """Before a report: what the manager hears of is in the file (a killed process loses nothing
        written; the machine's crash is not covered)."""
        self._file.flush()

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
