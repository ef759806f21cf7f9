"""Process lifetime shared by every process the mesh starts: die with the parent."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send `sig` to this process when its parent (strictly: the thread that
    forked it) ends, so no child outlives the process that started it, even after a SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
