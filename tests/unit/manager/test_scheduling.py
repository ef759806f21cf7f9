"""Scheduling and its dispatch policies: which instance each queued request goes to (outstanding
tokens against measured throughput, or strict turns), straggler migration, and exact-version batches
(held-out evaluation of a named version) beside training and background work."""

import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import OutOfRange
from services.manager.domain.records import Assignment
from tests.support.manager_parts import DomainParts

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED
ABORT = common_pb2.FINISH_REASON_ABORT


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def measured(parts: DomainParts, rates: dict[str, tuple[float, float]]) -> None:
    for instance_id, (total, per_sequence) in rates.items():
        parts.instances[instance_id].tokens_per_second = total
        parts.instances[instance_id].sequence_tokens_per_second = per_sequence


def test_dispatch_prefers_fewest_outstanding_tokens():
    parts = DomainParts({"a": 0, "b": 0})
    parts.submit("b1", 0, [("p", [1, 2], 1)], sampling(100))
    first = parts.scheduler.assign()
    assert [a.instance.instance_id for a in first] == ["a"]
    parts.submit("b2", 0, [("q", [1], 3)], sampling(10))
    picked = [a.instance.instance_id for a in parts.scheduler.assign()]
    # "a" carries 100 outstanding tokens: all three short requests go to "b".
    assert picked == ["b", "b", "b"]


def test_dispatch_weighs_outstanding_tokens_by_measured_throughput():
    parts = DomainParts({"fast": 0, "slow": 0})
    # Same speed per sequence, three times the throughput (more sequences at once).
    measured(parts, {"fast": (300.0, 10.0), "slow": (100.0, 10.0)})
    parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(40)], sampling(10))
    picked = [a.instance.instance_id for a in parts.scheduler.assign()]
    # Expected finish times stay level: three times the work goes to the three times faster one.
    assert picked.count("fast") == 30 and picked.count("slow") == 10


def test_near_the_end_a_much_slower_instance_starts_nothing():
    def assigned(requests: int) -> list[str]:
        parts = DomainParts({"fast": 0, "slow": 0})
        parts.instances["fast"].max_batch_size = 3
        measured(parts, {"fast": (100.0, 50.0), "slow": (10.0, 5.0)})
        parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(requests)], sampling(10))
        return [a.instance.instance_id for a in parts.scheduler.assign()]

    # 600 queued tokens keep the fast instance busy for 6 s; a request takes the slow one 2 s.
    assert assigned(60).count("slow") > 0
    # 30 queued tokens are 0.3 s of work for the fast one: the slow one would only delay them.
    assert assigned(3) == ["fast", "fast", "fast"]


def test_round_robin_ignores_speed_and_load():
    parts = DomainParts({"a": 0, "b": 0, "c": 0}, policy="round_robin")
    measured(parts, {"a": (300.0, 10.0), "b": (100.0, 3.0), "c": (1.0, 1.0)})
    parts.submit("b1", 0, [(f"p{i}", [1], 1) for i in range(7)], sampling(10))
    assert [a.instance.instance_id for a in parts.scheduler.assign()] == ["a", "b", "c", "a", "b", "c", "a"]
    assert parts.scheduler.plan_migrations() == []


def straggler_setup() -> tuple[DomainParts, list[Assignment]]:
    parts = DomainParts({"fast": 0, "slow": 0})
    parts.instances["fast"].max_batch_size = 2
    parts.instances["slow"].max_batch_size = 4
    parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(6)], sampling(100))
    assignments = parts.scheduler.assign()
    # Speeds become known once both generate.
    measured(parts, {"fast": (200.0, 100.0), "slow": (40.0, 10.0)})
    return parts, assignments


def test_stragglers_move_from_a_slow_instance_to_an_idle_fast_one():
    parts, assignments = straggler_setup()
    scheduler, table = parts.scheduler, parts.request_table
    on_fast = [a for a in assignments if a.instance.instance_id == "fast"]
    on_slow = [a for a in assignments if a.instance.instance_id == "slow"]
    assert len(on_fast) == 2 and len(on_slow) == 4
    # Not while work is still queued, and not before the fast one has a free slot.
    assert scheduler.plan_migrations() == []
    for a in on_slow:
        table.record_chunk(
            a.request.request_id,
            a.attempt,
            [1] * (on_slow.index(a) + 1),
            [0.0] * (on_slow.index(a) + 1),
            [0] * (on_slow.index(a) + 1),
            NONE,
        )
    for a in on_fast:
        table.record_chunk(a.request.request_id, a.attempt, [2], [0.0], [0], STOP)
    moved = scheduler.plan_migrations()
    # Two free slots on "fast": the two slow requests expected to run longest go there.
    assert [r.request_id for r in moved] == [on_slow[3].request.request_id, on_slow[2].request.request_id]
    assert scheduler.plan_migrations() == []
    # The abort's last chunk arrives with one more token; the request continues on "fast".
    victim = on_slow[3]
    table.record_chunk(victim.request.request_id, victim.attempt, [9], [-0.5], [0], ABORT)
    (again,) = scheduler.assign()
    assert again.instance.instance_id == "fast"
    assert again.request.token_ids == [1, 1, 1, 1, 9]
    assert table.migrated_samples == 1 and table.continued_tokens == 5


def test_no_migration_between_instances_of_equal_speed():
    parts = DomainParts({"a": 0, "b": 0})
    parts.instances["a"].max_batch_size = 1
    measured(parts, {"a": (100.0, 50.0), "b": (100.0, 50.0)})
    parts.submit("b1", 0, [(f"p{i}", [1], 1) for i in range(3)], sampling(100))
    for a in parts.scheduler.assign():
        if a.instance.instance_id == "a":
            parts.request_table.record_chunk(a.request.request_id, a.attempt, [1], [0.0], [0], STOP)
    assert parts.scheduler.plan_migrations() == []


# Exact-version batches: every token from exactly the named version; background work. ---------------


def test_an_exact_version_sample_runs_only_on_an_instance_serving_exactly_its_version():
    parts = DomainParts({"older": 0, "exact": 1, "newer": 2}, max_staleness=2)
    parts.admission.publish(2)
    parts.submit("eval", 1, [("p", [1], 6)], sampling(), exact_version=True)
    assignments = parts.scheduler.assign()
    assert len(assignments) == 6 and {a.instance.instance_id for a in assignments} == {"exact"}


def test_exact_version_samples_take_the_slots_that_free_up_before_training_samples():
    parts = DomainParts({"a": 1}, max_staleness=0)
    scheduler, table = parts.scheduler, parts.request_table
    parts.admission.publish(1)
    parts.instances["a"].max_batch_size = 3
    parts.submit("train", 1, [("t", [1], 2)], sampling())
    assert [a.request.batch_id for a in scheduler.assign()] == ["train", "train"]
    parts.submit("eval", 1, [("e", [1], 3)], sampling(), exact_version=True)
    parts.submit("train2", 1, [("t", [1], 1)], sampling())
    # Running training samples are never preempted: the one free slot goes to the evaluation.
    assert [a.request.batch_id for a in scheduler.assign()] == ["eval"]
    first = next(r for r in table.requests.values() if r.batch_id == "train" and r.instance_id)
    table.record_chunk(first.request_id, first.attempt, [1], [0.0], [1], STOP)
    # The freed slot goes to the waiting evaluation sample, not to the training one submitted after it.
    assert [a.request.batch_id for a in scheduler.assign()] == ["eval"]


def test_a_validation_stays_on_one_instance_while_the_others_take_training_samples():
    parts = DomainParts({"a": 1, "b": 1}, max_staleness=1)
    scheduler, table, instances = parts.scheduler, parts.request_table, parts.instances
    parts.admission.publish(1)
    for instance in instances.values():
        instance.max_batch_size = 4
    parts.submit("eval", 1, [("e", [1], 6)], sampling(), exact_version=True)
    parts.submit("train", 1, [("t", [1], 4)], sampling())
    placed = {(a.instance.instance_id, a.request.batch_id) for a in scheduler.assign()}
    assert placed in ({("a", "eval"), ("b", "train")}, {("b", "eval"), ("a", "train")})
    (holder,) = {i for i, batch in placed if batch == "eval"}
    other = ({"a", "b"} - {holder}).pop()
    assert len(instances[holder].running) == 4 and len(instances[other].running) == 4
    # The two evaluation samples left wait for the holder's slots, not for the other's.
    finished = next(iter(instances[other].running))
    table.record_chunk(finished, table.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert scheduler.assign() == []
    finished = next(iter(instances[holder].running))
    table.record_chunk(finished, table.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in scheduler.assign()] == [(holder, "eval")]


def test_training_samples_wait_for_another_instance_rather_than_join_background_work():
    parts = DomainParts({"a": 1, "b": 1}, max_staleness=1)
    scheduler, table, instances = parts.scheduler, parts.request_table, parts.instances
    parts.admission.publish(1)
    for instance in instances.values():
        instance.max_batch_size = 4
    parts.submit("eval", 1, [("e", [1], 2)], sampling(), exact_version=True, background=True)
    parts.submit("train", 1, [("t", [1], 6)], sampling())
    placed = [(a.instance.instance_id, a.request.batch_id) for a in scheduler.assign()]
    (holder,) = {i for i, batch in placed if batch == "eval"}
    other = ({"a", "b"} - {holder}).pop()
    # The holder has two free slots, yet the training samples left wait for the other instance.
    assert sorted(placed) == sorted([(holder, "eval")] * 2 + [(other, "train")] * 4)
    assert instances[holder].free_slots == 2 and scheduler.assign() == []
    finished = next(iter(instances[other].running))
    table.record_chunk(finished, table.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in scheduler.assign()] == [(other, "train")]
    # Once the background work ended, the holder takes training samples again.
    for request_id in list(instances[holder].running):
        table.record_chunk(request_id, table.requests[request_id].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in scheduler.assign()] == [(holder, "train")]


def test_with_one_instance_training_samples_share_it_with_background_work():
    parts = DomainParts({"a": 1}, max_staleness=1)
    parts.admission.publish(1)
    parts.instances["a"].max_batch_size = 4
    parts.submit("eval", 1, [("e", [1], 2)], sampling(), exact_version=True, background=True)
    parts.submit("train", 1, [("t", [1], 2)], sampling())
    assert sorted(a.request.batch_id for a in parts.scheduler.assign()) == ["eval", "eval", "train", "train"]


def test_an_exact_version_batch_fails_out_of_range_once_no_instance_serves_its_version():
    parts = DomainParts({"a": 1}, max_staleness=0)
    scheduler, table, instance = parts.scheduler, parts.request_table, parts.instances["a"]
    parts.admission.publish(1)
    instance.max_batch_size = 2
    parts.submit("eval", 1, [("p", [1], 3)], sampling(), exact_version=True)
    first, second = scheduler.assign()
    parts.admission.publish(2)
    # The trainer moved on, but "a" still serves version 1: the waiting sample waits for its slot.
    assert scheduler.assign() == [] and "eval" in parts.batches and not parts.batches["eval"].error
    table.record_chunk(first.request.request_id, first.attempt, [7], [0.0], [1], STOP)
    (third,) = scheduler.assign()
    # A version 2 push is committing on "a": it refuses new samples of version 1.
    assert table.version_refused(third.request.request_id, third.attempt)
    assert instance.refused_version == 1 and third.request.instance_ids == []
    assert scheduler.assign() == []
    batch = parts.batches["eval"]
    assert batch.error and batch.version_gone and not table.queue
    # The sample still running is let go: it no longer holds the instance's switch back.
    assert instance.running == set()
    assert not table.record_chunk(second.request.request_id, second.attempt, [8], [0.0], [1], NONE)
    with pytest.raises(
        OutOfRange,
        match=r"version 1 is no longer served by any instance: evaluation of it is skipped "
        r"\(2 of its samples unfinished; published version 2\)",
    ):
        parts.delivery.take_micro_batch("eval", 1)
    assert parts.batches == {} and table.requests == {}


def test_an_exact_version_batch_waits_for_its_version_and_fails_once_every_instance_is_past_it():
    parts = DomainParts({"a": 0, "b": 0}, max_staleness=0)
    scheduler = parts.scheduler
    parts.admission.publish(1)
    parts.submit("eval1", 1, [("p", [1], 1)], sampling(), exact_version=True)
    # Version 1 is the latest: the instances are about to serve it.
    assert scheduler.assign() == [] and not parts.batches["eval1"].error
    parts.instances["a"].weight_version = 1
    parts.instances["b"].weight_version = 2
    assert [a.instance.instance_id for a in scheduler.assign()] == ["a"]
    parts.submit("eval0", 0, [("p", [1], 1)], sampling(), exact_version=True)
    scheduler.assign()
    with pytest.raises(OutOfRange, match="version 0 is no longer served"):
        parts.delivery.take_micro_batch("eval0", 1)
    assert "eval1" in parts.batches and not parts.batches["eval1"].error


def test_exact_version_samples_waiting_do_not_hold_back_straggler_migration():
    parts, assignments = straggler_setup()
    for index, a in enumerate(assignments):
        finish = STOP if a.instance.instance_id == "fast" else NONE
        parts.request_table.record_chunk(
            a.request.request_id, a.attempt, [1] * (index + 1), [0.0] * (index + 1), [0] * (index + 1), finish
        )
    parts.submit("eval", 5, [("e", [1], 1)], sampling(), exact_version=True)
    assert parts.scheduler.assign() == [] and len(parts.request_table.queue) == 1
    assert len(parts.scheduler.plan_migrations()) == 2
