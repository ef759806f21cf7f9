"""Files written whole: under a temporary name of their own in the same folder, with their final
mode and synced to disk, then renamed into place, so that a process reading meanwhile (a service
starting, a server reloading) never sees half a file and writers of the same file at once never
share a temporary one: the last rename wins, whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path | str, data: bytes | str, mode: int = 0o644) -> None:
    """Replaces `path` with `data` (text is written as UTF-8), the file's permissions exactly `mode`."""
    path = Path(path)
    content = data.encode() if isinstance(data, str) else data
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as file:
            # Before a byte is written: a secret (0o600) is never readable by others, even briefly.
            os.fchmod(file.fileno(), mode)
            file.write(content)
            file.flush()
            # A crash after the rename must not leave the new name pointing at an empty file.
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
