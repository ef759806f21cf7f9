"""The request table: a request's chunks kept once (a dead attempt's late chunks are discarded), its
continuation from its tokens after an abort, a lost stream or its instance gone, an exact-version
request's tokens of other versions dropped, an instance's refusal failing the batch, and a session
turn's end told to the hooks of the sessions' owner."""

import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import InvalidArgument
from services.manager.domain.records import Assignment, Batch, SampleRequest
from tests.support.manager_parts import DomainParts

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED
ABORT = common_pb2.FINISH_REASON_ABORT


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def start_next(parts: DomainParts, instance_id: str) -> Assignment:
    """Starts the request first in the queue on the instance, as a dispatch would."""
    return parts.request_table.start(parts.request_table.queue.popleft(), parts.instances[instance_id])


def test_an_aborted_stream_continues_elsewhere():
    parts = DomainParts({"a": 0})
    parts.submit("b1", 0, [("p", [1], 1)], sampling(4))
    assignment = start_next(parts, "a")
    parts.request_table.record_chunk(assignment.request.request_id, assignment.attempt, [5], [-1.0], [0], ABORT)
    retry = start_next(parts, "a")
    assert retry.request.token_ids == [5] and retry.request.remaining_tokens == 3


def test_late_chunks_of_an_abandoned_attempt_count_as_discarded():
    parts = DomainParts({"a": 0, "b": 0})
    table = parts.request_table
    parts.submit("b1", 0, [("p", [1], 1)], sampling(10))
    first = start_next(parts, "a")
    table.stream_lost(first.request.request_id, first.attempt)
    assert not table.record_chunk(first.request.request_id, first.attempt, [1, 2, 3], [0.0] * 3, [0] * 3, NONE)
    assert table.discarded_tokens == 3


def test_continuation_keeps_generated_tokens_and_shrinks_max_tokens():
    parts = DomainParts({"a": 0, "b": 0})
    scheduler, table = parts.scheduler, parts.request_table
    parts.submit("b1", 0, [("p", [7, 7], 1)], sampling(6))
    (assignment,) = scheduler.assign()
    victim = assignment.instance.instance_id
    table.record_chunk(assignment.request.request_id, assignment.attempt, [1, 2], [-0.1, -0.2], [0, 0], NONE)
    # The instance is gone (the registry dropped it): the table requeues what it ran.
    requeued = table.requeue_running(parts.instances.pop(victim))
    assert [r.request_id for r in requeued] == [assignment.request.request_id]
    (retry,) = scheduler.assign()
    assert retry.instance.instance_id != victim
    assert retry.request.prompt_token_ids == [7, 7] and retry.request.token_ids == [1, 2]
    assert retry.request.remaining_tokens == 4
    # The dead attempt's late chunk is ignored: nothing is counted twice.
    assert not table.record_chunk(assignment.request.request_id, assignment.attempt, [3], [-0.3], [0], NONE)
    table.record_chunk(retry.request.request_id, retry.attempt, [3, 9], [-0.3, -0.4], [0, 0], STOP)
    groups, remaining_groups = parts.delivery.take_micro_batch("b1", 1)
    assert parts.delivery.acknowledge("b1")
    sample = groups[0][0]
    assert sample.token_ids == [1, 2, 3, 9]
    assert sample.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert sample.instance_ids == [victim, retry.instance.instance_id]
    assert remaining_groups == 0


def test_an_exact_version_sample_keeps_only_its_versions_tokens_from_an_instance_that_switched():
    """An instance predating the pin ignores it: what it generated on the version is kept, and the
    sample continues on an instance still serving it."""
    parts = DomainParts({"old": 1, "b": 1}, max_staleness=0)
    scheduler, table = parts.scheduler, parts.request_table
    parts.admission.publish(1)
    parts.instances["b"].max_batch_size = 0
    parts.submit("eval", 1, [("p", [1], 1)], sampling(), exact_version=True)
    (first,) = scheduler.assign()
    assert not table.record_chunk(
        first.request.request_id, first.attempt, [4, 5, 6], [-0.1, -0.2, -0.3], [1, 2, 2], NONE
    )
    request = first.request
    assert (request.token_ids, request.logprobs, request.weight_versions) == ([4], [pytest.approx(-0.1)], [1])
    assert table.discarded_tokens == 2 and parts.instances["old"].weight_version == 2
    parts.instances["b"].max_batch_size = 4
    (second,) = scheduler.assign()
    assert second.instance.instance_id == "b" and second.request.token_ids == [4]


def test_a_request_an_instance_refuses_fails_its_batch_instead_of_cycling():
    parts = DomainParts({"a": 0})
    scheduler, table = parts.scheduler, parts.request_table
    parts.submit("b1", 0, [("good", [1], 2), ("bad", [999], 2)], sampling())
    assignments = {a.request.request_id: a for a in scheduler.assign()}
    refused = assignments["b1/bad/0"]
    assert table.reject(refused.request.request_id, refused.attempt, "token ids [999] outside the vocabulary")
    assert scheduler.assign() == []
    with pytest.raises(InvalidArgument, match="prompt 'bad' was refused.*vocabulary"):
        parts.delivery.take_micro_batch("b1", 1)
    assert parts.instances["a"].running == set() and parts.instances["a"].outstanding_tokens == 0
    assert table.requests == {} and parts.batches == {}


def test_how_a_session_turn_ends_goes_to_the_hooks_its_owner_registered_not_to_a_group():
    parts = DomainParts({"a": 0})
    table, told = parts.request_table, []
    table.turn_finished = lambda turn: told.append(("finished", turn.request_id))
    table.turn_refused = lambda turn, reason: told.append(("refused", turn.request_id, reason))
    table.session_batch_forgotten = lambda batch: told.append(("forgotten", batch.batch_id))
    slot = SampleRequest("s/p/0", "s", "p", [1], sampling(), 0)
    batch = parts.batches["s"] = Batch("s", 0, {"p": [slot]}, sessions=True)
    assert table.add(batch) == 1 and not table.queue  # a session's sample runs turn by turn
    table.add_turn(SampleRequest("s/p/0#0", "s", "p", [1], sampling(), 0, session_id="s/p/0"))
    first = start_next(parts, "a")
    assert table.record_chunk(first.request.request_id, first.attempt, [5], [-0.5], [0], STOP)
    table.add_turn(SampleRequest("s/p/0#1", "s", "p", [1, 5, 2], sampling(), 0, session_id="s/p/0"))
    second = start_next(parts, "a")
    assert table.reject(second.request.request_id, second.attempt, "too long")
    table.forget(batch)
    assert told == [("finished", "s/p/0#0"), ("refused", "s/p/0#1", "too long"), ("forgotten", "s")]
    # The group's slot is the session's to fill: neither turn made it ready, nor failed the batch.
    assert not batch.ready and not batch.error and not slot.done
