"""A built-in model's folder is created once, whole, however many runs start at the same time, and
a creation that fails leaves nothing at the path."""

import threading
import time
from pathlib import Path

import pytest

from rlmesh.models.builtin import ensure_model
from rlmesh.models.families import is_model_dir

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def slow_creator(calls: list[Path], seconds: float = 0.3):
    def create(folder: Path) -> None:
        calls.append(folder)
        for name in MODEL_FILES:
            (folder / name).write_text(name)
            time.sleep(seconds / len(MODEL_FILES))

    return create


def test_runs_starting_together_create_the_model_once_and_each_finds_it_whole(tmp_path):
    model_dir = tmp_path / "models" / "tiny"
    calls, lines, found = [], [], []
    create = slow_creator(calls)

    def run() -> None:
        found.append(is_model_dir(ensure_model(model_dir, create, "tiny", lines.append)))

    runs = [threading.Thread(target=run) for _ in range(3)]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join(30)
    assert found == [True, True, True]
    assert len(calls) == 1 and calls[0] != model_dir
    assert sum(line.startswith("creating the built-in model tiny") for line in lines) == 1
    assert sum(line.startswith("waiting for another process") for line in lines) >= 1
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".tiny.lock", "tiny"]

    ensure_model(model_dir, create, "tiny", lines.append)
    assert len(calls) == 1


def test_a_failed_creation_leaves_nothing_at_the_path_and_the_next_run_creates_it(tmp_path):
    model_dir = tmp_path / "models" / "tiny"

    def crash(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    with pytest.raises(RuntimeError, match="killed mid-way"):
        ensure_model(model_dir, crash, "tiny", lambda line: None)
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".tiny.lock"]

    # A folder an older version left half-written at the path is replaced.
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    calls = []
    assert is_model_dir(ensure_model(model_dir, slow_creator(calls, 0), "tiny", lambda line: None))
    assert len(calls) == 1
