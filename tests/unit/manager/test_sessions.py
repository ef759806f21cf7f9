"""Multi-turn sessions in the manager: turns run from the canonical stream (never re-tokenized), a
turn continues elsewhere from its tokens, retried calls get the same turn, limits and deadlines end
a session, edited histories start a part, closed groups deliver once, and the journal keeps it all."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.records import (
    DEADLINE,
    DONE,
    ENVIRONMENT,
    MODEL,
    OPEN,
    TEMPLATE,
    TRUNCATED_CONTEXT,
    TRUNCATED_TURNS,
    Limits,
    Segment,
    stream_of,
)
from services.manager.domain.state import ManagerState
from services.manager.domain.trajectories import trajectory
from services.manager.journal import Journal
from tests.support.manager_states import manager_state, open_group, seeded_sampling
from tests.support.waiting import ManualClock

STOP = common_pb2.FINISH_REASON_STOP
ABORT = common_pb2.FINISH_REASON_ABORT
NONE = common_pb2.FINISH_REASON_UNSPECIFIED


def env(*tokens: int) -> Segment:
    return Segment(ENVIRONMENT, list(tokens))


def generate(state: ManagerState, tokens: list[int], finish=STOP, version: int = 0):
    """Runs the one assignment the queue holds: the instance sends `tokens` and finishes."""
    [assignment] = state.assign()
    request = assignment.request
    state.record_chunk(
        request.request_id, assignment.attempt, tokens, [-0.5] * len(tokens), [version] * len(tokens), finish
    )
    return assignment


def test_a_turn_generates_from_the_whole_stream_and_appends_the_models_segment():
    state = manager_state()
    first, _ = open_group(state)
    running = state.run_turn(first.session_id, 0, [Segment(TEMPLATE, [9])], None, None).running
    assert running.prompt_token_ids == [1, 2, 3, 9]
    generate(state, [20, 21])
    segments = first.segments
    assert [(s.source, s.token_ids) for s in segments] == [(ENVIRONMENT, [1, 2, 3]), (TEMPLATE, [9]), (MODEL, [20, 21])]
    assert (
        segments[-1].logprobs == [-0.5, -0.5]
        and segments[-1].weight_versions == [0, 0]
        and segments[-1].instance_ids == ["a"]
    )
    second = state.run_turn(first.session_id, 1, [env(30)], None, None).running
    # The model's own tokens come back exactly as sampled: nothing is re-tokenized.
    assert second.prompt_token_ids == [1, 2, 3, 9, 20, 21, 30]
    assert first.session_id + "#1" == second.request_id


def test_a_turn_whose_instance_dies_continues_elsewhere_from_its_tokens():
    state = manager_state(("a", "b"))
    session, _ = open_group(state, n=1 + 1)
    state.run_turn(session.session_id, 0, [], None, None)
    [assignment] = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [40, 41], [-1.0, -1.0], [0, 0], NONE)
    gone = assignment.instance.instance_id
    state.remove(gone)
    [again] = state.assign()
    assert again.instance.instance_id != gone
    assert again.request.token_ids == [40, 41]
    state.record_chunk(again.request.request_id, again.attempt, [42], [-2.0], [0], STOP)
    model = session.segments[-1]
    assert model.token_ids == [40, 41, 42] and model.logprobs == [-1.0, -1.0, -2.0]
    assert model.instance_ids == [gone, again.instance.instance_id]


def test_a_retried_call_gets_the_same_turn_never_a_second_one():
    state = manager_state()
    session, _ = open_group(state)
    first = state.run_turn(session.session_id, 0, [env(5)], None, None)
    retried = state.run_turn(session.session_id, 0, [env(5)], None, None)
    assert retried.running is first.running
    generate(state, [7])
    done = state.run_turn(session.session_id, 0, [env(5)], None, None)
    assert done.running is None and done.segment.token_ids == [7] and done.status == OPEN
    assert [s.token_ids for s in session.segments] == [[1, 2, 3], [5], [7]]
    with pytest.raises(FailedPrecondition, match="next is turn 1, not 3"):
        state.run_turn(session.session_id, 3, [], None, None)


def test_a_call_for_a_started_turn_that_asks_for_other_tokens_is_refused_not_given_that_turn():
    """A retry must be the same request: one with another body (after a gateway's 5xx, say) would
    otherwise get the reply to the first."""
    state = manager_state()
    session, _ = open_group(state)
    state.run_turn(session.session_id, 0, [env(5)], None, None)
    with pytest.raises(FailedPrecondition, match="turn 0 was asked for with other segments to append"):
        state.run_turn(session.session_id, 0, [env(6)], None, None)
    generate(state, [7])
    with pytest.raises(FailedPrecondition, match="keep_tokens 2 .it started with None"):
        state.run_turn(session.session_id, 0, [env(5)], 2, None)
    assert state.run_turn(session.session_id, 0, [env(5)], None, None).segment.token_ids == [7]
    state.run_turn(session.session_id, 1, [env(9)], 3, None)
    with pytest.raises(FailedPrecondition, match="keep_tokens None .it started with 3"):
        state.run_turn(session.session_id, 1, [env(9)], None, None)
    assert state.run_turn(session.session_id, 1, [env(9)], 3, None).running is session.turn


def test_a_break_keeps_the_cause_its_caller_named_and_is_counted():
    state = manager_state()
    session, other = open_group(state)
    state.run_turn(session.session_id, 0, [], None, None)
    generate(state, [7, 8])
    state.run_turn(session.session_id, 1, [Segment(ENVIRONMENT, [50], break_cause="content_mismatch")], 4, None)
    assert session.segments[-1].starts_part and trajectory(session).segments[-1].break_cause == "content_mismatch"
    assert state.sessions.breaks_by_cause == {"content_mismatch": 1}
    with pytest.raises(InvalidArgument, match="break_cause names why a history broke"):
        state.run_turn(other.session_id, 0, [Segment(ENVIRONMENT, [50], break_cause="edited_message")], None, None)


def test_the_next_turn_goes_to_the_instance_that_served_the_last():
    state = manager_state(("a", "b"))
    session, _ = open_group(state)
    state.run_turn(session.session_id, 0, [], None, None)
    served = generate(state, [7]).instance.instance_id
    state.run_turn(session.session_id, 1, [env(8)], None, None)
    [assignment] = state.assign()
    assert assignment.instance.instance_id == served


def test_limits_end_a_session_instead_of_generating():
    state = manager_state()
    turns_bound, context_bound = state.open_sessions(
        "b", 0, [("p", [1, 2], 1), ("q", [1, 2], 1)], seeded_sampling(8), Limits(max_turns=1, max_total_tokens=6)
    )
    state.run_turn(turns_bound.session_id, 0, [], None, None)
    # The turn's max_tokens is cut to what the stream has room for.
    [assignment] = state.assign()
    assert assignment.request.sampling.max_tokens == 4
    state.record_chunk(assignment.request.request_id, assignment.attempt, [5], [-1.0], [0], STOP)
    ended = state.run_turn(turns_bound.session_id, 1, [env(6)], None, None)
    assert ended.running is None and ended.status == TRUNCATED_TURNS and turns_bound.status == TRUNCATED_TURNS
    overflow = state.run_turn(context_bound.session_id, 0, [env(3, 4, 5, 6)], None, None)
    assert overflow.status == TRUNCATED_CONTEXT and "max_total_tokens is 6" in context_bound.detail


def test_bad_appends_and_unknown_sessions_are_refused_and_change_nothing():
    state = manager_state()
    session, _ = open_group(state)
    with pytest.raises(InvalidArgument, match="only the engine adds model tokens"):
        state.run_turn(session.session_id, 0, [Segment(MODEL, [1])], None, None)
    with pytest.raises(InvalidArgument, match="keep_tokens 9 exceeds the 3 tokens"):
        state.run_turn(session.session_id, 0, [env(1)], 9, None)
    with pytest.raises(NotFound, match="session 'nope' is unknown"):
        state.run_turn("nope", 0, [], None, None)
    with pytest.raises(InvalidArgument, match="limits.turn_deadline_seconds"):
        state.open_sessions("c", 0, [("p", [1], 1)], seeded_sampling(), Limits(turn_deadline_seconds=-1))
    assert session.turns == 0 and len(session.segments) == 1 and "c" not in state.batches and not state.queue


def test_an_edited_history_starts_a_part_that_reuses_the_kept_prefix():
    state = manager_state()
    session, _ = open_group(state)
    state.run_turn(session.session_id, 0, [], None, None)
    generate(state, [7, 8])
    running = state.run_turn(session.session_id, 1, [env(50, 51)], 4, None).running
    assert running.prompt_token_ids == [1, 2, 3, 7, 50, 51]
    part = session.segments[-1]
    assert part.starts_part and part.reused_prefix_tokens == 4


@settings(max_examples=80)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 99), min_size=1, max_size=4), st.integers(0, 12) | st.none()),
        min_size=1,
        max_size=6,
    )
)
def test_the_stream_is_the_kept_prefix_of_each_part_plus_what_followed(steps):
    segments, expected = [], []
    for tokens, keep in steps:
        keep = None if keep is None or keep > len(expected) else keep
        segment = Segment(ENVIRONMENT, tokens)
        if keep is not None:
            segment.starts_part, segment.reused_prefix_tokens = True, keep
            expected = expected[:keep]
        segments.append(segment)
        expected = expected + tokens
        assert stream_of(segments) == expected


def test_a_group_is_delivered_once_every_session_closed_with_its_trajectory():
    state = manager_state()
    first, second = open_group(state)
    state.run_turn(first.session_id, 0, [], None, None)
    generate(state, [7])
    state.sessions.set_reward(first.session_id, 1.0, None)
    state.sessions.set_reward(first.session_id, 0.5, 0)
    state.close_session(first.session_id, DONE, "")
    assert state.take_ready("b") == ([], 1)
    _, dropped = state.close_session(second.session_id, DONE, "")
    assert dropped is None
    # A second close keeps the first status.
    state.close_session(second.session_id, DEADLINE, "")
    assert second.status == DONE
    [group], remaining = state.take_ready("b")
    assert remaining == 0 and [r.request_id for r in group] == [first.session_id, second.session_id]
    assert group[0].token_ids == [7]
    assert first.reward == 1.0 and first.turn_rewards == {0: 0.5}


def test_closing_a_session_drops_its_running_turn():
    state = manager_state()
    session, _ = open_group(state)
    state.run_turn(session.session_id, 0, [], None, None)
    [assignment] = state.assign()
    _, dropped = state.close_session(session.session_id, manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR, "raised")
    assert dropped is assignment.request and dropped.request_id not in state.requests
    assert not state.instances["a"].running
    # Its late chunk is discarded, never recorded.
    assert not state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    assert session.segments[-1].source == ENVIRONMENT


def test_a_session_past_a_deadline_is_reaped_and_its_slot_done():
    clock = ManualClock()
    state = manager_state(clock=clock)
    idle, slow = open_group(state, limits=Limits(step_deadline_seconds=5, turn_deadline_seconds=2))
    state.run_turn(slow.session_id, 0, [], None, None)
    # Waiting in the queue is not generating: the turn's clock starts on an instance.
    clock.now = 1
    assert state.sessions.reap(clock.now) == []
    state.assign()
    assert state.sessions.reap(clock.now) == []
    clock.now = 3.5
    [(reaped, dropped)] = state.sessions.reap(clock.now)
    assert reaped is slow and dropped is not None and "turn 0 generated for more than" in slow.detail
    clock.now = 6
    [(reaped, _)] = state.sessions.reap(clock.now)
    assert reaped is idle and idle.status == DEADLINE
    [group], _ = state.take_ready("b")
    assert len(group) == 2


def test_a_restarted_manager_keeps_open_sessions_and_continues_their_running_turn(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    state = manager_state()
    session, other = open_group(state)
    state.run_turn(session.session_id, 0, [env(4)], None, None)
    generate(state, [7])
    state.sessions.set_reward(session.session_id, 0.25, 0)
    conversation = [
        LoggedMessage("user"),
        LoggedMessage("model", 5, "<|im_end|>", "content", "calls"),
        LoggedMessage("tool"),
    ]
    state.run_turn(session.session_id, 1, [env(8)], None, None, conversation)
    [assignment] = state.assign()
    state.record_chunk(assignment.request.request_id, assignment.attempt, [9], [-1.0], [0], NONE)
    state.close_session(other.session_id, DONE, "")
    journal.flush(state)
    journal.close()

    restored = ManagerState(lease_seconds=10, max_staleness=0, clock=ManualClock())
    Journal(tmp_path / "journal.sqlite").restore(restored, now=0)
    again = restored.sessions.get(session.session_id)
    assert [s.token_ids for s in again.segments] == [[1, 2, 3], [4], [7], [8]]
    assert again.turns == 2 and again.turn_rewards == {0: 0.25} and again.key == session.key
    assert again.conversation == conversation
    assert restored.sessions.get(other.session_id).status == DONE
    # The running turn continues from its token, as the retried call of turn 1 finds it.
    state_of_turn = restored.run_turn(session.session_id, 1, [env(8)], None, None)
    assert state_of_turn.running.token_ids == [9]
    assert restored.queue[0] is state_of_turn.running


def test_a_reward_sent_after_the_manager_truncated_a_session_counts_until_its_owner_closes_it():
    state = manager_state()
    truncated, other = open_group(state, limits=Limits(max_turns=1))
    state.run_turn(truncated.session_id, 0, [], None, None)
    generate(state, [7])
    assert state.run_turn(truncated.session_id, 1, [env(8)], None, None).status == TRUNCATED_TURNS
    state.close_session(other.session_id, DONE, "")
    # The agent is still scoring its episode: the group waits for its owner's close.
    assert state.take_ready("b") == ([], 1)
    state.sessions.set_reward(truncated.session_id, 1.0, None)
    state.close_session(truncated.session_id, DONE, "")
    assert truncated.status == TRUNCATED_TURNS and truncated.reward == 1.0
    [group], _ = state.take_ready("b")
    assert [r.request_id for r in group] == [truncated.session_id, other.session_id]
    # Once its owner closed it, its group may be on its way: a late reward is refused, never lost.
    with pytest.raises(FailedPrecondition, match="closed .*TRUNCATED_TURNS.*no reward"):
        state.sessions.set_reward(truncated.session_id, 0.5, None)
    assert truncated.reward == 1.0


def test_a_truncated_session_its_owner_never_closes_is_settled_at_its_step_deadline():
    clock = ManualClock()
    state = manager_state(clock=clock)
    [session] = state.open_sessions(
        "b", 0, [("p", [1, 2], 1)], seeded_sampling(), Limits(max_turns=1, step_deadline_seconds=5)
    )
    state.run_turn(session.session_id, 0, [], None, None)
    generate(state, [7])
    state.run_turn(session.session_id, 1, [env(8)], None, None)
    clock.now = 4
    assert state.sessions.reap(clock.now) == [] and state.take_ready("b") == ([], 1)
    clock.now = 6
    [(reaped, dropped)] = state.sessions.reap(clock.now)
    assert reaped is session and dropped is None and session.status == TRUNCATED_TURNS
    [group], _ = state.take_ready("b")
    assert group[0].request_id == session.session_id


def test_a_turn_failing_again_and_again_ends_its_session_not_its_batch():
    state = manager_state(("a", "b", "c", "d", "e"))
    failing, other = open_group(state)
    state.run_turn(failing.session_id, 0, [], None, None)
    for _ in range(4):
        [assignment] = state.assign()
        failure = state.request_failed(assignment.request.request_id, assignment.attempt, "CUDA out of memory")
    assert not failure.batch_failed and not state.batches["b"].error
    assert failing.status == manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR and "CUDA out of memory" in failing.detail
    assert not state.queue and failing.turn is None
    # The batch's other sessions go on.
    state.run_turn(other.session_id, 0, [], None, None)
    generate(state, [9])
    state.close_session(other.session_id, DONE, "")
    state.close_session(failing.session_id, manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR, "")
    [group], _ = state.take_ready("b")
    assert len(group) == 2
