"""The contract checks are real: buf lint passes, and buf breaking against the released image
catches an incompatible change while accepting the same change as a new v2 package."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

BUF = Path(sys.executable).parent / "buf"


def buf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def contracts(tmp_path) -> Path:
    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos")
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


def test_lint_and_breaking_pass_on_the_repository():
    assert buf("lint", cwd=REPO_ROOT).returncode == 0
    result = buf("breaking", "--against", "protos/released.binpb", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renumbered_field_is_caught(contracts):
    proto = contracts / "protos/rlmesh/manager/v1/manager.proto"
    proto.write_text(
        proto.read_text().replace("string batch_id = 1;\n  // Trainer", "string batch_id = 9;\n  // Trainer")
    )
    result = buf("breaking", "--against", "protos/released.binpb", cwd=contracts)
    assert result.returncode != 0
    assert "batch_id" in result.stdout + result.stderr


def test_the_change_is_accepted_as_a_v2_package(contracts):
    v2 = contracts / "protos/rlmesh/manager/v2"
    v2.mkdir()
    source = (contracts / "protos/rlmesh/manager/v1/manager.proto").read_text()
    (v2 / "manager.proto").write_text(
        source.replace("package rlmesh.manager.v1;", "package rlmesh.manager.v2;").replace(
            "string batch_id = 1;\n  // Trainer", "string batch_id = 9;\n  // Trainer"
        )
    )
    assert buf("lint", cwd=contracts).returncode == 0
    result = buf("breaking", "--against", "protos/released.binpb", cwd=contracts)
    assert result.returncode == 0, result.stdout + result.stderr
