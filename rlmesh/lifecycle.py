"""Process lifetime, CPU class and memory shared by the processes the mesh starts: die with the
parent, yield the CPU to the work that matters more on a shared host, give back freed memory."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import structlog

log = structlog.get_logger()

_PR_SET_PDEATHSIG = 1
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)
"""glibc's malloc_trim, looked up once among the symbols the process already has; None elsewhere."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send `sig` to this process when its parent (strictly: the thread that
    forked it) ends, so no child outlives the process that started it, even after a SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


BACKGROUND_NICE = 19


def background_process() -> None:
    """Gives this process the least CPU share: nice 19 for the threads it starts from now on and,
    where the kernel groups each session's processes (autogroup) and weighs the groups against
    each other, for its group too, since per-thread nice counts only inside the group."""
    os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    autogroup = Path("/proc/self/autogroup")
    if autogroup.exists():
        try:
            autogroup.write_text(str(BACKGROUND_NICE))
        except OSError as exc:
            log.warning("cannot lower the autogroup's priority; the process competes at its session's", error=str(exc))


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the kernel (glibc's malloc_trim). A rank that loads the
    full model and keeps its shards frees tensors of a few MiB each, which glibc otherwise keeps:
    a tensor-parallel rank of the 1 GiB bench model held 2.2 GB instead of 1.45 GB, and the weights
    bench (4 such ranks, the weights service, 2 trainer ranks) ran this 24 GiB machine out of
    memory. A no-op where the C library is not glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
