"""The local provisioner's rule: bounded, patient, cooled down, one instance at a time."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.launch.autoscale import Autoscaler


def test_a_lasting_recommendation_adds_one_instance_after_the_patience():
    scaler = Autoscaler(1, 4, patience_seconds=10, cooldown_seconds=20)
    assert scaler.observe(0, 3, 1) is None
    assert scaler.observe(5, 3, 1) is None
    assert scaler.observe(10, 3, 1) == 2
    # Still short of the recommendation, but inside the cooldown.
    assert scaler.observe(15, 3, 2) is None
    assert scaler.observe(30, 3, 2) == 3
    assert scaler.observe(100, 3, 3) is None


def test_a_flapping_recommendation_changes_nothing():
    scaler = Autoscaler(1, 4, patience_seconds=10, cooldown_seconds=0)
    for t, recommended in enumerate([3, 1, 3, 1, 3, 1, 3, 1] * 4):
        assert scaler.observe(t * 4, recommended, 2) is None


def test_bounds_hold_and_no_estimate_keeps_the_count():
    scaler = Autoscaler(2, 3, patience_seconds=0, cooldown_seconds=0)
    assert scaler.observe(0, 9, 3) is None
    assert scaler.observe(1, 0, 3) is None
    assert scaler.observe(2, 1, 2) is None
    with pytest.raises(ValueError, match="minimum <= maximum"):
        Autoscaler(3, 2)


@given(st.integers(1, 4), st.integers(0, 4), st.lists(st.tuples(st.floats(0, 50), st.integers(0, 12)), max_size=60))
def test_the_count_stays_in_bounds_and_changes_by_one_at_most_once_per_cooldown(minimum, extra, observations):
    maximum = minimum + extra
    scaler = Autoscaler(minimum, maximum, patience_seconds=5, cooldown_seconds=20)
    now, current, changes = 0.0, minimum, []
    for step, recommended in observations:
        now += step
        new = scaler.observe(now, recommended, current)
        if new is not None:
            assert abs(new - current) == 1 and minimum <= new <= maximum
            changes.append(now)
            current = new
    assert all(b - a >= 20 for a, b in zip(changes, changes[1:]))
