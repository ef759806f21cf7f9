"""Process lifetime, CPU class and memory shared by the processes the mesh starts: die with the
parent, yield the CPU to the work that matters more on a shared host, give back freed memory."""

from __future__ import annotations

import ctypes
import os
import re
import signal
from pathlib import Path

import structlog

log = structlog.get_logger()

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)
"""glibc's malloc_trim, looked up once among the symbols the process already has; None elsewhere."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send `sig` to this process when its parent (strictly: the thread that
    forked it) ends, so no child outlives the process that started it, even after a SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


_keeper_pid: int | None = None
"""In a helper a warm fork server's keeper forked (`kept_by`): the keeper's pid."""


def kept_by(keeper_pid: int) -> None:
    """Marks this process as a helper forked by the warm fork server's keeper `keeper_pid`, which is
    its parent in place of the process that asked for it and ends it once that process is gone."""
    global _keeper_pid
    _keeper_pid = keeper_pid


def parent_lives(parent_pid: int) -> bool:
    """After die_with_parent(): whether what ends this process with `parent_pid`, the process that
    started it, is still there: `parent_pid` as its parent or, in a helper forked for `parent_pid`
    by a keeper, that keeper. False: it died before the kernel's watch took effect, unseen."""
    return os.getppid() == (parent_pid if _keeper_pid is None else _keeper_pid)


def name_process(name: str) -> None:
    """Sets this process's name as /proc/<pid>/comm shows it (at most 15 bytes): how the mesh's
    processes are told apart, whether started by exec or forked from the fork server."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def effective_capabilities() -> int:
    """This process's effective capability set, as /proc/self/status shows it (bit n: capability n)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.MULTILINE)[1], 16)


CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
BACKGROUND_NICE = 19


class SessionPriority:
    """Moves this process's session (its autogroup) between its priority at start and the lowest,
    as the work at hand asks. Going back needs no privilege: only a nice below 0 does. Where the
    kernel has no autogroup or refuses the write, it stays where it is, said once in the log."""

    AUTOGROUP = Path("/proc/self/autogroup")

    def __init__(self) -> None:
        self.lowered = False
        self._normal = self.read()
        self.usable = self._normal is not None
        if not self.usable:
            log.info("this kernel shows no autogroup priority; background work runs at normal priority")

    @classmethod
    def read(cls) -> int | None:
        """The session's nice value, or None where the kernel shows no autogroup priority."""
        try:
            return int(cls.AUTOGROUP.read_text().rsplit("nice", 1)[1])
        except (OSError, IndexError, ValueError):
            return None

    def lower(self, lowered: bool) -> None:
        """Asks for the lowest priority or the one at start; a change the kernel defers is asked
        for again by the next call (the next decode step), so the session never stays low."""
        if lowered == self.lowered or not self.usable:
            return
        try:
            self.AUTOGROUP.write_text(str(BACKGROUND_NICE if lowered else self._normal))
            self.lowered = lowered
        except BlockingIOError:
            # Without CAP_SYS_ADMIN the kernel takes one autogroup change per 100 ms on the whole
            # host and answers EAGAIN to the rest: a rate limit, not a refusal.
            pass
        except OSError as exc:
            self.usable = False
            log.warning(
                "cannot change the session's CPU priority; background work runs at normal priority", error=str(exc)
            )


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
