"""The manager's scheduling and accounting: dispatch by outstanding tokens, the staleness gate,
late joiners, continuation after an instance vanishes, exactly-once group delivery, and
exact-version batches (held-out evaluation of a named version)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from rlmesh.sampling import MAX_SEED
from services.manager.domain.registry import WrongIncarnation
from services.manager.domain.state import ManagerState

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED
ABORT = common_pb2.FINISH_REASON_ABORT


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def state_with(instances: dict[str, int], max_staleness: int = 0, policy: str = "balanced") -> ManagerState:
    state = ManagerState(lease_seconds=10, max_staleness=max_staleness, policy=policy)
    for instance_id, version in instances.items():
        state.register(instance_id, f"127.0.0.1:{len(state.instances) + 1000}", version, 64, now=0)
    return state


def beat(state: ManagerState, instance_id: str, weight_version: int, now: float, draining: bool = False) -> None:
    """A heartbeat from the registered process: it carries its incarnation's token."""
    state.heartbeat(instance_id, weight_version, now, draining, token=state.instances[instance_id].token)


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
    state.publish(1)
    assert state.assign() == []
    beat(state, "a", 1, now=1)
    assert len(state.assign()) == 2


def test_staleness_one_lets_a_version_lag_by_one():
    state = state_with({"a": 0}, max_staleness=1)
    state.submit("step1", 1, [("p", [1], 1)], sampling())
    state.submit("step2", 2, [("p", [1], 1)], sampling())
    state.publish(1)
    assigned = state.assign()
    assert [a.request.batch_id for a in assigned] == ["step1"]


def test_the_capacity_rule_holds_a_step_until_the_trainer_is_within_staleness_of_it():
    state = state_with({"a": 0}, max_staleness=1)
    state.submit("step2", 2, [("p", [1], 1)], sampling())
    beat(state, "a", 1, now=1)
    # The instance is fresh enough (1 >= 2 - 1) but the trainer has published only 0.
    assert state.assign() == []
    state.publish(1)
    assert [a.request.batch_id for a in state.assign()] == ["step2"]


@settings(max_examples=60)
@given(
    staleness=st.integers(0, 3),
    batch_size=st.integers(1, 4),
    events=st.lists(st.sampled_from(["submit", "push", "publish", "finish", "drop"]), min_size=1, max_size=60),
)
def test_accepted_plus_running_never_exceeds_the_capacity(staleness, batch_size, events):
    """accepted + running <= (eta + v + 1) * B at every dispatch, every refill of a dropped group
    is dispatched once the trainer reaches it, and everything submitted is dispatched in the end."""
    state = state_with({"a": 0}, max_staleness=staleness)
    state.instances["a"].max_batch_size = 10_000
    submitted_steps, started, dropped, finished = 0, [], 0, set()

    def dispatch() -> None:
        for assignment in state.assign():
            started.append(assignment.request)
            accepted_or_running = len(started) - dropped
            assert accepted_or_running <= (staleness + state.published_version + 1) * batch_size
            assert assignment.request.policy_version <= state.published_version + staleness

    for event in events:
        if event == "submit":
            state.submit(
                f"step{submitted_steps}", submitted_steps, [(f"p{i}", [1], 1) for i in range(batch_size)], sampling(1)
            )
            submitted_steps += 1
        elif event == "push" and state.instances["a"].weight_version == state.published_version:
            # The weights service pushes a version before the trainer announces it to the manager.
            beat(state, "a", state.published_version + 1, now=0)
        elif event == "publish" and state.instances["a"].weight_version > state.published_version:
            state.publish(state.instances["a"].weight_version)
        elif event in ("finish", "drop"):
            running = [r for r in started if r.request_id not in finished]
            if running:
                request = running[0]
                finished.add(request.request_id)
                state.record_chunk(
                    request.request_id, request.attempt, [1], [0.0], [state.instances["a"].weight_version], STOP
                )
                if event == "drop":
                    # The trainer drops the group (all rewards equal) and refills it for the same step.
                    dropped += 1
                    state.submit(f"refill{dropped}", request.policy_version, [("r", [1], 1)], sampling(1))
        dispatch()
    while state.published_version + 1 < submitted_steps:
        beat(state, "a", state.published_version + 1, now=0)
        state.publish(state.published_version + 1)
        dispatch()
    assert not state.queue


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


def test_continuation_keeps_generated_tokens_and_shrinks_max_tokens():
    state = state_with({"a": 0, "b": 0})
    state.submit("b1", 0, [("p", [7, 7], 1)], sampling(6))
    (assignment,) = state.assign()
    victim = assignment.instance.instance_id
    state.record_chunk(assignment.request.request_id, assignment.attempt, [1, 2], [-0.1, -0.2], [0, 0], NONE)
    requeued = state.remove(victim)
    assert [r.request_id for r in requeued] == [assignment.request.request_id]
    (retry,) = state.assign()
    assert retry.instance.instance_id != victim
    assert retry.request.prompt_token_ids == [7, 7] and retry.request.token_ids == [1, 2]
    assert retry.request.remaining_tokens == 4
    # The dead attempt's late chunk is ignored: nothing is counted twice.
    assert not state.record_chunk(assignment.request.request_id, assignment.attempt, [3], [-0.3], [0], NONE)
    state.record_chunk(retry.request.request_id, retry.attempt, [3, 9], [-0.3, -0.4], [0, 0], STOP)
    groups, remaining_groups = state.take_micro_batch("b1", 1)
    assert state.acknowledge("b1")
    sample = groups[0][0]
    assert sample.token_ids == [1, 2, 3, 9]
    assert sample.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert sample.instance_ids == [victim, retry.instance.instance_id]
    assert remaining_groups == 0


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


# Instance identity: a registration returns an incarnation token; while the lease is live only the
# registered process (its address, its token) may use the id.


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


def test_a_registration_under_a_live_id_without_its_token_is_refused():
    state = state_with({"a": 0})
    original = state.instances["a"]
    for token in ("", "0" * 32, original.token.upper(), "non-ascii \u00e9"):
        with pytest.raises(AlreadyExists, match="lease is live"):
            state.register("a", original.address, 0, 64, now=5, token=token)
    assert state.instances["a"] is original and state.registrations == 1


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


def test_every_incarnation_gets_its_own_token():
    """Tokens are secrets drawn per registration: two instances, or two incarnations of one, never share one."""
    state = state_with({"a": 0, "b": 0})
    first, other = state.instances["a"].token, state.instances["b"].token
    state.expire(now=11)
    again, _ = state.register("a", "127.0.0.1:1000", 0, 64, now=11)
    assert all(re.fullmatch("[0-9a-f]{32}", token) for token in (first, other, again.token))
    assert len({first, other, again.token}) == 3 and again.incarnation == 3


def test_calls_without_the_live_incarnations_token_are_refused():
    state = state_with({"a": 0})
    live = state.instances["a"]
    with pytest.raises(WrongIncarnation, match="'a': the call carries no incarnation token"):
        state.heartbeat("a", 0, now=1, token="")
    with pytest.raises(WrongIncarnation, match="carries the token of another incarnation"):
        state.heartbeat("a", 0, now=1, token="f" * 32)
    with pytest.raises(WrongIncarnation):
        state.deregister("a", "f" * 32, now=1)
    assert state.instances["a"] is live and live.lease_expires == 10


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
    assert state.ledger.discarded_tokens == 1 and new.outstanding_tokens == charged
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


def test_after_a_deregistration_the_id_registers_again_at_once():
    state = state_with({"a": 0})
    first = state.instances["a"]
    state.deregister("a", first.token, now=1)
    second, _ = state.register("a", first.address, 0, 64, now=1.5)
    assert second.incarnation == 2 and second.token != first.token


def test_an_aborted_stream_continues_elsewhere():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling(4))
    (assignment,) = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [5], [-1.0], [0], ABORT)
    (retry,) = state.assign()
    assert retry.request.token_ids == [5] and retry.request.remaining_tokens == 3


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
    assert state.acknowledge("b1") and not state.acknowledge("b1")
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


def test_a_prompt_with_its_own_sampling_keeps_it_and_the_others_take_the_batchs():
    state = state_with({"a": 0})
    own = common_pb2.SamplingParams(temperature=0.5, max_tokens=40)
    state.submit("b", 0, [("task1", [1], 2, own), ("task2", [1], 2, None), ("task3", [1], 2)], sampling(8))
    by_prompt = {a.request.prompt_id: a.request.sampling for a in state.assign()}
    assert (by_prompt["task1"].temperature, by_prompt["task1"].max_tokens) == (0.5, 40)
    assert by_prompt["task2"].max_tokens == by_prompt["task3"].max_tokens == 8


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


def test_groups_sent_but_not_read_come_again_from_the_readers_position():
    state = state_with({"a": 0})
    state.submit("b1", 0, [("p0", [1], 1), ("p1", [1], 1), ("p2", [1], 1)], sampling())
    finish_all(state)
    first, remaining = state.take_micro_batch("b1", 2)
    assert remaining == 1
    again, remaining = state.take_micro_batch("b1", 2, position=0)
    assert [g[0].prompt_id for g in again] == [g[0].prompt_id for g in first] and remaining == 1
    with pytest.raises(FailedPrecondition, match="1 groups still to be sent"):
        state.acknowledge("b1")
    with pytest.raises(InvalidArgument, match="resume_from 3 is past the 2 groups"):
        state.take_micro_batch("b1", 2, position=3)
    last, remaining = state.take_micro_batch("b1", 2, position=2)
    assert remaining == 0 and state.delivery.delivered_groups == 3
    assert state.take_micro_batch("b1", 2, position=3) == ([], 0)
    assert state.acknowledge("b1")
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


def measured(state: ManagerState, rates: dict[str, tuple[float, float]]) -> None:
    for instance_id, (total, per_sequence) in rates.items():
        state.instances[instance_id].tokens_per_second = total
        state.instances[instance_id].sequence_tokens_per_second = per_sequence


def test_dispatch_weighs_outstanding_tokens_by_measured_throughput():
    state = state_with({"fast": 0, "slow": 0})
    # Same speed per sequence, three times the throughput (more sequences at once).
    measured(state, {"fast": (300.0, 10.0), "slow": (100.0, 10.0)})
    state.submit("b", 0, [(f"p{i}", [1], 1) for i in range(40)], sampling(10))
    picked = [a.instance.instance_id for a in state.assign()]
    # Expected finish times stay level: three times the work goes to the three times faster one.
    assert picked.count("fast") == 30 and picked.count("slow") == 10


def test_near_the_end_a_much_slower_instance_starts_nothing():
    def assigned(requests: int) -> list[str]:
        state = state_with({"fast": 0, "slow": 0})
        state.instances["fast"].max_batch_size = 3
        measured(state, {"fast": (100.0, 50.0), "slow": (10.0, 5.0)})
        state.submit("b", 0, [(f"p{i}", [1], 1) for i in range(requests)], sampling(10))
        return [a.instance.instance_id for a in state.assign()]

    # 600 queued tokens keep the fast instance busy for 6 s; a request takes the slow one 2 s.
    assert assigned(60).count("slow") > 0
    # 30 queued tokens are 0.3 s of work for the fast one: the slow one would only delay them.
    assert assigned(3) == ["fast", "fast", "fast"]


def test_round_robin_ignores_speed_and_load():
    state = state_with({"a": 0, "b": 0, "c": 0}, policy="round_robin")
    measured(state, {"a": (300.0, 10.0), "b": (100.0, 3.0), "c": (1.0, 1.0)})
    state.submit("b1", 0, [(f"p{i}", [1], 1) for i in range(7)], sampling(10))
    assert [a.instance.instance_id for a in state.assign()] == ["a", "b", "c", "a", "b", "c", "a"]
    assert state.plan_migrations() == []


def test_a_seeded_batch_gives_every_sample_its_own_stable_seed():
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=7)
    first, second = state_with({}), state_with({})
    first.submit("b", 0, [("p", [1], 4)], params)
    second.submit("b", 0, [("p", [1], 4)], params)
    seeds = [r.sampling.seed for r in first.requests.values()]
    assert len(set(seeds)) == 4 and 0 not in seeds
    # Seeds the rollout service takes: below 2^62 (torch adds a continuation's length to them).
    assert all(seed < MAX_SEED for seed in seeds)
    assert seeds == [r.sampling.seed for r in second.requests.values()]


def straggler_setup() -> tuple[ManagerState, list]:
    state = state_with({"fast": 0, "slow": 0})
    state.instances["fast"].max_batch_size = 2
    state.instances["slow"].max_batch_size = 4
    state.submit("b", 0, [(f"p{i}", [1], 1) for i in range(6)], sampling(100))
    assignments = state.assign()
    # Speeds become known once both generate.
    measured(state, {"fast": (200.0, 100.0), "slow": (40.0, 10.0)})
    return state, assignments


def test_stragglers_move_from_a_slow_instance_to_an_idle_fast_one():
    state, assignments = straggler_setup()
    on_fast = [a for a in assignments if a.instance.instance_id == "fast"]
    on_slow = [a for a in assignments if a.instance.instance_id == "slow"]
    assert len(on_fast) == 2 and len(on_slow) == 4
    # Not while work is still queued, and not before the fast one has a free slot.
    assert state.plan_migrations() == []
    for a in on_slow:
        state.record_chunk(
            a.request.request_id,
            a.attempt,
            [1] * (on_slow.index(a) + 1),
            [0.0] * (on_slow.index(a) + 1),
            [0] * (on_slow.index(a) + 1),
            NONE,
        )
    for a in on_fast:
        state.record_chunk(a.request.request_id, a.attempt, [2], [0.0], [0], STOP)
    moved = state.plan_migrations()
    # Two free slots on "fast": the two slow requests expected to run longest go there.
    assert [r.request_id for r in moved] == [on_slow[3].request.request_id, on_slow[2].request.request_id]
    assert state.plan_migrations() == []
    # The abort's last chunk arrives with one more token; the request continues on "fast".
    victim = on_slow[3]
    state.record_chunk(victim.request.request_id, victim.attempt, [9], [-0.5], [0], ABORT)
    (again,) = state.assign()
    assert again.instance.instance_id == "fast"
    assert again.request.token_ids == [1, 1, 1, 1, 9]
    assert state.ledger.migrated_samples == 1 and state.ledger.continued_tokens == 5


def test_no_migration_between_instances_of_equal_speed():
    state = state_with({"a": 0, "b": 0})
    state.instances["a"].max_batch_size = 1
    measured(state, {"a": (100.0, 50.0), "b": (100.0, 50.0)})
    state.submit("b1", 0, [(f"p{i}", [1], 1) for i in range(3)], sampling(100))
    for a in state.assign():
        if a.instance.instance_id == "a":
            state.record_chunk(a.request.request_id, a.attempt, [1], [0.0], [0], STOP)
    assert state.plan_migrations() == []


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


def test_late_chunks_of_an_abandoned_attempt_count_as_discarded():
    state = state_with({"a": 0, "b": 0})
    state.submit("b1", 0, [("p", [1], 1)], sampling(10))
    (first,) = state.assign()
    state.stream_lost(first.request.request_id, first.attempt)
    assert not state.record_chunk(first.request.request_id, first.attempt, [1, 2, 3], [0.0] * 3, [0] * 3, NONE)
    assert state.ledger.discarded_tokens == 3


def test_work_without_any_instance_is_reported_starving():
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: 0.0)
    assert state.starved_seconds(now=50) == 0  # nothing waits
    state.submit("b", 0, [("p", [1], 1)], sampling())
    assert state.starved_seconds(now=50) == 50
    state.register("a", "127.0.0.1:1", 0, 4, now=60)
    assert state.starved_seconds(now=70) == 0
    state.deregister("a", state.instances["a"].token, now=80)
    assert state.starved_seconds(now=95) == 15


def complete_groups(state: ManagerState, sizes: list[int], unfinished: int = 0) -> None:
    state.submit("b", 0, [(f"p{i}", [1, 2], 1) for i in range(len(sizes) + unfinished)], sampling(100))
    for a in sorted(state.assign(), key=lambda a: int(a.request.prompt_id[1:]))[: len(sizes)]:
        size = sizes[int(a.request.prompt_id[1:])]
        state.record_chunk(a.request.request_id, a.attempt, [1] * size, [0.0] * size, [0] * size, STOP)


def test_dynamic_micro_batches_take_what_is_ready_within_bounds():
    state = state_with({"a": 0})
    complete_groups(state, [3, 3, 3], unfinished=2)
    assert state.take_micro_batch("b", 8, min_groups=4) is None
    groups, remaining = state.take_micro_batch("b", 8, min_groups=2)
    assert len(groups) == 3 and remaining == 2
    with pytest.raises(InvalidArgument, match="min_groups"):
        state.take_micro_batch("b", 2, min_groups=3)


def test_token_budget_packs_whole_groups():
    state = state_with({"a": 0})
    complete_groups(state, [3, 3, 10, 1])  # 5, 5, 12 and 3 tokens with the prompt
    sizes = []
    while True:
        groups, remaining = state.take_micro_batch("b", 4, min_groups=1, max_tokens=10)
        sizes.append([len(g[0].prompt_token_ids) + len(g[0].token_ids) for g in groups])
        if remaining == 0:
            break
    # Never split; a group over budget travels alone.
    assert sizes == [[5, 5], [12], [3]]


def test_give_me_everything_ready():
    state = state_with({"a": 0})
    state.submit("b", 0, [(f"p{i}", [1], 1) for i in range(3)], sampling())
    assignments = state.assign()
    assert state.take_ready("b") == ([], 3)
    for a in assignments[:2]:
        state.record_chunk(a.request.request_id, a.attempt, [1], [0.0], [0], STOP)
    groups, remaining = state.take_ready("b")
    assert len(groups) == 2 and remaining == 1


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
        current = [a for a in live if state.ledger.current(a.request.request_id, a.attempt)]
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


# Exact-version batches: every token from exactly the named version; background work. ---------------


def test_an_exact_version_sample_runs_only_on_an_instance_serving_exactly_its_version():
    state = state_with({"older": 0, "exact": 1, "newer": 2}, max_staleness=2)
    state.publish(2)
    state.submit("eval", 1, [("p", [1], 6)], sampling(), exact_version=True)
    assignments = state.assign()
    assert len(assignments) == 6 and {a.instance.instance_id for a in assignments} == {"exact"}


def test_an_exact_version_batch_is_outside_the_capacity_rule():
    state = state_with({"a": 3}, max_staleness=0)
    state.publish(1)
    state.submit("train", 3, [("p", [1], 1)], sampling())
    state.submit("eval", 3, [("p", [1], 1)], sampling(), exact_version=True)
    # Version 3 is beyond the published 1 + max_staleness 0: a training step waits, an evaluation does not.
    assert [a.request.batch_id for a in state.assign()] == ["eval"]


def test_exact_version_samples_take_the_slots_that_free_up_before_training_samples():
    state = state_with({"a": 1}, max_staleness=0)
    state.publish(1)
    state.instances["a"].max_batch_size = 3
    state.submit("train", 1, [("t", [1], 2)], sampling())
    assert [a.request.batch_id for a in state.assign()] == ["train", "train"]
    state.submit("eval", 1, [("e", [1], 3)], sampling(), exact_version=True)
    state.submit("train2", 1, [("t", [1], 1)], sampling())
    # Running training samples are never preempted: the one free slot goes to the evaluation.
    assert [a.request.batch_id for a in state.assign()] == ["eval"]
    first = next(r for r in state.requests.values() if r.batch_id == "train" and r.instance_id)
    state.record_chunk(first.request_id, first.attempt, [1], [0.0], [1], STOP)
    # The freed slot goes to the waiting evaluation sample, not to the training one submitted after it.
    assert [a.request.batch_id for a in state.assign()] == ["eval"]


def test_a_validation_stays_on_one_instance_while_the_others_take_training_samples():
    state = state_with({"a": 1, "b": 1}, max_staleness=1)
    state.publish(1)
    for instance in state.instances.values():
        instance.max_batch_size = 4
    state.submit("eval", 1, [("e", [1], 6)], sampling(), exact_version=True)
    state.submit("train", 1, [("t", [1], 4)], sampling())
    placed = {(a.instance.instance_id, a.request.batch_id) for a in state.assign()}
    assert placed in ({("a", "eval"), ("b", "train")}, {("b", "eval"), ("a", "train")})
    (holder,) = {i for i, batch in placed if batch == "eval"}
    other = ({"a", "b"} - {holder}).pop()
    assert len(state.instances[holder].running) == 4 and len(state.instances[other].running) == 4
    # The two evaluation samples left wait for the holder's slots, not for the other's.
    finished = next(iter(state.instances[other].running))
    state.record_chunk(finished, state.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert state.assign() == []
    finished = next(iter(state.instances[holder].running))
    state.record_chunk(finished, state.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in state.assign()] == [(holder, "eval")]


def test_training_samples_wait_for_another_instance_rather_than_join_background_work():
    state = state_with({"a": 1, "b": 1}, max_staleness=1)
    state.publish(1)
    for instance in state.instances.values():
        instance.max_batch_size = 4
    state.submit("eval", 1, [("e", [1], 2)], sampling(), exact_version=True, background=True)
    state.submit("train", 1, [("t", [1], 6)], sampling())
    placed = [(a.instance.instance_id, a.request.batch_id) for a in state.assign()]
    (holder,) = {i for i, batch in placed if batch == "eval"}
    other = ({"a", "b"} - {holder}).pop()
    # The holder has two free slots, yet the training samples left wait for the other instance.
    assert sorted(placed) == sorted([(holder, "eval")] * 2 + [(other, "train")] * 4)
    assert state.instances[holder].free_slots == 2 and state.assign() == []
    finished = next(iter(state.instances[other].running))
    state.record_chunk(finished, state.requests[finished].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in state.assign()] == [(other, "train")]
    # Once the background work ended, the holder takes training samples again.
    for request_id in list(state.instances[holder].running):
        state.record_chunk(request_id, state.requests[request_id].attempt, [1], [0.0], [1], STOP)
    assert [(a.instance.instance_id, a.request.batch_id) for a in state.assign()] == [(holder, "train")]


def test_with_one_instance_training_samples_share_it_with_background_work():
    state = state_with({"a": 1}, max_staleness=1)
    state.publish(1)
    state.instances["a"].max_batch_size = 4
    state.submit("eval", 1, [("e", [1], 2)], sampling(), exact_version=True, background=True)
    state.submit("train", 1, [("t", [1], 2)], sampling())
    assert sorted(a.request.batch_id for a in state.assign()) == ["eval", "eval", "train", "train"]


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


def test_an_exact_version_batch_fails_out_of_range_once_no_instance_serves_its_version():
    state = state_with({"a": 1}, max_staleness=0)
    state.publish(1)
    state.instances["a"].max_batch_size = 2
    state.submit("eval", 1, [("p", [1], 3)], sampling(), exact_version=True)
    first, second = state.assign()
    state.publish(2)
    # The trainer moved on, but "a" still serves version 1: the waiting sample waits for its slot.
    assert state.assign() == [] and "eval" in state.batches and not state.batches["eval"].error
    state.record_chunk(first.request.request_id, first.attempt, [7], [0.0], [1], STOP)
    (third,) = state.assign()
    # A version 2 push is committing on "a": it refuses new samples of version 1.
    assert state.version_refused(third.request.request_id, third.attempt)
    assert state.instances["a"].refused_version == 1 and third.request.instance_ids == []
    assert state.assign() == []
    batch = state.batches["eval"]
    assert batch.error and batch.version_gone and not state.queue
    # The sample still running is let go: it no longer holds the instance's switch back.
    assert state.instances["a"].running == set()
    assert not state.record_chunk(second.request.request_id, second.attempt, [8], [0.0], [1], NONE)
    with pytest.raises(
        OutOfRange,
        match=r"version 1 is no longer served by any instance: evaluation of it is skipped \(2 of its samples unfinished; published version 2\)",
    ):
        state.take_micro_batch("eval", 1)
    assert state.batches == {} and state.requests == {}


def test_an_exact_version_batch_waits_for_its_version_and_fails_once_every_instance_is_past_it():
    state = state_with({"a": 0, "b": 0}, max_staleness=0)
    state.publish(1)
    state.submit("eval1", 1, [("p", [1], 1)], sampling(), exact_version=True)
    # Version 1 is the latest: the instances are about to serve it.
    assert state.assign() == [] and not state.batches["eval1"].error
    beat(state, "a", 1, now=1)
    beat(state, "b", 2, now=1)
    assert [a.instance.instance_id for a in state.assign()] == ["a"]
    state.submit("eval0", 0, [("p", [1], 1)], sampling(), exact_version=True)
    state.assign()
    with pytest.raises(OutOfRange, match="version 0 is no longer served"):
        state.take_micro_batch("eval0", 1)
    assert "eval1" in state.batches and not state.batches["eval1"].error


def test_an_exact_version_sample_keeps_only_its_versions_tokens_from_an_instance_that_switched():
    """An instance predating the pin ignores it: what it generated on the version is kept, and the
    sample continues on an instance still serving it."""
    state = state_with({"old": 1, "b": 1}, max_staleness=0)
    state.publish(1)
    state.instances["b"].max_batch_size = 0
    state.submit("eval", 1, [("p", [1], 1)], sampling(), exact_version=True)
    (first,) = state.assign()
    assert not state.record_chunk(
        first.request.request_id, first.attempt, [4, 5, 6], [-0.1, -0.2, -0.3], [1, 2, 2], NONE
    )
    request = first.request
    assert (request.token_ids, request.logprobs, request.weight_versions) == ([4], [pytest.approx(-0.1)], [1])
    assert state.ledger.discarded_tokens == 2 and state.instances["old"].weight_version == 2
    state.instances["b"].max_batch_size = 4
    (second,) = state.assign()
    assert second.instance.instance_id == "b" and second.request.token_ids == [4]


def test_exact_version_samples_waiting_do_not_hold_back_straggler_migration():
    state, assignments = straggler_setup()
    for index, a in enumerate(assignments):
        finish = STOP if a.instance.instance_id == "fast" else NONE
        state.record_chunk(
            a.request.request_id, a.attempt, [1] * (index + 1), [0.0] * (index + 1), [0] * (index + 1), finish
        )
    state.submit("eval", 5, [("e", [1], 1)], sampling(), exact_version=True)
    assert state.assign() == [] and len(state.queue) == 1
    assert len(state.plan_migrations()) == 2
