"""A training step's metrics: a step left with no group to train on (dynamic sampling dropped
every one and no prompt was left to draw) is reported as such and divides by nothing; the
episodes' broken histories are counted by cause."""

import math

from services.trainer.step_totals import StepTotals, episode_metrics
from services.trainer.trajectories import EpisodeFigures


def test_a_step_with_zero_groups_is_reported_without_dividing_by_zero():
    totals = StepTotals(dropped_groups=16, wait_seconds=0.5)
    assert totals.figures() == {}
    values = totals.metrics(max_staleness=1, step_seconds=2.0)
    assert values["trained_groups"] == 0 and values["dropped_groups"] == 16
    assert "reward" not in values and "loss" not in values
    assert all(math.isfinite(v) for v in values.values())


def test_breaks_are_counted_by_cause_per_step():
    episodes = [
        EpisodeFigures("done", 3, 1.0, parts=3, breaks={"content_mismatch": 1, "mixed_endpoints": 1}),
        EpisodeFigures("done", 3, 1.0, parts=2, breaks={"content_mismatch": 1}),
        EpisodeFigures("done", 3, 1.0),
    ]
    values = episode_metrics(episodes)
    assert values["gateway/breaks/content_mismatch"] == 2 and values["gateway/breaks/mixed_endpoints"] == 1
    assert values["episodes/broken_histories"] == 2
