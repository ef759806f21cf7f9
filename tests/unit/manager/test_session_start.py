"""Sessions that wait for their episode (limits.wait_for_start): no deadline runs before the
episode starts, every deadline counts from its start (StartSession, or its first turn), starting
again changes nothing, and a restarted manager still knows which sessions wait."""

from hypothesis import given
from hypothesis import strategies as st

from services.manager.domain.records import DEADLINE, OPEN, Limits
from services.manager.journal import Journal
from tests.support.manager_states import manager_state, open_group
from tests.support.waiting import ManualClock

WAITING = Limits(step_deadline_seconds=5, session_deadline_seconds=50, wait_for_start=True)


@given(waited=st.floats(0, 1e6), ran=st.floats(0, 4.9))
def test_a_waiting_sessions_deadlines_count_from_its_start(waited, ran):
    clock = ManualClock()
    state = manager_state(clock=clock)
    first, second = open_group(state, limits=WAITING)
    clock.now = waited
    assert state.sessions.reap(clock.now) == []
    state.sessions.start(first.session_id)
    clock.now = waited + ran
    assert state.sessions.reap(clock.now) == []
    # Started again (a retried call) the clock does not move.
    state.sessions.start(first.session_id)
    clock.now = waited + 5.5
    [(reaped, _)] = state.sessions.reap(clock.now)
    assert reaped is first and first.status == DEADLINE and "step_deadline_seconds (5)" in first.detail
    assert second.status == OPEN


def test_a_first_turn_starts_a_waiting_session_and_a_session_that_did_not_wait_is_timed_from_its_opening():
    clock = ManualClock()
    state = manager_state(clock=clock)
    waiting, _ = open_group(state, limits=WAITING)
    clock.now = 100
    state.run_turn(waiting.session_id, 0, [], None, None)
    assert not waiting.limits.wait_for_start and waiting.opened_at == 100
    timed = state.open_sessions("c", 0, [("p", [1], 1)], waiting.sampling, Limits(step_deadline_seconds=5))[0]
    clock.now = 106
    assert timed in [session for session, _ in state.sessions.reap(clock.now)]


def test_a_restarted_manager_still_knows_which_sessions_wait(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    state = manager_state()
    started, waiting = open_group(state, limits=WAITING)
    state.sessions.start(started.session_id)
    journal.flush(state)
    journal.close()
    clock = ManualClock()
    restored = manager_state(instances=(), clock=clock)
    Journal(tmp_path / "journal.sqlite").restore(restored, now=0)
    clock.now = 1000
    reaped = {session.session_id for session, _ in restored.sessions.reap(clock.now)}
    assert reaped == {started.session_id}
