"""An episode driven step by step: the environment's reset, then the model's turn and the environment's
step in turn, its observations rendered into the session's stream (messages through the chat
template, or tokens as they are) and its rewards set on the session per turn."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rlmesh.chat.tool_calls import parse_tool_calls
from rlmesh.chat.turns import ENVIRONMENT, Piece
from rlmesh.common.v1 import common_pb2
from rlmesh.environments.base import (
    Action,
    EnvironmentFailure,
    StepResult,
    Text,
    Tokens,
    as_observation,
    as_step_result,
)
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.mesh import MeshClient

OPEN = manager_pb2.SESSION_STATUS_OPEN
DONE = manager_pb2.SESSION_STATUS_DONE
Call = Callable[[Callable[..., Any], Any, float], Awaitable[Any]]


def row_of(prompt: TaskPrompt) -> dict[str, Any]:
    """What `reset` receives: the prompt (text or messages), its uid and its metadata fields."""
    return {
        **prompt.metadata,
        "prompt": prompt.text if prompt.text is not None else list(prompt.messages or []),
        "uid": prompt.uid,
    }


def segments_of(pieces: list[Piece]) -> list[manager_pb2.Segment]:
    return [
        manager_pb2.Segment(
            source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
            if p.source == ENVIRONMENT
            else manager_pb2.SEGMENT_SOURCE_TEMPLATE,
            token_ids=p.token_ids,
        )
        for p in pieces
    ]


def raw_segments(spec: EpisodeSpec, observation: Tokens | Text) -> list[manager_pb2.Segment]:
    """An observation appended as it is: its tokens, or its text tokenized once (no template)."""
    ids = (
        observation.token_ids
        if isinstance(observation, Tokens)
        else spec.tokenizer.encode(observation.text, add_special_tokens=False)
    )
    return [manager_pb2.Segment(source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, token_ids=list(ids))]


def action_of(spec: EpisodeSpec, generated: manager_pb2.Segment) -> Action:
    """The model's turn as the environment sees it: text without the stop token, tool calls parsed."""
    ids = list(generated.token_ids)
    text_ids = ids[:-1] if ids and ids[-1] in spec.stop_ids else ids
    text = spec.tokenizer.decode(text_ids, skip_special_tokens=True)
    parsed = parse_tool_calls(text)
    return Action(
        text, parsed.tool_calls, parsed.content, ids, generated.finish_reason == common_pb2.FINISH_REASON_LENGTH
    )


async def run_steps(
    mesh: MeshClient, spec: EpisodeSpec, session_id: str, prompt: TaskPrompt, environment: Any, call: Call
) -> tuple[int, str]:
    """The episode until the environment is done (closed `done`) or the manager ends the session (a
    limit: its status). Raises what the environment raised, TimeoutError past a step's deadline."""
    config = spec.config
    opening = as_observation(await call(environment.reset, row_of(prompt), config.step_deadline_seconds), "reset")
    raw = isinstance(opening, (Tokens, Text))
    history: list[dict[str, Any]] = [] if raw else list(opening)
    append = raw_segments(spec, opening) if raw else segments_of(spec.chat_turns().first(history))
    turn = 0
    while True:
        reply = await mesh.run_turn(
            manager_pb2.RunTurnRequest(session_id=session_id, turn=turn, append=append),
            config.turn_deadline_seconds + config.step_deadline_seconds,
        )
        if reply.status != OPEN:
            # The manager ended it at a limit; the close settles it, so its group can be delivered.
            return await mesh.close_session(session_id, reply.status), ""
        action = action_of(spec, reply.generated)
        result: StepResult = as_step_result(await call(environment.step, action, config.step_deadline_seconds))
        # The trajectory's reward is the sum of its turns' (trajectory_reward).
        if result.reward is not None:
            await mesh.set_session_reward(session_id, result.reward, turn)
        if result.done:
            return await mesh.close_session(session_id, DONE), ""
        observation = result.messages
        if raw != isinstance(observation, (Tokens, Text)):
            raise EnvironmentFailure("the environment mixed raw (tokens, text) and message observations in one episode")
        if isinstance(observation, (Tokens, Text)):
            append = raw_segments(spec, observation)
        else:
            history.append({"role": "assistant", "content": action.text})
            stop_text = "" if action.truncated else spec.tokenizer.decode(reply.generated.token_ids[-1:])
            append = segments_of(spec.chat_turns().after_model(history, stop_text, observation))
            history += observation
        turn += 1
