"""The trainer's process group: N ranks under torchrun, or one rank that forms its own group, so
one code path serves every N. Also the one thread per rank that runs all blocking torch work."""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from rlmesh.lifecycle import die_with_parent

log = structlog.get_logger()

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: dist.ProcessGroup | None
    """A gloo group for commands and small objects (None: the default group, already gloo)."""
    checkpointing: dist.ProcessGroup | None = None
    """A gloo group only background checkpoint writes use (None: one process, no collectives)."""
    publishing: dist.ProcessGroup | None = None
    """A gloo group only background publishes use, to agree on each upload's outcome."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(backend: str, timeout_seconds: float) -> RankInfo:
    """Joins the torchrun group (env://) or, alone, forms a one-rank gloo group on an in-process store."""
    timeout = timedelta(seconds=timeout_seconds)
    use_cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("distributed_backend is nccl but CUDA is not available")
    # Collectives of tensors on the GPU go through NCCL; commands (pickled objects) through gloo.
    pg_backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if under_torchrun():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(pg_backend, timeout=timeout)
    else:
        # One rank needs no rendezvous: an in-process store, no port to pick.
        local_rank = 0
        dist.init_process_group(pg_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else None
    checkpointing = dist.new_group(backend="gloo", timeout=timeout)
    publishing = dist.new_group(backend="gloo", timeout=timeout)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, control, checkpointing, publishing)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_agent() -> None:
    """A torchrun worker gets SIGTERM if the torchrun agent dies (even by SIGKILL), so no rank
    outlives the process `rlmesh up` stops."""
    if not under_torchrun():
        return
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class TorchThread:
    """Runs every blocking torch call and collective of this rank, one at a time in submission
    order, off the asyncio loop. A daemon thread: a process that stops while a collective waits
    on a vanished peer still exits. Calls see the caller's structlog context (the rank)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="torch", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn(*args) on the thread. If the awaiting task is cancelled the call still runs to
        its end (torch work cannot be interrupted); its result is dropped."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, args, future, loop, contextvars.copy_context()))
        return await future

    def close(self, timeout: float = 10.0) -> None:
        """Ends the thread after the calls queued so far and waits for it: a thread still
        unwinding torch's thread-local state while the process exits can abort it. A thread
        stuck in a collective (a peer vanished) is left behind after `timeout`."""
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, future, loop, context = item
            try:
                outcome: tuple[bool, Any] = (True, context.run(fn, *args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                outcome = (False, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if future.done():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
