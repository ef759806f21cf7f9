"""The built-in models' folders: each is created on first use, by one process at a time, in a
staging folder renamed into place, so a run that starts beside another never reads half a model."""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rlmesh.models.families import is_model_dir


def ensure_model(
    model_dir: Path,
    create: Callable[[Path], object],
    name: str,
    announce: Callable[[str], None] = lambda line: print(line, flush=True),
) -> Path:
    """`model_dir`, made by `create(folder)` unless it already holds a whole model. A process that
    finds another creating it waits for that one instead of creating it a second time."""
    if is_model_dir(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with (model_dir.parent / f".{model_dir.name}.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            announce(f"waiting for another process creating the built-in model {name} in {model_dir}...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_model_dir(model_dir):
            return model_dir
        # A half-written folder at the path itself (creations before staging folders wrote there).
        shutil.rmtree(model_dir, ignore_errors=True)
        announce(f"creating the built-in model {name} in {model_dir} (random init + supervised warm-up)...")
        started = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
        try:
            create(staging)
            staging.rename(model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        announce(f"model ready in {time.perf_counter() - started:.0f} s")
    return model_dir
