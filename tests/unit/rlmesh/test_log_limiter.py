"""Repeated log events are rate-limited with a count; distinct ones are never dropped."""

import pytest
import structlog

from rlmesh.logging import MAX_TRACKED_EVENTS, RepeatLimiter
from tests.support.waiting import ManualClock


def written(limiter: RepeatLimiter, event: dict) -> dict | None:
    try:
        return dict(limiter(None, "warning", dict(event)))
    except structlog.DropEvent:
        return None


def test_an_event_repeated_request_after_request_is_written_a_few_times_per_window_then_counted():
    clock = ManualClock()
    limiter = RepeatLimiter(window=10, limit=5, clock=clock)
    lines = [
        written(limiter, {"event": "request failed", "instance_id": "r0", "request": f"b/p{i}/0"}) for i in range(1000)
    ]
    assert sum(line is not None for line in lines) == 5
    clock.now = 10
    line = written(limiter, {"event": "request failed", "instance_id": "r0", "request": "b/q/0"})
    assert line is not None and line["repeats_dropped"] == 995
    assert (
        written(limiter, {"event": "request failed", "instance_id": "r0", "request": "b/q/1"}).get("repeats_dropped")
        is None
    )


@pytest.mark.parametrize("other", [{"instance_id": "r1"}, {"step": 7}, {"code": "UNKNOWN"}])
def test_events_that_differ_in_more_than_the_request_are_each_written(other):
    limiter = RepeatLimiter(window=10, limit=1, clock=ManualClock())
    assert written(limiter, {"event": "request failed", "instance_id": "r0", "code": "INTERNAL"}) is not None
    assert written(limiter, {"event": "request failed", "instance_id": "r0", "code": "INTERNAL", **other}) is not None


def test_an_event_held_back_stays_held_back_while_thousands_of_distinct_ones_pass():
    clock = ManualClock()
    limiter = RepeatLimiter(window=10, limit=2, clock=clock)
    failure = {"event": "request failed", "instance_id": "r0"}
    assert [written(limiter, failure) is not None for _ in range(3)] == [True, True, False]
    assert all(written(limiter, {"event": "step", "step": step}) is not None for step in range(MAX_TRACKED_EVENTS * 2))
    assert written(limiter, failure) is None
    clock.now = 10
    assert written(limiter, failure)["repeats_dropped"] == 2
