"""Sessions as the contract carries them (SessionTrajectory, Segment): what the trainer receives, what
GetSession answers, and the form the journal keeps a session's progress in."""

from __future__ import annotations

from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.records import Segment, Session


def segment_to_proto(segment: Segment) -> manager_pb2.Segment:
    return manager_pb2.Segment(
        source=segment.source,
        token_ids=segment.token_ids,
        logprobs=segment.logprobs,
        weight_versions=segment.weight_versions,
        finish_reason=segment.finish_reason,
        instance_ids=segment.instance_ids,
        starts_part=segment.starts_part,
        reused_prefix_tokens=segment.reused_prefix_tokens,
        turn=segment.turn,
        break_cause=segment.break_cause,
    )


def segment_from_proto(message: manager_pb2.Segment) -> Segment:
    return Segment(
        message.source,
        list(message.token_ids),
        list(message.logprobs),
        list(message.weight_versions),
        message.finish_reason,
        list(message.instance_ids),
        message.starts_part,
        message.reused_prefix_tokens,
        message.turn,
        message.break_cause,
    )


def trajectory(session: Session) -> manager_pb2.SessionTrajectory:
    message = manager_pb2.SessionTrajectory(
        session_id=session.session_id,
        segments=[segment_to_proto(s) for s in session.segments],
        status=session.status,
        detail=session.detail,
        turns=session.turns,
        turn_rewards=session.turn_rewards,
        environment_seconds=session.environment_seconds,
    )
    if session.reward is not None:
        message.reward = session.reward
    return message


def take_progress(session: Session, message: manager_pb2.SessionTrajectory) -> None:
    """Sets what the journal kept of a session's progress (its trajectory) on a session restored bare."""
    session.segments = [segment_from_proto(s) for s in message.segments]
    session.status = message.status
    session.detail = message.detail
    session.turns = message.turns
    session.reward = message.reward if message.HasField("reward") else None
    session.turn_rewards = dict(message.turn_rewards)
    session.environment_seconds = message.environment_seconds
