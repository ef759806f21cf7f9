"""A training step's metrics: a step left with no group to train on (dynamic sampling dropped
every one and no prompt was left to draw) is reported as such and divides by nothing."""

import math

from services.trainer.step_totals import StepTotals


def test_a_step_with_zero_groups_is_reported_without_dividing_by_zero():
    totals = StepTotals(dropped_groups=16, wait_seconds=0.5)
    assert totals.figures() == {}
    values = totals.metrics(max_staleness=1, step_seconds=2.0)
    assert values["trained_groups"] == 0 and values["dropped_groups"] == 16
    assert "reward" not in values and "loss" not in values
    assert all(math.isfinite(v) for v in values.values())
