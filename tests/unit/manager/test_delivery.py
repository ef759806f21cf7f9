"""Delivery: complete groups in micro-batches (never split, within bounds and a token budget), resent
from a reader's position, delivered exactly once and forgotten on acknowledgement or cancellation."""

import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.support.manager_parts import DomainParts

STOP = common_pb2.FINISH_REASON_STOP


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def finish_all(parts: DomainParts) -> None:
    for assignment in parts.scheduler.assign():
        parts.request_table.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)


def complete_groups(parts: DomainParts, sizes: list[int], unfinished: int = 0) -> None:
    parts.submit("b", 0, [(f"p{i}", [1, 2], 1) for i in range(len(sizes) + unfinished)], sampling(100))
    for a in sorted(parts.scheduler.assign(), key=lambda a: int(a.request.prompt_id[1:]))[: len(sizes)]:
        size = sizes[int(a.request.prompt_id[1:])]
        parts.request_table.record_chunk(a.request.request_id, a.attempt, [1] * size, [0.0] * size, [0] * size, STOP)


def test_micro_batches_never_split_groups_and_wait_for_the_lower_bound():
    parts = DomainParts({"a": 0})
    delivery, table = parts.delivery, parts.request_table
    parts.submit("b1", 0, [(f"p{i}", [1], 2) for i in range(5)], sampling())
    assignments = parts.scheduler.assign()
    assert delivery.take_micro_batch("b1", 2) is None
    for assignment in assignments[:6]:
        table.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    groups, remaining = delivery.take_micro_batch("b1", 2)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups) and remaining == 3
    assert delivery.take_micro_batch("b1", 2) is None
    for assignment in assignments[6:]:
        table.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    assert len(delivery.take_micro_batch("b1", 2)[0]) == 2
    last, remaining = delivery.take_micro_batch("b1", 2)
    assert len(last) == 1 and remaining == 0
    assert delivery.acknowledge("b1") and not delivery.acknowledge("b1")
    with pytest.raises(NotFound):
        delivery.take_micro_batch("b1", 2)
    assert table.requests == {}


def test_groups_sent_but_not_read_come_again_from_the_readers_position():
    parts = DomainParts({"a": 0})
    delivery = parts.delivery
    parts.submit("b1", 0, [("p0", [1], 1), ("p1", [1], 1), ("p2", [1], 1)], sampling())
    finish_all(parts)
    first, remaining = delivery.take_micro_batch("b1", 2)
    assert remaining == 1
    again, remaining = delivery.take_micro_batch("b1", 2, position=0)
    assert [g[0].prompt_id for g in again] == [g[0].prompt_id for g in first] and remaining == 1
    with pytest.raises(FailedPrecondition, match="1 groups still to be sent"):
        delivery.acknowledge("b1")
    with pytest.raises(InvalidArgument, match="resume_from 3 is past the 2 groups"):
        delivery.take_micro_batch("b1", 2, position=3)
    last, remaining = delivery.take_micro_batch("b1", 2, position=2)
    assert remaining == 0 and delivery.delivered_groups == 3
    assert delivery.take_micro_batch("b1", 2, position=3) == ([], 0)
    assert delivery.acknowledge("b1")
    assert parts.batches == {} and parts.request_table.requests == {}


def test_a_cancelled_batch_frees_its_queue_and_slots():
    parts = DomainParts({"a": 0})
    parts.instances["a"].max_batch_size = 2
    parts.submit("old", 0, [("p", [1], 4)], sampling())
    parts.submit("new", 0, [("p", [1], 1)], sampling())
    parts.scheduler.assign()
    assert parts.delivery.cancel("old") == 4
    assert parts.instances["a"].running == set()
    assert [a.request.batch_id for a in parts.scheduler.assign()] == ["new"]
    with pytest.raises(NotFound):
        parts.delivery.cancel("old")


def test_dynamic_micro_batches_take_what_is_ready_within_bounds():
    parts = DomainParts({"a": 0})
    complete_groups(parts, [3, 3, 3], unfinished=2)
    assert parts.delivery.take_micro_batch("b", 8, min_groups=4) is None
    groups, remaining = parts.delivery.take_micro_batch("b", 8, min_groups=2)
    assert len(groups) == 3 and remaining == 2
    with pytest.raises(InvalidArgument, match="min_groups"):
        parts.delivery.take_micro_batch("b", 2, min_groups=3)


def test_token_budget_packs_whole_groups():
    parts = DomainParts({"a": 0})
    complete_groups(parts, [3, 3, 10, 1])  # 5, 5, 12 and 3 tokens with the prompt
    sizes = []
    while True:
        groups, remaining = parts.delivery.take_micro_batch("b", 4, min_groups=1, max_tokens=10)
        sizes.append([len(g[0].prompt_token_ids) + len(g[0].token_ids) for g in groups])
        if remaining == 0:
            break
    # Never split; a group over budget travels alone.
    assert sizes == [[5, 5], [12], [3]]


def test_give_me_everything_ready():
    parts = DomainParts({"a": 0})
    parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(3)], sampling())
    assignments = parts.scheduler.assign()
    assert parts.delivery.take_ready("b") == ([], 3)
    for a in assignments[:2]:
        parts.request_table.record_chunk(a.request.request_id, a.attempt, [1], [0.0], [0], STOP)
    groups, remaining = parts.delivery.take_ready("b")
    assert len(groups) == 2 and remaining == 1
