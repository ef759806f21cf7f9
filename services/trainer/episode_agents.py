"""An episode driven by a black-box agent: the user's command, run once per episode with its session's
base URL on the manager's OpenAI gateway; it makes the model's turns itself. Its exit ends the
session, its report (or the task's reward on the transcript) gives the reward."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from typing import TYPE_CHECKING

import structlog

from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.episode_steps import row_of
from services.trainer.mesh import MeshClient

if TYPE_CHECKING:
    from services.trainer.episodes import EpisodeSpec

log = structlog.get_logger()

DONE = manager_pb2.SESSION_STATUS_DONE
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
OUTPUT_KEPT = 4096
"""Bytes of an agent's stderr quoted when it fails."""


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


async def run_agent(mesh: MeshClient, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt,
                    gateway_address: str) -> tuple[int, str]:
    """Runs the agent's command for the episode until it exits or the episode's deadline passes
    (then it is killed: `deadline`); returns the status the session was closed with and why."""
    config = spec.config
    assert config.command is not None
    if not gateway_address:
        raise RuntimeError("an agent command needs the manager's gateway: its address is not configured")
    environment = {**os.environ, "OPENAI_BASE_URL": f"http://{gateway_address}/sessions/{handle.session_id}/v1",
                   "OPENAI_API_KEY": handle.key, "RLMESH_SESSION_ID": handle.session_id,
                   "RLMESH_ROW": json.dumps(row_of(prompt), default=str)}
    process = await asyncio.create_subprocess_exec(*shlex.split(config.command), cwd=spec.working_dir or None, env=environment,
                                                   stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), config.episode_deadline_seconds)
    except TimeoutError:
        process.kill()
        await process.wait()
        reason = f"the agent ran longer than episode_deadline_seconds ({config.episode_deadline_seconds:g}) and was killed"
        return await mesh.close_session(handle.session_id, DEADLINE, reason), reason
    except asyncio.CancelledError:
        process.kill()
        raise
    if process.returncode != 0:
        reason = f"the agent exited with {process.returncode}: {stderr.decode(errors='replace')[-OUTPUT_KEPT:]}"
        return await mesh.close_session(handle.session_id, ENVIRONMENT_ERROR, reason), reason
    reward = reported_reward(stdout.decode(errors="replace"))
    if reward is not None:
        await mesh.set_session_reward(handle.session_id, reward)
    return await mesh.close_session(handle.session_id, DONE), ""
