"""The scale simulator (bench/simulation): its traces, its instances' decode model and versions,
and runs of the manager's real domain through preemptions, crashes and the autoscaler, where
nothing may be lost, duplicated, regenerated or trained too stale."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cost import break_even_ratio, dollars_per_thousand_steps
from bench.simulation import scenarios
from bench.simulation.fleet import InstanceModel, Sequence, SimInstance
from bench.simulation.traces import TraceSettings, trace_events
from bench.simulation.world import Simulation
from services.rollout.synthetic_engine import SyntheticConfig

SETTINGS = TraceSettings()


def test_the_burst_takes_its_share_within_two_minutes_and_gives_it_all_back_over_twenty():
    events = trace_events("burst", 100, 3600, seed=3, settings=replace(SETTINGS, preemptions_per_instance_hour=0))
    gone = [e for e in events if e.kind == "preempt"]
    back = [e for e in events if e.kind == "join"]
    assert len(gone) == len(back) == 30
    assert all(SETTINGS.burst_at <= e.at <= SETTINGS.burst_at + SETTINGS.burst_seconds for e in gone)
    end = SETTINGS.burst_at + SETTINGS.burst_seconds + SETTINGS.burst_return_seconds
    assert max(e.at for e in back) == pytest.approx(end)
    assert {e.slot for e in gone} == {e.slot for e in back}


@given(st.sampled_from(["poisson", "burst", "join"]), st.integers(1, 60), st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_a_slot_is_never_taken_while_it_is_away_nor_given_back_while_it_is_there(trace, fleet, seed):
    events = trace_events(trace, fleet, 7200, seed, replace(SETTINGS, preemptions_per_instance_hour=3.0))
    late = range(round(fleet * SETTINGS.join_start_fraction), fleet) if trace == "join" else range(0)
    present = {slot: slot not in late for slot in range(fleet)}
    for event in events:
        assert present[event.slot] == (event.kind == "preempt"), event
        present[event.slot] = event.kind == "join"


def model(throughput=100.0, min_step=0.04, batch=8, interval=4) -> InstanceModel:
    return InstanceModel(throughput, min_step, batch, SyntheticConfig(mean_tokens=50.0), interval)


def test_a_decode_step_takes_what_the_synthetic_engine_takes():
    instance = SimInstance("a", model(), speed=2.0, warning_seconds=30)
    assert instance.step_seconds() == pytest.approx(0.04 / 2)
    instance.running = {str(i): None for i in range(8)}
    assert instance.step_seconds() == pytest.approx(max(0.04, 8 / 100) / 2)
    assert model().saturation_batch_size == 4


@given(
    st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=0, max_size=5),
    st.floats(min_value=0.0, max_value=20.0),
    st.integers(0, 30),
    st.integers(0, 30),
)
def test_every_unit_carries_the_version_in_force_at_its_step(switch_gaps, start, first, count):
    instance = SimInstance("a", model(), speed=1.0, warning_seconds=0)
    at = 0.0
    for version, gap in enumerate(switch_gaps, start=1):
        at += gap
        instance.switches.append((at, version))
    sequence = Sequence(request=None, attempt=1, start=start, target=first + count, reason=0)
    versions = instance.versions(sequence, first, first + count)
    assert len(versions) == count
    assert versions == sorted(versions)
    for unit, version in zip(range(first, first + count), versions, strict=True):
        # The last switch at or before the unit's step, up to a unit's rounding at a boundary.
        expected = max(v for a, v in instance.switches if a <= start + unit)
        later = max((v for a, v in instance.switches if a < start + unit + 1), default=expected)
        assert expected <= version <= later


def small_fleet(trace: str, **changes) -> Simulation:
    scenario = replace(scenarios.reference(12, steps=14), **changes)
    settings = replace(
        scenario.trace_settings,
        burst_at=40.0,
        burst_seconds=20.0,
        burst_return_seconds=60.0,
        preemptions_per_instance_hour=20.0,
        replacement_seconds=(10.0, 30.0),
        unannounced_fraction=0.5,
        join_seconds=60.0,
    )
    return Simulation(replace(scenario, trace_settings=settings, boot_seconds=10.0), trace, seed=5)


@pytest.mark.parametrize("trace", ["poisson", "burst", "join"])
def test_through_preemptions_crashes_and_joins_every_sample_is_trained_once_and_fresh_enough(trace):
    simulation = small_fleet(trace)
    outcome = simulation.run()
    accounts = simulation.trainer.accounts
    assert outcome.steps == 14
    assert outcome.preemptions + outcome.crashes > 0
    assert accounts.lost == accounts.duplicated == 0
    assert accounts.trained_samples == 14 * 12 * scenarios.PROMPTS_PER_INSTANCE * scenarios.GROUP_SIZE
    assert accounts.violations == 0 and accounts.max_staleness_seen <= scenarios.MAX_STALENESS
    assert outcome.regenerated_units == 0
    # A chunk is a unit here: a crash loses nothing the stream had not sent.
    assert outcome.lost_in_flight_units == 0
    assert 0 < outcome.ideal_seconds <= outcome.seconds


def test_the_autoscaler_keeps_the_fleet_within_its_bounds_and_moves_one_instance_at_a_time():
    simulation = small_fleet("poisson", autoscale=(6, 14), autoscale_patience_seconds=4, autoscale_cooldown_seconds=8)
    outcome = simulation.run()
    counts = [12] + [count for _, count in outcome.scale_changes]
    assert outcome.scale_changes, "the recommendation never moved the fleet"
    assert all(6 <= c <= 14 for c in counts)
    assert all(abs(b - a) == 1 for a, b in zip(counts, counts[1:], strict=False))
    times = [t for t, _ in outcome.scale_changes]
    assert all(b - a >= 8 for a, b in zip(times, times[1:], strict=False))
    assert simulation.trainer.accounts.lost == simulation.trainer.accounts.duplicated == 0


def test_spot_pays_until_its_price_with_its_overheads_reaches_the_reserved_cost():
    reserved = {"hours": 1.0, "instance_hours": 10.0, "steps": 100}
    spot = {"hours": 1.1, "instance_hours": 12.0, "steps": 100}
    trainer_gpus = 4
    at_even = break_even_ratio(reserved, spot, trainer_gpus, 0.0)
    reserved_cost = dollars_per_thousand_steps(reserved, trainer_gpus, 2.0)
    assert dollars_per_thousand_steps(spot, trainer_gpus, 2.0 * at_even) == pytest.approx(reserved_cost)
    half = break_even_ratio(reserved, spot, trainer_gpus, 0.5)
    assert dollars_per_thousand_steps(spot, trainer_gpus, 2.0 * half) == pytest.approx(reserved_cost / 2)
