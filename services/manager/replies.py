"""The manager's state as its contract carries it: instances in GetStatus, a turn's reply, the stage
balance and a complete group as the trainer receives it."""

from __future__ import annotations

from collections.abc import Mapping

from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.records import Instance, SampleRequest, Session, TurnState
from services.manager.domain.stage_balance import Balance
from services.manager.domain.trajectories import segment_to_proto, trajectory


def instance_status(instance: Instance, now: float) -> manager_pb2.InstanceStatus:
    return manager_pb2.InstanceStatus(
        instance_id=instance.instance_id,
        address=instance.address,
        weight_version=instance.weight_version,
        running_requests=len(instance.running),
        outstanding_tokens=round(instance.outstanding_tokens),
        tokens_per_second=instance.tokens_per_second,
        lease_remaining_seconds=max(0.0, instance.lease_expires - now),
        schedulable=instance.schedulable,
        generated_tokens=instance.generated_tokens,
        incarnation=instance.incarnation,
        preemptible=instance.preemptible,
        draining=instance.draining,
        saturation_batch_size=instance.saturation_batch_size,
        quarantine_remaining_seconds=max(0.0, instance.quarantined_until - now) if instance.quarantined_until else 0.0,
        quarantines=instance.quarantines,
    )


def turn_response(state: TurnState) -> manager_pb2.RunTurnResponse:
    response = manager_pb2.RunTurnResponse(status=state.status, stream_tokens=state.stream_tokens)
    if state.segment is not None:
        response.generated.CopyFrom(segment_to_proto(state.segment))
    return response


def balance_to_proto(balance: Balance) -> manager_pb2.StageBalance:
    return manager_pb2.StageBalance(
        observed_steps=balance.observed_steps,
        train_seconds=balance.train_seconds,
        rollout_seconds=balance.rollout_seconds,
        trainer_wait_seconds=balance.trainer_wait_seconds,
        rollout_idle_seconds=balance.rollout_idle_seconds,
        local_window_seconds=balance.local_window_seconds,
        recommended_rollout_instances=balance.recommended_rollout_instances,
        offload_fraction=balance.offload_fraction,
    )


def group_to_proto(group: list[SampleRequest], sessions: Mapping[str, Session]) -> manager_pb2.Group:
    """A complete group as the trainer receives it; a session's sample carries its trajectory."""
    samples = []
    for r in group:
        sample = manager_pb2.Sample(
            token_ids=r.token_ids,
            logprobs=r.logprobs,
            weight_versions=r.weight_versions,
            finish_reason=r.finish_reason,
            instance_ids=r.instance_ids,
        )
        if r.relay:
            sample.relayed.CopyFrom(
                manager_pb2.RelayedPayload(address=r.relay, request_id=r.request_id, token_count=r.relayed_tokens)
            )
        session = sessions.get(r.request_id)
        if session is not None:
            sample.session.CopyFrom(trajectory(session))
        samples.append(sample)
    return manager_pb2.Group(prompt_id=group[0].prompt_id, prompt_token_ids=group[0].prompt_token_ids, samples=samples)
