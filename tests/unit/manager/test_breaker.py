"""The circuit breaker: an instance whose requests fail one after another is quarantined for a
backoff that doubles, work goes on elsewhere, and a sample that fails attempt after attempt on
instances whose other work goes through ends its batch with the reason instead of circling; one
failing only on instances that fail everything goes on."""

from rlmesh.common.v1 import common_pb2
from services.manager.domain import breaker
from services.manager.domain.breaker import (
    MAX_QUARANTINE_SECONDS,
    QUARANTINE_AFTER,
    QUARANTINE_SECONDS,
    SAMPLE_FAILURES,
)
from services.manager.domain.state import ManagerState
from tests.support.waiting import ManualClock

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def mesh(*instance_ids: str, max_batch_size: int = 4) -> tuple[ManagerState, ManualClock]:
    clock = ManualClock()
    state = ManagerState(lease_seconds=1e9, max_staleness=1, clock=clock)
    for index, instance_id in enumerate(instance_ids):
        state.register(instance_id, f"127.0.0.1:{1000 + index}", 0, max_batch_size, now=0)
    return state, clock


def fail_all_on(state: ManagerState, instance_id: str) -> int:
    failed = 0
    for request_id in sorted(state.instances[instance_id].running):
        state.request_failed(request_id, state.requests[request_id].attempt, "INTERNAL: engine core died")
        failed += 1
    return failed


def test_failures_in_a_row_quarantine_an_instance_and_its_samples_finish_on_a_healthy_one():
    state, clock = mesh("broken", max_batch_size=QUARANTINE_AFTER)
    state.submit("b", 0, [(f"p{i}", [1], 1) for i in range(QUARANTINE_AFTER)], sampling())
    state.assign()
    assert fail_all_on(state, "broken") == QUARANTINE_AFTER
    broken = state.instances["broken"]
    assert broken.quarantined_until == QUARANTINE_SECONDS and not broken.schedulable
    # No work for it while quarantined: a healthy instance joining takes everything.
    assert state.assign() == []
    state.register("healthy", "127.0.0.1:2000", 0, QUARANTINE_AFTER, now=0)
    started = state.assign()
    assert {a.instance.instance_id for a in started} == {"healthy"} and len(started) == QUARANTINE_AFTER
    for assignment in started:
        request = assignment.request
        state.record_chunk(request.request_id, assignment.attempt, [3, 4], [-0.5, -0.5], [0, 0], STOP)
    assert all(r.done and r.token_ids == [3, 4] for r in state.requests.values())
    clock.now = QUARANTINE_SECONDS
    assert state.release_quarantines(clock.now) == [broken] and broken.schedulable


def test_each_quarantine_lasts_twice_the_one_before_until_a_request_finishes_there():
    state, clock = mesh("flaky", max_batch_size=QUARANTINE_AFTER)
    lengths = []
    for round_ in range(8):
        state.submit(f"b{round_}", 0, [(f"p{i}", [1], 1) for i in range(QUARANTINE_AFTER)], sampling())
        state.assign()
        fail_all_on(state, "flaky")
        flaky = state.instances["flaky"]
        lengths.append(flaky.quarantined_until - clock.now)
        clock.now = flaky.quarantined_until
        state.release_quarantines(clock.now)
        state.cancel_batch(f"b{round_}")
    assert lengths == [min(MAX_QUARANTINE_SECONDS, QUARANTINE_SECONDS * 2**k) for k in range(8)]
    # A request that finishes there resets the backoff.
    state.submit("ok", 0, [("p", [1], 1)], sampling())
    (assignment,) = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [3], [-0.5], [0], STOP)
    assert state.instances["flaky"].quarantines == 0


def test_a_token_between_failures_keeps_an_instance_out_of_quarantine():
    state, _ = mesh("a", max_batch_size=1)
    state.submit("b", 0, [("p", [1], 1)], sampling(max_tokens=64))
    for _ in range(2 * QUARANTINE_AFTER):
        (assignment,) = state.assign()
        request = assignment.request
        state.record_chunk(request.request_id, assignment.attempt, [3], [-0.5], [0], NONE)
        state.request_failed(request.request_id, assignment.attempt, "INTERNAL: transient")
    assert state.instances["a"].schedulable and state.instances["a"].quarantined_until == 0
    assert state.requests["b/p/0"].token_ids == [3] * (2 * QUARANTINE_AFTER)


def test_a_sample_that_fails_attempt_after_attempt_ends_its_batch_with_the_reason():
    state, clock = mesh(*(f"i{n}" for n in range(SAMPLE_FAILURES)), max_batch_size=1)
    state.submit("b", 0, [("p", [1], 1)], sampling())
    for _ in range(SAMPLE_FAILURES):
        (assignment,) = state.assign()
        state.request_failed(assignment.request.request_id, assignment.attempt, "INTERNAL: poisoned prompt")
    batch = state.batches["b"]
    assert batch.error == (
        f"sample b/p/0 failed {SAMPLE_FAILURES} times in a row on {SAMPLE_FAILURES} instances, the last on instance "
        f"{assignment.instance.instance_id}: INTERNAL: poisoned prompt"
    )
    assert state.queue == type(state.queue)() and not any(i.running for i in state.instances.values())


def test_a_sample_failing_only_on_broken_instances_goes_on_while_a_healthy_one_is_there():
    """Two broken instances among three: a sample sent to them in turn fails attempt after attempt
    on the same two, which says they are broken, not the sample; it finishes on the healthy one."""
    state, _ = mesh("broken-0", "broken-1", "healthy", max_batch_size=1)
    state.instances["healthy"].draining = True
    state.submit("b", 0, [("p", [1], 1)], sampling())
    for _ in range(2 * SAMPLE_FAILURES):
        (assignment,) = state.assign()
        assert assignment.instance.instance_id != "healthy"
        state.request_failed(assignment.request.request_id, assignment.attempt, "INTERNAL: engine core died")
        state.release_quarantines(float("inf"))
    assert state.batches["b"].error == ""
    state.instances["healthy"].draining = False
    for name in ("broken-0", "broken-1"):
        state.instances[name].draining = True
    (assignment,) = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [3], [-0.5], [0], STOP)
    assert state.requests["b/p/0"].done and state.requests["b/p/0"].instance_ids[-1] == "healthy"


def test_a_sample_failing_where_other_work_goes_through_ends_its_batch_even_in_a_small_pool():
    """A poisoned prompt on two healthy instances: each of its attempts fails on an instance whose
    other work goes through, so each counts against the sample, and the fourth ends it."""
    state, _ = mesh("i0", "i1")
    state.submit("b", 0, [("p", [1], 1)], sampling())
    state.submit("ok", 0, [("q", [1], 1)], sampling())
    poisoned, other = state.requests["b/p/0"], state.requests["ok/q/0"]
    ended = []
    for attempt in range(SAMPLE_FAILURES):
        instance = state.instances[f"i{attempt % 2}"]
        breaker.request_failed(instance, now=0.0)
        ended.append(breaker.sample_failed(poisoned, instance))
        breaker.tokens_arrived(instance, other)
    assert ended == [False] * (SAMPLE_FAILURES - 1) + [True] and poisoned.failed_on == {"i0", "i1"}
