"""Freed heap memory goes back to the kernel when a process asks (glibc keeps it otherwise)."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import os
from rlmesh.lifecycle import return_freed_memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# Freeing a block glibc mapped on its own raises the size it serves from the heap to that block's,
# so the blocks below land on the heap, as a model's tensors of a few MiB do.
mapped = bytearray(30 << 20)
del mapped
blocks = [bytearray(4 << 20) for _ in range(200)]
# Every other block stays, so the freed ones are holes in the heap, not its top (which glibc trims).
kept = blocks[1::2]
start = resident()
del blocks
freed = resident()
return_freed_memory()
print(start, freed, resident())
"""


def test_freed_blocks_stay_resident_until_returned() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    start, freed, returned = (int(x) for x in out.split())
    mib = 1 << 20
    assert freed > start - 50 * mib, f"glibc returned the freed blocks by itself: {start // mib} -> {freed // mib} MiB"
    assert returned < freed - 300 * mib, (
        f"{freed // mib} MiB resident after freeing, {returned // mib} MiB after returning"
    )
