"""One atomic-file writer: writers of the same file at once leave one of their contents whole and no
temporary file behind; the file has its mode before it has its name; a failed write leaves the old
file as it was."""

import os
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh import atomic_file
from rlmesh.atomic_file import write_atomically

contents = st.one_of(st.binary(max_size=200_000), st.text(max_size=2_000))


def as_bytes(content: bytes | str) -> bytes:
    return content.encode() if isinstance(content, str) else content


@settings(max_examples=30, deadline=None)
@given(st.lists(contents, min_size=2, max_size=8), st.sampled_from([0o600, 0o640, 0o644]))
def test_concurrent_writers_leave_one_whole_content_and_no_temporary_file(writes, mode):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mesh.json"
        path.write_bytes(b"the old content")
        start = threading.Barrier(len(writes))
        failures: list[BaseException] = []

        def write(content: bytes | str) -> None:
            start.wait()
            try:
                write_atomically(path, content, mode)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                failures.append(exc)

        threads = [threading.Thread(target=write, args=(content,)) for content in writes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        assert path.read_bytes() in {as_bytes(content) for content in writes}
        assert os.listdir(folder) == ["mesh.json"]
        assert stat.S_IMODE(path.stat().st_mode) == mode


def test_the_mode_is_exact_whatever_the_umask(tmp_path):
    previous = os.umask(0o077)
    try:
        write_atomically(tmp_path / "ca.pem", "certificate", 0o644)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "ca.pem").stat().st_mode) == 0o644
    assert (tmp_path / "ca.pem").read_text() == "certificate"


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "scale.json"
    path.write_text('{"rollout_instances": 2}')

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, '{"rollout_instances": 3}')
    assert path.read_text() == '{"rollout_instances": 2}'
    assert os.listdir(tmp_path) == ["scale.json"]
