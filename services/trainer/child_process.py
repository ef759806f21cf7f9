"""Rank 0's talk with the processes it starts (the reference worker, the episode process): each
message a pickle preceded by its length, over the child's stdin and stdout; and their ending."""

from __future__ import annotations

import asyncio
import pickle
import signal
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


async def end_child(process: asyncio.subprocess.Process, close_seconds: float) -> None:
    """Closes the child's stdin, which ends it; kills it if it does not exit within `close_seconds`."""
    if process.stdin is not None and not process.stdin.is_closing():
        process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), close_seconds)
    except TimeoutError:
        process.kill()
        await process.wait()


def how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
