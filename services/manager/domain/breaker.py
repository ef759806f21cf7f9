"""The circuit breaker: an instance whose requests fail one after another gets no work for a
while, each time twice as long; a sample that fails attempt after attempt on instances that serve
other work ends its batch with the reason instead of circling between instances."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from services.manager.domain.records import Instance, SampleRequest

QUARANTINE_AFTER = 5
"""Failed requests in a row, with no token in between, that put an instance in quarantine."""
QUARANTINE_SECONDS = 1.0
MAX_QUARANTINE_SECONDS = 60.0
"""The first quarantine lasts QUARANTINE_SECONDS; each next one, until a request finishes there
again, twice the one before, up to this."""
SAMPLE_FAILURES = 4
"""Failed attempts in a row after which a sample ends its batch, the fault going with it. An
attempt counts against the sample only when its instance's request before it did not fail: on an
instance that fails everything the fault is the instance's, and the breaker deals with it."""


class Failure(NamedTuple):
    quarantine_seconds: float
    """The quarantine the failure started for its instance; 0 when none."""
    batch_failed: bool
    """The sample failed too often in a row: its batch ended with the reason."""


def request_failed(instance: Instance, now: float) -> float:
    """Counts a failed request against its instance; returns the quarantine it starts (seconds),
    0 when none does."""
    instance.failures_in_a_row += 1
    if instance.failures_in_a_row < QUARANTINE_AFTER or instance.quarantined_until:
        return 0.0
    seconds = min(MAX_QUARANTINE_SECONDS, QUARANTINE_SECONDS * 2**instance.quarantines)
    instance.quarantines += 1
    instance.quarantined_until = now + seconds
    return seconds


def sample_failed(request: SampleRequest, instance: Instance | None) -> bool:
    """Counts a failed attempt against the sample, after `request_failed` counted it against its
    instance; True once the sample has failed too often in a row."""
    if instance is not None:
        request.failed_on.add(instance.instance_id)
        if instance.failures_in_a_row > 1:
            return False
    request.failures_in_a_row += 1
    return request.failures_in_a_row >= SAMPLE_FAILURES


def tokens_arrived(instance: Instance | None, request: SampleRequest) -> None:
    """Work goes through: the failures in a row end for both. Called for every chunk and report, so
    it writes only what there is to end."""
    if request.failures_in_a_row:
        request.failures_in_a_row = 0
    if request.failed_on:
        request.failed_on.clear()
    if instance is not None and instance.failures_in_a_row:
        instance.failures_in_a_row = 0


def request_finished(instance: Instance | None) -> None:
    """A request finished on the instance: its next quarantine, if any, starts short again. One
    finishing during a quarantine was started before it, and proves nothing."""
    if instance is not None and not instance.quarantined_until:
        instance.quarantines = 0


def release_due(instances: Iterable[Instance], now: float) -> list[Instance]:
    """Ends the quarantines that are over; the instances get work again. Their failures in a row
    stand until work goes through there: one more failure puts them back, for longer."""
    released = [i for i in instances if i.quarantined_until and i.quarantined_until <= now]
    for instance in released:
        instance.quarantined_until = 0.0
    return released
