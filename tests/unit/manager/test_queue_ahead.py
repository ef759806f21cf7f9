"""The queue ahead (`manager.queue_ahead`): an instance is given that many requests beyond its max
batch, which wait in its engine's queue; its decode slots, its measured per-sequence speed and the
slots stragglers move to are those of its batch alone."""

from rlmesh.common.v1 import common_pb2
from services.manager.domain.journaled import ChangeTracker
from services.manager.domain.registry import InstanceRegistry
from services.manager.domain.state import ManagerState
from tests.support.manager_parts import DomainParts

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def test_an_instance_is_given_its_max_batch_and_its_queue_ahead():
    parts = DomainParts({"a": 0, "b": 0})
    for instance in parts.instances.values():
        instance.max_batch_size, instance.queue_ahead = 2, 1
    parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(10)], sampling(10))
    picked = [a.instance.instance_id for a in parts.scheduler.assign()]
    assert sorted(picked) == ["a", "a", "a", "b", "b", "b"]
    assert len(parts.request_table.queue) == 4
    a = parts.instances["a"]
    assert (a.free_slots, a.free_decode_slots, a.decoding) == (0, 0, 2)


def test_stragglers_move_only_to_free_decode_slots_not_into_an_engine_queue():
    parts = DomainParts({"fast": 0, "slow": 0})
    fast, slow = parts.instances["fast"], parts.instances["slow"]
    fast.max_batch_size, fast.queue_ahead = 1, 2
    slow.max_batch_size = 4
    parts.submit("b", 0, [(f"p{i}", [1], 1) for i in range(5)], sampling(100))
    assignments = parts.scheduler.assign()
    fast.tokens_per_second, fast.sequence_tokens_per_second = 200.0, 200.0
    slow.tokens_per_second, slow.sequence_tokens_per_second = 40.0, 10.0
    on_fast = [a for a in assignments if a.instance is fast]
    on_slow = [a for a in assignments if a.instance is slow]
    assert (len(on_fast), len(on_slow)) == (3, 2)
    table = parts.request_table
    for a in on_slow:
        table.record_chunk(a.request.request_id, a.attempt, [1], [0.0], [0], NONE)
    # One of the three on "fast" finished: its queue has room, its one decode slot has none.
    finished = ([2] * 50, [0.0] * 50, [0] * 50)
    table.record_chunk(on_fast[0].request.request_id, on_fast[0].attempt, *finished, STOP)
    assert fast.free_slots == 1 and fast.free_decode_slots == 0
    assert parts.scheduler.plan_migrations() == []
    # Once its queue has emptied and its slot is free, the longest straggler moves there.
    for a in on_fast[1:]:
        table.record_chunk(a.request.request_id, a.attempt, *finished, STOP)
    assert [r.instance_id for r in parts.scheduler.plan_migrations()] == ["slow"]


def test_the_speed_of_a_sequence_is_measured_over_the_batch_not_the_queue():
    registry = InstanceRegistry(ChangeTracker(), lease_seconds=10, now=0, queue_ahead=4)
    instance, _ = registry.register("a", "127.0.0.1:1000", 0, 2, 0, False, "", 0)
    assert instance.queue_ahead == 4 and instance.free_slots == 6
    instance.running.update(f"r{i}" for i in range(6))
    registry.measure(0.5)
    instance.generated_tokens = 100
    registry.measure(1.5)
    # 100 tokens a second from two sequences decoding (four more waiting): 50 each.
    assert instance.tokens_per_second > 0
    assert instance.sequence_tokens_per_second == instance.tokens_per_second / 2


def test_the_setting_reaches_instances_registered_and_restored():
    state = ManagerState(lease_seconds=10, max_staleness=0, queue_ahead=3)
    instance, _ = state.registry.register("a", "127.0.0.1:1000", 0, 8, 0, False, "", 0)
    assert instance.free_slots == 11
    restarted = ManagerState(lease_seconds=10, max_staleness=0, queue_ahead=3)
    instance.queue_ahead = 0
    restarted.registry.restore([instance], 1, now=0)
    assert restarted.registry.instances["a"].queue_ahead == 3
