"""An episode driven by a black-box agent: the user's command, run once per episode in a process group
of its own with its session's base URL on the manager's OpenAI gateway; it makes the model's turns
itself. Its exit ends the session (and its group: what it left running is killed), its report (or
the task's reward on the transcript) gives the reward."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import tempfile
from pathlib import Path

import structlog

from rlmesh.chat.gateway_client import session_base_url, trust_environment
from rlmesh.environments.base import checked_reward
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.episodes.steps import row_of
from services.trainer.mesh import MeshClient

log = structlog.get_logger()

DONE = manager_pb2.SESSION_STATUS_DONE
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
OUTPUT_KEPT = 4096
"""Bytes of an agent's stderr quoted when it fails."""
STDOUT_KEPT = 1 << 20
"""Bytes at the end of an agent's stdout read for its report."""
ROW_IN_ENVIRONMENT_BYTES = 64 * 1024
"""RLMESH_ROW carries rows up to this size (the kernel refuses to start a process with one
environment string over 128 KiB); RLMESH_ROW_FILE carries every row."""


def reported_reward(stdout: str) -> float | None:
    """The reward of the JSON line {"reward": x} last on the agent's stdout, if it printed one."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            return None
        reward = report.get("reward") if isinstance(report, dict) else None
        return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
    return None


def kill_group(process: asyncio.subprocess.Process) -> None:
    """Kills the agent's process group: the agent and whatever it started that is still running."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the whole group is gone already
        pass


def tail(path: Path, size: int) -> str:
    with path.open("rb") as file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - size))
        return file.read().decode(errors="replace")


def agent_environment(
    handle: manager_pb2.SessionHandle, prompt: TaskPrompt, gateway_address: str, folder: Path
) -> dict[str, str]:
    """The agent's environment variables: its session on the gateway, its key and its row (in a file
    in `folder`, and inline when small enough)."""
    row = json.dumps(row_of(prompt), default=str)
    row_file = folder / "row.json"
    row_file.write_text(row)
    environment = {
        **os.environ,
        **trust_environment(),
        "OPENAI_BASE_URL": session_base_url(gateway_address, handle.session_id),
        "OPENAI_API_KEY": handle.key,
        "RLMESH_SESSION_ID": handle.session_id,
        "RLMESH_ROW_FILE": str(row_file),
    }
    environment.pop("RLMESH_ROW", None)
    if len(row.encode()) <= ROW_IN_ENVIRONMENT_BYTES:
        environment["RLMESH_ROW"] = row
    return environment


async def run_agent(
    mesh: MeshClient, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt, gateway_address: str
) -> tuple[int, str]:
    """Runs the agent's command for the episode until it exits or the episode's deadline passes
    (then its process group is killed: `deadline`); returns the status the session was closed with
    and why. Its output goes to files, so a child it leaves holding them does not keep the episode
    open: the agent's exit ends it, and the rest of its group is killed."""
    config = spec.config
    assert config.command is not None
    if not gateway_address:
        raise RuntimeError("an agent command needs the manager's gateway: its address is not configured")
    with tempfile.TemporaryDirectory(prefix="rlmesh-agent-") as scratch:
        folder = Path(scratch)
        environment = agent_environment(handle, prompt, gateway_address, folder)
        with (folder / "stdout").open("wb") as stdout, (folder / "stderr").open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *shlex.split(config.command),
                cwd=spec.working_dir or None,
                env=environment,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        try:
            await asyncio.wait_for(process.wait(), config.episode_deadline_seconds)
        except TimeoutError:
            kill_group(process)
            await process.wait()
            reason = (
                f"the agent ran longer than episode_deadline_seconds ({config.episode_deadline_seconds:g}) "
                "and was killed"
            )
            return await mesh.close_session(handle.session_id, DEADLINE, reason), reason
        except asyncio.CancelledError:
            kill_group(process)
            raise
        kill_group(process)
        if process.returncode != 0:
            reason = f"the agent exited with {process.returncode}: {tail(folder / 'stderr', OUTPUT_KEPT)}"
            return await mesh.close_session(handle.session_id, ENVIRONMENT_ERROR, reason), reason
        reward = reported_reward(tail(folder / "stdout", STDOUT_KEPT))
    if reward is not None and config.agent_rewards is not False:
        await mesh.set_session_reward(handle.session_id, checked_reward(reward, "the agent's report"))
    return await mesh.close_session(handle.session_id, DONE), ""
