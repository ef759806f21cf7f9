"""Inter-stage balance: the local window moves by a third of the bubble difference, and the
recommendations follow the measured gap between training and rollout."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.manager.domain.stage_balance import StageBalancer, StepTiming


def test_the_window_grows_while_the_trainer_waits_and_shrinks_while_rollout_idles():
    balancer = StageBalancer(history=1)
    first = balancer.observe(
        StepTiming(step_seconds=10, wait_seconds=4, rollout_seconds=9, tokens=1000),
        instances=2,
        reserved_tokens_per_second=50,
    )
    # Starts at the rollout time (9 s), then + (4 - 1) / 3.
    assert first.local_window_seconds == pytest.approx(10.0)
    second = balancer.observe(
        StepTiming(step_seconds=10, wait_seconds=0, rollout_seconds=4, tokens=1000),
        instances=2,
        reserved_tokens_per_second=50,
    )
    assert second.local_window_seconds == pytest.approx(10.0 - 6 / 3)
    assert second.rollout_idle_seconds == pytest.approx(6)


def test_recommendations_follow_the_gap():
    balancer = StageBalancer(history=3)
    for _ in range(3):
        balance = balancer.observe(
            StepTiming(step_seconds=12, wait_seconds=8, rollout_seconds=11, tokens=4000),
            instances=2,
            reserved_tokens_per_second=100,
        )
    # Training works 4 s per step and rollout takes 11 s on 2 instances: 2 * 11 / 4 = 5.5 -> 6.
    assert balance.recommended_rollout_instances == 6
    assert balance.train_seconds == pytest.approx(4)
    assert balance.observed_steps == 3
    assert 0 <= balance.offload_fraction <= 1


def test_overlapped_rollout_is_sized_by_its_work_not_by_how_far_ahead_it_ran():
    """A batch submitted 4 steps ahead takes 45 s from submission to its last group while 10 instances
    of 1,000 tok/s generate its 120,000 tokens in 12 s of a 15 s training step: 8 instances would do."""
    balancer = StageBalancer(history=1)
    timing = StepTiming(step_seconds=15, wait_seconds=0, rollout_seconds=45, tokens=120_000)
    by_time = balancer.observe(timing, instances=10, reserved_tokens_per_second=0)
    by_work = StageBalancer(history=1).observe(
        timing, instances=10, reserved_tokens_per_second=0, fleet_tokens_per_second=10_000, overlapped=True
    )
    assert by_time.recommended_rollout_instances == 30
    assert by_work.recommended_rollout_instances == 8
    waiting = StageBalancer(history=1).observe(
        StepTiming(step_seconds=30, wait_seconds=15, rollout_seconds=45, tokens=240_000),
        instances=10,
        reserved_tokens_per_second=0,
        fleet_tokens_per_second=10_000,
        overlapped=True,
    )
    # The trainer waits half of each step: 240,000 tokens in 15 s of training take 16 instances.
    assert waiting.recommended_rollout_instances == 16


def test_inconsistent_timings_are_refused():
    with pytest.raises(ValueError):
        StageBalancer().observe(
            StepTiming(step_seconds=1, wait_seconds=2, rollout_seconds=1, tokens=1),
            instances=1,
            reserved_tokens_per_second=1,
        )


@given(
    st.lists(
        st.tuples(st.floats(0.1, 100), st.floats(0, 1), st.floats(0.01, 100), st.integers(0, 10**6)),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 64),
    st.floats(0, 10_000),
)
def test_estimates_stay_in_range(steps, instances, reserved_rate):
    balancer = StageBalancer(min_window_seconds=0.5)
    for step, wait_share, rollout, tokens in steps:
        balance = balancer.observe(StepTiming(step, step * wait_share, rollout, tokens), instances, reserved_rate)
        assert balance.local_window_seconds >= 0.5
        assert 0.0 <= balance.offload_fraction <= 1.0
        assert balance.recommended_rollout_instances >= 1
