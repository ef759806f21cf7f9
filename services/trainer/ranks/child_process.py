"""Rank 0's talk with the processes it starts (the reference worker, the episode process): their
start, each message a pickle preceded by its length over the child's stdin and stdout, their ending."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

from rlmesh.forking.helpers import AsyncWarmHelper, start_async_helper

FRAME_HEADER = struct.Struct("<Q")
ChildProcess = asyncio.subprocess.Process | AsyncWarmHelper


async def start_child(module: str, *args: str) -> ChildProcess:
    """`python -m module args...` with pipes on its stdin and stdout, its stderr this process's:
    forked by the warm fork server where one serves this process, else exec'd."""
    return await start_async_helper(module, list(args), dict(os.environ)) or await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )


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


async def end_child(process: ChildProcess, close_seconds: float) -> None:
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
