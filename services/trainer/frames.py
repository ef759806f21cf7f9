"""The framing of rank 0's talk with the processes it starts (the reference worker, the episode
process): each message a pickle preceded by its length, over a pipe."""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any, BinaryIO

FRAME_HEADER = struct.Struct("<Q")


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(payload)) + payload


def read_frame(stream: BinaryIO) -> Any | None:
    """The next message; None at end of stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return pickle.loads(payload)


def write_frame(stream: BinaryIO, message: Any) -> None:
    stream.write(frame(message))
    stream.flush()


async def next_frame(reader: asyncio.StreamReader) -> Any | None:
    """The next message; None at end of stream."""
    try:
        header = await reader.readexactly(FRAME_HEADER.size)
        return pickle.loads(await reader.readexactly(FRAME_HEADER.unpack(header)[0]))
    except asyncio.IncompleteReadError:
        return None
