"""The manager's scheduling and accounting: dispatch by outstanding tokens, the staleness gate,
late joiners, continuation after an instance vanishes, and exactly-once group delivery."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.manager.state import ManagerState

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


def test_dispatch_prefers_fewest_outstanding_tokens():
    state = state_with({"a": 0, "b": 0})
    state.submit("b1", 0, [("p", [1, 2], 1)], sampling(100))
    first = state.assign()
    assert [a.instance.instance_id for a in first] == ["a"]
    state.submit("b2", 0, [("q", [1], 3)], sampling(10))
    picked = [a.instance.instance_id for a in state.assign()]
    # "a" carries 100 outstanding tokens: all three short requests go to "b".
    assert picked == ["b", "b", "b"]


def test_staleness_gate_holds_samples_until_a_fresh_enough_instance():
    state = state_with({"a": 0}, max_staleness=0)
    state.submit("step1", 1, [("p", [1], 2)], sampling())
    assert state.assign() == []
    state.heartbeat("a", 1, now=1)
    assert len(state.assign()) == 2


def test_staleness_one_lets_a_version_lag_by_one():
    state = state_with({"a": 0}, max_staleness=1)
    state.submit("step1", 1, [("p", [1], 1)], sampling())
    state.submit("step2", 2, [("p", [1], 1)], sampling())
    assigned = state.assign()
    assert [a.request.batch_id for a in assigned] == ["step1"]


def test_a_late_joiner_waits_for_the_published_version():
    state = state_with({}, max_staleness=5)
    state.publish(4)
    state.register("late", "127.0.0.1:9", 0, 8, now=0)
    state.submit("b", 4, [("p", [1], 1)], sampling())
    assert state.assign() == []
    state.heartbeat("late", 4, now=1)
    assert len(state.assign()) == 1


def test_versions_only_grow():
    state = state_with({"a": 3})
    state.publish(5)
    with pytest.raises(FailedPrecondition):
        state.publish(4)
    with pytest.raises(InvalidArgument, match="older"):
        state.heartbeat("a", 2, now=0)


def test_continuation_keeps_generated_tokens_and_shrinks_max_tokens():
    state = state_with({"a": 0, "b": 0})
    state.submit("b1", 0, [("p", [7, 7], 1)], sampling(6))
    (assignment,) = state.assign()
    victim = assignment.instance.instance_id
    state.record_chunk(assignment.request.request_id, assignment.attempt, [1, 2], [-0.1, -0.2], [0, 0], NONE)
    requeued = state.deregister(victim)
    assert [r.request_id for r in requeued] == [assignment.request.request_id]
    (retry,) = state.assign()
    assert retry.instance.instance_id != victim
    prompt, remaining = retry.request.continuation()
    assert prompt == [7, 7, 1, 2] and remaining == 4
    # The dead attempt's late chunk is ignored: nothing is counted twice.
    assert not state.record_chunk(assignment.request.request_id, assignment.attempt, [3], [-0.3], [0], NONE)
    state.record_chunk(retry.request.request_id, retry.attempt, [3, 9], [-0.3, -0.4], [0, 0], STOP)
    groups, remaining_groups = state.take_micro_batch("b1", 1)
    state.finish_batch("b1")
    sample = groups[0][0]
    assert sample.token_ids == [1, 2, 3, 9]
    assert sample.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert sample.instance_ids == [victim, retry.instance.instance_id]
    assert remaining_groups == 0


def test_expired_lease_requeues_and_unknown_heartbeat_is_not_found():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    state.assign()
    expired = state.expire(now=11)
    assert [i.instance_id for i, _ in expired] == ["a"] and len(expired[0][1]) == 1
    with pytest.raises(NotFound):
        state.heartbeat("a", 0, now=12)
    assert len(state.queue) == 1


def test_an_aborted_stream_continues_elsewhere():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling(4))
    (assignment,) = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [5], [-1.0], [0], ABORT)
    (retry,) = state.assign()
    assert retry.request.continuation() == ([1, 5], 3)


def test_micro_batches_never_split_groups_and_wait_for_the_lower_bound():
    state = state_with({"a": 0})
    state.submit("b1", 0, [(f"p{i}", [1], 2) for i in range(5)], sampling())
    assignments = state.assign()
    assert state.take_micro_batch("b1", 2) is None
    for assignment in assignments[:6]:
        state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    groups, remaining = state.take_micro_batch("b1", 2)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups) and remaining == 3
    assert state.take_micro_batch("b1", 2) is None
    for assignment in assignments[6:]:
        state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    assert len(state.take_micro_batch("b1", 2)[0]) == 2
    last, remaining = state.take_micro_batch("b1", 2)
    assert len(last) == 1 and remaining == 0
    state.finish_batch("b1")
    with pytest.raises(NotFound):
        state.take_micro_batch("b1", 2)
    assert state.requests == {}


@pytest.mark.parametrize(
    "batch_id, prompts, params, error",
    [
        ("", [("p", [1], 1)], sampling(), "batch_id"),
        ("b", [], sampling(), "empty"),
        ("b", [("p", [], 1)], sampling(), "no tokens"),
        ("b", [("p", [1], 0)], sampling(), "n must be"),
        ("b", [("p", [1], 1), ("p", [2], 1)], sampling(), "twice"),
        ("b", [("a/b", [1], 1)], sampling(), "prompt_id"),
        ("b", [("p", [1], 1)], sampling(0), "max_tokens"),
    ],
)
def test_bad_submissions_are_refused_whole(batch_id, prompts, params, error):
    state = state_with({"a": 0})
    with pytest.raises(InvalidArgument, match=error):
        state.submit(batch_id, 0, prompts, params)
    assert not state.queue and not state.batches


def test_a_batch_id_is_used_once():
    state = state_with({})
    state.submit("b", 0, [("p", [1], 1)], sampling())
    with pytest.raises(AlreadyExists):
        state.submit("b", 0, [("p", [1], 1)], sampling())


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


@settings(max_examples=200, deadline=None)
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
        live = [a for a in running if state.requests.get(a.request.request_id) and state.requests[a.request.request_id].attempt == a.attempt and state.requests[a.request.request_id].instance_id is not None]
        if event[0] == "tokens" and live:
            assignment = live[event[1] % len(live)]
            count = min(event[2], assignment.request.remaining_tokens)
            tokens = [counter + i for i in range(count)]
            counter += count
            if state.record_chunk(assignment.request.request_id, assignment.attempt, tokens, [0.0] * count, [0] * count, NONE):
                emitted[assignment.request.request_id] += tokens
        elif event[0] == "finish" and live:
            assignment = live[event[1] % len(live)]
            state.record_chunk(assignment.request.request_id, assignment.attempt, [counter], [0.0], [0], STOP)
            emitted[assignment.request.request_id].append(counter)
            counter += 1
        elif event[0] == "kill" and event[1] in state.instances:
            state.deregister(event[1])
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
            state.finish_batch("b")
    assert sorted(r.request_id for r in delivered) == sorted(expected_ids)
    for request in delivered:
        assert request.token_ids == emitted[request.request_id]
        assert len(request.token_ids) <= max_tokens
        assert request.done


def test_a_request_an_instance_refuses_fails_its_batch_instead_of_cycling():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("good", [1], 2), ("bad", [999], 2)], sampling())
    assignments = {a.request.request_id: a for a in state.assign()}
    refused = assignments["b1/bad/0"]
    assert state.reject(refused.request.request_id, refused.attempt, "token ids [999] outside the vocabulary")
    assert state.assign() == []
    with pytest.raises(InvalidArgument, match="prompt 'bad' was refused.*vocabulary"):
        state.take_micro_batch("b1", 1)
    assert state.instances["a"].running == set() and state.instances["a"].outstanding_tokens == 0
    assert state.requests == {} and state.batches == {}


def finish_all(state: ManagerState) -> None:
    for assignment in state.assign():
        state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)


def test_groups_whose_delivery_failed_are_streamed_again():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p0", [1], 1), ("p1", [1], 1), ("p2", [1], 1)], sampling())
    finish_all(state)
    first, remaining = state.take_micro_batch("b1", 2)
    assert remaining == 1
    state.return_groups("b1", first)
    again, remaining = state.take_micro_batch("b1", 2)
    assert [g[0].prompt_id for g in again] == [g[0].prompt_id for g in first] and remaining == 1
    last, remaining = state.take_micro_batch("b1", 2)
    assert remaining == 0 and state.delivered_groups == 3
    state.finish_batch("b1")
    assert state.batches == {} and state.requests == {}


def test_a_cancelled_batch_frees_its_queue_and_slots():
    state = state_with({"a": 0})
    state.instances["a"].max_batch_size = 2
    state.submit("old", 0, [("p", [1], 4)], sampling())
    state.submit("new", 0, [("p", [1], 1)], sampling())
    state.assign()
    assert state.cancel_batch("old") == 4
    assert state.instances["a"].running == set()
    assert [a.request.batch_id for a in state.assign()] == ["new"]
    with pytest.raises(NotFound):
        state.cancel_batch("old")
