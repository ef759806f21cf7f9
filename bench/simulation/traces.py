"""Fleet traces: when instances are preempted (with their cloud's notice, or none) and when
instances join, drawn from a seed: Poisson preemptions, a correlated burst, a fleet growing."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

TraceName = Literal["steady", "poisson", "burst", "join"]
TRACES: tuple[TraceName, ...] = ("poisson", "burst", "join")

CLOUD_WARNINGS = (30.0, 120.0)
"""Preemption notices of the two clouds the fleet is spread over (seconds)."""


@dataclass(frozen=True, slots=True)
class FleetEvent:
    at: float
    kind: Literal["preempt", "join"]
    slot: int
    """Which place in the fleet: a preempted slot's replacement joins under the same slot."""


@dataclass(frozen=True, slots=True)
class TraceSettings:
    preemptions_per_instance_hour: float = 0.5
    """Poisson hazard of each spot instance (the background of every trace but steady)."""
    replacement_seconds: tuple[float, float] = (60.0, 180.0)
    """A preempted instance's replacement is requested at once and joins after this long (uniform)."""
    burst_at: float = 300.0
    burst_fraction: float = 0.3
    burst_seconds: float = 120.0
    """The burst: this fraction of the fleet gone within this long, from burst_at on..."""
    burst_return_seconds: float = 1200.0
    """...and back, spread evenly over this long after the burst."""
    join_start_fraction: float = 0.5
    """The join trace: the fleet starts at this fraction and the rest joins..."""
    join_seconds: float = 600.0
    """...spread evenly over this long from the start."""
    unannounced_fraction: float = 0.1
    """Preemptions that come with no notice at all: the instance just vanishes."""


def trace_events(name: TraceName, fleet: int, duration: float, seed: int, settings: TraceSettings) -> list[FleetEvent]:
    """The fleet's events over `duration`, oldest first. Slots [0, fleet) start in the fleet except
    those the join trace holds back; every preemption's replacement joins later (never twice at once)."""
    rng = random.Random(seed)
    events: list[FleetEvent] = []
    if name == "join":
        late = range(round(fleet * settings.join_start_fraction), fleet)
        for index, slot in enumerate(late):
            events.append(FleetEvent(settings.join_seconds * (index + 1) / len(late), "join", slot))
    if name == "burst":
        victims = rng.sample(range(fleet), round(fleet * settings.burst_fraction))
        for index, slot in enumerate(victims):
            gone = settings.burst_at + rng.uniform(0.0, settings.burst_seconds)
            back = (
                settings.burst_at + settings.burst_seconds + settings.burst_return_seconds * (index + 1) / len(victims)
            )
            events += [FleetEvent(gone, "preempt", slot), FleetEvent(back, "join", slot)]
    if name != "steady" and settings.preemptions_per_instance_hour > 0:
        events += _poisson(fleet, duration, rng, settings, events)
    return sorted(events, key=lambda e: (e.at, e.kind != "preempt", e.slot))


def _poisson(
    fleet: int, duration: float, rng: random.Random, settings: TraceSettings, planned: list[FleetEvent]
) -> list[FleetEvent]:
    """Each slot's background preemptions, while the slot is in the fleet (not between a planned
    departure and its return), each followed by its replacement."""
    away: dict[int, list[tuple[float, float]]] = {}
    by_slot: dict[int, list[FleetEvent]] = {}
    for event in planned:
        by_slot.setdefault(event.slot, []).append(event)
    for slot, own in by_slot.items():
        own.sort(key=lambda e: e.at)
        left = 0.0 if own[0].kind == "join" else None
        for event in own:
            if event.kind == "preempt":
                left = event.at
            elif left is not None:
                away.setdefault(slot, []).append((left, event.at))
                left = None
        if left is not None:
            away.setdefault(slot, []).append((left, duration))
    rate = settings.preemptions_per_instance_hour / 3600.0
    events = []
    for slot in range(fleet):
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            if at >= duration:
                break
            if any(start <= at < end for start, end in away.get(slot, [])):
                continue
            back = at + rng.uniform(*settings.replacement_seconds)
            if any(at < end and start < back for start, end in away.get(slot, [])):
                continue
            events += [FleetEvent(at, "preempt", slot), FleetEvent(back, "join", slot)]
            at = back
    return events


def warning_of(slot: int, rng: random.Random, settings: TraceSettings) -> float:
    """The notice a preemption of this slot gets: its cloud's (slots alternate between the two), or
    none for the unannounced fraction."""
    if rng.random() < settings.unannounced_fraction:
        return 0.0
    return CLOUD_WARNINGS[slot % len(CLOUD_WARNINGS)]
