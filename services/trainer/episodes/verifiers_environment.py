"""An episode of a verifiers environment (`environment.verifiers`): verifiers runs it unchanged, its
model calls sent to the session's base URL on the manager's gateway (the key in a header, never in
the URL); the taskset's reward, or its failure, ends the session."""

from __future__ import annotations

from rlmesh.chat.gateway_client import session_base_url
from rlmesh.environments.base import checked_reward
from rlmesh.environments.verifiers_adapter import INDEX_FIELD, VerifiersEpisodes
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.mesh import MeshClient

DONE = manager_pb2.SESSION_STATUS_DONE
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR


async def run_verifiers(
    mesh: MeshClient,
    spec: EpisodeSpec,
    handle: manager_pb2.SessionHandle,
    prompt: TaskPrompt,
    gateway_address: str,
    episodes: VerifiersEpisodes,
) -> tuple[int, str]:
    """Runs the episode of the prompt's taskset row; returns the status the session was closed with and why."""
    config = spec.config
    if not gateway_address:
        raise RuntimeError("a verifiers environment needs the manager's gateway: its address is not configured")
    # The key in a header of its own, not in the URL: verifiers may quote the URL in an error, which
    # would carry it into the session's detail and the logs.
    base_url = session_base_url(gateway_address, handle.session_id)
    try:
        outcome = await episodes.run(
            prompt.metadata[INDEX_FIELD], base_url, spec.task, config.episode_deadline_seconds, handle.key
        )
    except TimeoutError:
        reason = f"the verifiers episode ran longer than episode_deadline_seconds ({config.episode_deadline_seconds:g})"
        return await mesh.close_session(handle.session_id, DEADLINE, reason), reason
    if outcome.error:
        reason = f"the verifiers episode failed: {outcome.error}"[:2000]
        return await mesh.close_session(handle.session_id, ENVIRONMENT_ERROR, reason), reason
    if outcome.timed_out:
        reason = "the verifiers episode hit its rollout timeout"
        return await mesh.close_session(handle.session_id, DEADLINE, reason), reason
    await mesh.set_session_reward(handle.session_id, checked_reward(outcome.reward, "the verifiers taskset"))
    return await mesh.close_session(handle.session_id, DONE), ""
