"""The manager's state as one facade, for what crosses its modules: an instance's incarnations and
the work they hold, a late joiner and a published version, submissions refused whole, exactly-once
delivery whatever dies, outstanding tokens, starvation and the stage balance. Each module's own
behaviour is tested beside it (test_registry, test_admission, test_scheduling, test_request_table,
test_delivery)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.manager.domain.registry import WrongIncarnation
from services.manager.domain.state import ManagerState

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED
ABORT = common_pb2.FINISH_REASON_ABORT


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def state_with(instances: dict[str, int], max_staleness: int = 0) -> ManagerState:
    state = ManagerState(lease_seconds=10, max_staleness=max_staleness)
    for instance_id, version in instances.items():
        state.register(instance_id, f"127.0.0.1:{len(state.instances) + 1000}", version, 64, now=0)
    return state


def beat(state: ManagerState, instance_id: str, weight_version: int, now: float, draining: bool = False) -> None:
    """A heartbeat from the registered process: it carries its incarnation's token."""
    state.heartbeat(instance_id, weight_version, now, draining, token=state.instances[instance_id].token)


def test_a_late_joiner_waits_for_the_published_version():
    state = state_with({}, max_staleness=5)
    state.publish(4)
    state.register("late", "127.0.0.1:9", 0, 8, now=0)
    state.submit("b", 4, [("p", [1], 1)], sampling())
    assert state.assign() == []
    beat(state, "late", 4, now=1)
    assert len(state.assign()) == 1


def test_versions_only_grow():
    state = state_with({"a": 3})
    state.publish(5)
    with pytest.raises(FailedPrecondition):
        state.publish(4)
    with pytest.raises(InvalidArgument, match="older"):
        beat(state, "a", 2, now=0)


def test_expired_lease_requeues_and_unknown_heartbeat_is_not_found():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    state.assign()
    token = state.instances["a"].token
    expired = state.expire(now=11)
    assert [i.instance_id for i, _ in expired] == ["a"] and len(expired[0][1]) == 1
    with pytest.raises(NotFound, match="'a' is not registered"):
        state.heartbeat("a", 0, now=12, token=token)
    assert len(state.queue) == 1


# Instance identity (the registry's own rules are in test_registry.py) with the work an incarnation
# holds: a refused registration leaves it be, a replaced one's requests continue on the next.


def test_a_registration_under_a_live_id_from_another_address_is_refused():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    (running,) = state.assign()
    original = state.instances["a"]
    with pytest.raises(AlreadyExists) as refused:
        state.register("a", "10.0.0.9:7000", 0, 64, now=2.8)
    assert str(refused.value) == (
        "instance 'a' is registered at 127.0.0.1:1000 and its lease is live (expires in 7.2 s); a new registration "
        "under its id must wait for the lease to expire or come from that address with its incarnation token"
    )
    # Even with the live incarnation's token: a token does not move an instance to another address.
    with pytest.raises(AlreadyExists):
        state.register("a", "10.0.0.9:7000", 0, 64, now=3, token=original.token)
    assert state.instances["a"] is original and original.running == {running.request.request_id}


def test_the_live_incarnation_registering_again_with_its_token_keeps_its_identity_and_work():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling(4))
    (running,) = state.assign()
    original = state.instances["a"]
    assert re.fullmatch("[0-9a-f]{32}", original.token)  # 128 bits, hex
    instance, requeued = state.register("a", original.address, 2, 8, now=5, token=original.token)
    assert instance is original and requeued == []
    assert (instance.token, instance.incarnation) == (original.token, 1)
    assert instance.lease_expires == 15 and instance.weight_version == 2 and instance.max_batch_size == 8
    # Its stream goes on: the running request is still its own and its chunks are taken.
    assert state.record_chunk(running.request.request_id, running.attempt, [7], [0.0], [2], STOP)


def test_after_the_lease_expired_a_restarted_process_is_a_new_incarnation_and_continues_the_old_ones_samples():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling(6))
    (old,) = state.assign()
    assert state.record_chunk(old.request.request_id, old.attempt, [3, 4], [-0.3, -0.4], [0, 0], NONE)
    old_token = state.instances["a"].token
    # The process was killed; its lease runs out before the restarted one registers (no token).
    state.expire(now=11)
    new, requeued = state.register("a", "127.0.0.1:1000", 0, 64, now=12)
    assert requeued == []
    assert new.incarnation == 2 and new.token != old_token
    # The old incarnation's calls are refused; the new one's are not.
    with pytest.raises(WrongIncarnation):
        state.heartbeat("a", 0, now=13, token=old_token)
    with pytest.raises(WrongIncarnation):
        state.deregister("a", old_token, now=13)
    beat(state, "a", 0, now=13)
    # The sample continues on the new incarnation from the tokens the old one generated.
    (retry,) = state.assign()
    assert retry.instance is new and retry.request.token_ids == [3, 4] and retry.request.remaining_tokens == 4
    charged = new.outstanding_tokens
    # A chunk of the old incarnation arriving late is not taken, and charges nothing to the new one.
    assert not state.record_chunk(old.request.request_id, old.attempt, [5], [-0.5], [0], NONE)
    assert state.request_table.discarded_tokens == 1 and new.outstanding_tokens == charged
    state.record_chunk(retry.request.request_id, retry.attempt, [6, 7], [-0.6, -0.7], [0, 0], STOP)
    (group,), remaining = state.take_micro_batch("b1", 1)
    assert remaining == 0
    assert group[0].token_ids == [3, 4, 6, 7] and group[0].instance_ids == ["a", "a"]


def test_an_expired_lease_not_yet_swept_is_replaced_and_its_requests_requeued():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    (old,) = state.assign()
    new, requeued = state.register("a", "127.0.0.1:1000", 0, 64, now=10.5)
    assert new.incarnation == 2 and [r.request_id for r in requeued] == [old.request.request_id]
    assert not state.record_chunk(old.request.request_id, old.attempt, [1], [0.0], [0], STOP)


@pytest.mark.parametrize(
    "batch_id, prompts, params, error",
    [
        ("", [("p", [1], 1)], sampling(), "batch_id"),
        ("b", [], sampling(), "empty"),
        ("b", [("p", [], 1)], sampling(), "no tokens"),
        ("b", [("p", [1], 0)], sampling(), "n must be"),
        ("b", [("p", [1], 1), ("p", [2], 1)], sampling(), "twice"),
        ("b", [("a/b", [1], 1)], sampling(), "prompt_id"),
        ("b", [("a@1", [1], 1)], sampling(), "prompt_id"),
        ("b", [("p", [1], 1)], sampling(0), "max_tokens"),
        ("b", [("p", [1], 1), ("q", [1], 1, sampling(0))], sampling(), "prompt 'q': sampling.max_tokens"),
    ],
)
def test_bad_submissions_are_refused_whole(batch_id, prompts, params, error):
    state = state_with({"a": 0})
    with pytest.raises(InvalidArgument, match=error):
        state.submit(batch_id, 0, prompts, params)
    assert not state.queue and not state.batches


events = st.lists(
    st.one_of(
        st.tuples(st.just("tokens"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("kill"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("join"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("lost"), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=200)
@given(events)
def test_whatever_dies_when_every_sample_arrives_once_with_its_tokens(script):
    """Random interleavings of generation, finishes, stream failures, instance deaths and joins:
    every accepted sample is delivered exactly once, and every token an instance reported for
    the current attempt is kept (never regenerated, never duplicated)."""
    max_tokens = 6
    state = ManagerState(lease_seconds=10, max_staleness=0)
    state.register("a", "127.0.0.1:1", 0, 4, now=0)
    state.submit("b", 0, [(f"p{i}", [1], 3) for i in range(4)], sampling(max_tokens))
    expected_ids = {r for r in state.requests}
    emitted: dict[str, list[int]] = {r: [] for r in expected_ids}
    counter = 0
    running = []

    def refresh():
        running.extend(state.assign())

    refresh()
    for event in script:
        live = [
            a
            for a in running
            if state.requests.get(a.request.request_id)
            and state.requests[a.request.request_id].attempt == a.attempt
            and state.requests[a.request.request_id].instance_id is not None
        ]
        if event[0] == "tokens" and live:
            assignment = live[event[1] % len(live)]
            count = min(event[2], assignment.request.remaining_tokens)
            tokens = [counter + i for i in range(count)]
            counter += count
            if state.record_chunk(
                assignment.request.request_id, assignment.attempt, tokens, [0.0] * count, [0] * count, NONE
            ):
                emitted[assignment.request.request_id] += tokens
        elif event[0] == "finish" and live:
            assignment = live[event[1] % len(live)]
            state.record_chunk(assignment.request.request_id, assignment.attempt, [counter], [0.0], [0], STOP)
            emitted[assignment.request.request_id].append(counter)
            counter += 1
        elif event[0] == "kill" and event[1] in state.instances:
            state.remove(event[1])
        elif event[0] == "join" and event[1] not in state.instances:
            state.register(event[1], "127.0.0.1:2", 0, 4, now=0)
        elif event[0] == "lost" and live:
            assignment = live[event[1] % len(live)]
            state.stream_lost(assignment.request.request_id, assignment.attempt)
        refresh()
    # Let whatever is left finish on a fresh instance.
    state.register("z", "127.0.0.1:3", 0, 64, now=0)
    refresh()
    for _ in range(30):
        for assignment in list(running):
            request = state.requests.get(assignment.request.request_id)
            if request and request.attempt == assignment.attempt and request.instance_id is not None:
                state.record_chunk(request.request_id, assignment.attempt, [counter], [0.0], [0], STOP)
                emitted[request.request_id].append(counter)
                counter += 1
        refresh()
    delivered = []
    while "b" in state.batches:
        taken = state.take_micro_batch("b", 1)
        assert taken is not None, "a group never completed"
        delivered += [r for group in taken[0] for r in group]
        if taken[1] == 0:
            state.acknowledge("b")
    assert sorted(r.request_id for r in delivered) == sorted(expected_ids)
    for request in delivered:
        assert request.token_ids == emitted[request.request_id]
        assert len(request.token_ids) <= max_tokens
        assert request.done


def finish_all(state: ManagerState) -> None:
    for assignment in state.assign():
        state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)


def test_a_draining_instance_gets_no_work_and_its_aborted_requests_continue_elsewhere():
    state = state_with({"a": 0, "b": 0})
    state.instances["b"].max_batch_size = 1
    state.submit("b1", 0, [("p", [1], 1)], sampling(10))
    (first,) = state.assign()
    draining = first.instance.instance_id
    beat(state, draining, 0, now=1, draining=True)
    assert not state.instances[draining].schedulable
    state.record_chunk(first.request.request_id, first.attempt, [4, 5], [0.0, 0.0], [0, 0], ABORT)
    (second,) = state.assign()
    assert second.instance.instance_id != draining and second.request.token_ids == [4, 5]
    beat(state, draining, 0, now=2)
    assert state.instances[draining].draining


def test_work_without_any_instance_is_reported_starving():
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: 0.0)
    assert state.starved_seconds(now=50) == 0  # nothing waits
    state.submit("b", 0, [("p", [1], 1)], sampling())
    assert state.starved_seconds(now=50) == 50
    state.register("a", "127.0.0.1:1", 0, 4, now=60)
    assert state.starved_seconds(now=70) == 0
    state.deregister("a", state.instances["a"].token, now=80)
    assert state.starved_seconds(now=95) == 15


def test_training_reports_feed_the_stage_balance():
    now = [0.0]
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: now[0])
    state.register("a", "127.0.0.1:1", 0, 4, now=0)
    state.submit("b", 0, [("p", [1], 1)], sampling())
    with pytest.raises(NotFound):
        state.report_training_step("b", 5.0, 1.0)
    now[0] = 4.0
    finish_all(state)
    state.take_micro_batch("b", 1)
    balance = state.report_training_step("b", step_seconds=5.0, wait_seconds=1.0)
    assert balance.rollout_seconds == pytest.approx(4.0) and balance.observed_steps == 1
    with pytest.raises(InvalidArgument):
        state.report_training_step("b", step_seconds=1.0, wait_seconds=2.0)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("chunk"), st.integers(0, 30), st.integers(0, 4), st.sampled_from([NONE, STOP, ABORT])),
        st.tuples(st.just("lost"), st.integers(0, 30)),
        st.tuples(st.just("drop"), st.sampled_from(["a", "b"])),
        st.tuples(st.just("join"), st.sampled_from(["a", "b"])),
        st.tuples(
            st.just("migrate"),
        ),
        st.tuples(st.just("measure"), st.floats(1, 500), st.floats(1, 50)),
    ),
    max_size=80,
)


@settings(max_examples=200)
@given(operations)
def test_outstanding_tokens_always_equal_what_running_requests_are_charged(script):
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: 0.0)
    state.register("a", "127.0.0.1:1", 0, 3, now=0)
    state.register("b", "127.0.0.1:2", 0, 5, now=0)
    state.submit("b", 0, [(f"p{i}", [1], 3) for i in range(4)], sampling(12))
    live = list(state.assign())
    for op in script:
        current = [a for a in live if state.request_table.current(a.request.request_id, a.attempt)]
        if op[0] == "chunk" and current:
            a = current[op[1] % len(current)]
            state.record_chunk(a.request.request_id, a.attempt, [1] * op[2], [0.0] * op[2], [0] * op[2], op[3])
        elif op[0] == "lost" and current:
            a = current[op[1] % len(current)]
            state.stream_lost(a.request.request_id, a.attempt)
        elif op[0] == "drop" and op[1] in state.instances:
            state.remove(op[1])
        elif op[0] == "join" and op[1] not in state.instances:
            state.register(op[1], "127.0.0.1:3", 0, 4, now=0)
        elif op[0] == "migrate":
            state.plan_migrations()
        elif op[0] == "measure":
            for instance in state.instances.values():
                instance.tokens_per_second, instance.sequence_tokens_per_second = op[1], op[2]
        live += state.assign()
        for instance in state.instances.values():
            charged = sum(state.requests[r].charged for r in instance.running)
            assert instance.outstanding_tokens == pytest.approx(charged, abs=1e-6)
            assert len(instance.running) <= instance.max_batch_size
        queued = {r.request_id for r in state.queue}
        running = {r for i in state.instances.values() for r in i.running}
        done = {r.request_id for r in state.requests.values() if r.done}
        # Every sample is in exactly one place: queued, running, or done.
        assert not (queued & running) and not (queued & done) and not (running & done)
        assert queued | running | done == set(state.requests)


def test_a_chunk_of_a_newer_version_tells_the_manager_before_the_heartbeat():
    state = state_with({"a": 0}, max_staleness=0)
    state.submit("step0", 0, [("p", [1], 1)], sampling())
    state.submit("step1", 1, [("p", [1], 1)], sampling())
    state.publish(1)
    (running,) = state.assign()
    assert running.request.batch_id == "step0"
    state.record_chunk(running.request.request_id, running.attempt, [4, 5], [0.0, 0.0], [0, 1], NONE)
    assert state.instances["a"].weight_version == 1
    assert [a.request.batch_id for a in state.assign()] == ["step1"]
    # A heartbeat sent before the switch, arriving after the chunk, neither fails nor lowers the version.
    beat(state, "a", 0, now=1)
    assert state.instances["a"].weight_version == 1
    beat(state, "a", 1, now=2)
    with pytest.raises(InvalidArgument, match="older than the reported 1"):
        beat(state, "a", 0, now=3)
