"""Dispatch policies: which instance each queued request goes to. `balanced` weighs outstanding
tokens against measured throughput (and lets stragglers migrate); `round_robin` is the baseline."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Protocol

from services.manager.domain.admission import Admission
from services.manager.domain.records import Assignment, Instance, SampleRequest
from services.manager.domain.request_table import RequestTable

PolicyName = Literal["balanced", "round_robin"]
MIGRATION_SPEEDUP = 1.5
"""A straggler moves only to an instance at least this much faster per sequence; an instance this
much slower than the fastest starts nothing near the end of the queue."""


@dataclass(slots=True)
class RunningWork:
    """What the instances run, as the dispatch policy weighs it."""

    holders: dict[int, set[str]] = field(default_factory=dict)
    """The instances running exact-version requests, by version."""
    background: set[str] = field(default_factory=set)
    """The instances running background work."""
    oldest_version: dict[str, int] = field(default_factory=dict)
    """By instance, the lowest policy version among the training requests it runs: the step whose
    stragglers it decodes."""

    def started(self, request: SampleRequest, instance_id: str) -> None:
        if request.exact_version:
            self.holders.setdefault(request.policy_version, set()).add(instance_id)
        else:
            self.oldest_version[instance_id] = min(
                self.oldest_version.get(instance_id, request.policy_version), request.policy_version
            )
        if request.background:
            self.background.add(instance_id)


class SchedulerView(Protocol):
    """The scheduler (scheduling.py) as a dispatch policy sees it: the instances, the request table
    it starts queued requests through, and the admission rules."""

    instances: Mapping[str, Instance]
    request_table: RequestTable
    admission: Admission

    def eligible(self, request: SampleRequest) -> list[Instance]: ...

    def running_work(self) -> RunningWork: ...

    def rates(self) -> dict[str, float]: ...


class DispatchPolicy(Protocol):
    migrates: bool
    """Whether stragglers move off slow instances near the end of a step."""

    def assign(self, scheduler: SchedulerView) -> list[Assignment]:
        """Starts queued requests (exact-version ones first in the queue) on eligible instances."""
        ...


class Balanced:
    """Picks the eligible instance expected to finish its work soonest, counting outstanding tokens
    against measured throughput. A validation stays on the instance that started it, waiting for
    its slots: the others never hold its version, and keep taking new versions for training. A
    training request goes to no instance running background work (a validation) while another
    instance may run it, waiting for that one's slots instead: background work then decodes
    alone, at the lowest CPU priority. An instance running its saturation batch takes no training
    request of a later step than the oldest it runs (see `beyond_saturation`). A sample that failed
    on some instances goes to another when one may take it."""

    migrates = True

    def assign(self, scheduler: SchedulerView) -> list[Assignment]:
        request_table, instances = scheduler.request_table, scheduler.instances
        assignments: list[Assignment] = []
        free = sum(max(0, i.free_slots) for i in instances.values() if i.schedulable)
        if not free or not request_table.queue:
            return assignments
        waiting: deque[SampleRequest] = deque()
        rates = scheduler.rates()
        fastest = max((i.sequence_tokens_per_second for i in instances.values() if i.schedulable), default=0.0)
        fast_capacity = sum(
            i.tokens_per_second
            for i in instances.values()
            if i.schedulable and i.sequence_tokens_per_second * MIGRATION_SPEEDUP >= fastest
        )
        # The queue's expected work matters only when some instance is much slower than the rest.
        slow_present = any(
            0 < i.sequence_tokens_per_second and i.sequence_tokens_per_second * MIGRATION_SPEEDUP < fastest
            for i in instances.values()
            if i.schedulable
        )
        mean_length = request_table.mean_length
        queued = QueuedTokens(request_table.queue, mean_length)
        work = scheduler.running_work()
        # Whether an instance may run a request depends only on the request's version and kind: a
        # queue of thousands, most of it beyond the capacity rule, is then looked at once per batch.
        # Slots only fill during a call, and an instance beyond its saturation for a step stays so
        # (it only runs more, and older, work): each kind's open instances are pruned as they close,
        # so a request costs what the open instances cost, not the whole fleet.
        may_run: dict[tuple[int, bool], list[Instance]] = {}
        open_to: dict[tuple[int, bool], list[Instance]] = {}
        others_free_of_background: dict[tuple[int, bool], tuple[int, bool]] = {}
        cheapest: dict[tuple[int, float], _Cheapest] = {}
        while request_table.queue and free:
            request = request_table.queue.popleft()
            kind = (request.policy_version, request.exact_version)
            if kind not in may_run:
                may_run[kind] = [i for i in instances.values() if scheduler.admission.may_run(i, request)]
                open_to[kind] = may_run[kind]
            if _plain(request) and not work.background:
                # Most of a large queue: one heap per version and expected length finds the instance
                # the loop below would, without looking at every open instance for every request.
                expected = queued.placing = request.expected_remaining(mean_length)
                key = (request.policy_version, expected)
                if key not in cheapest:
                    cheapest[key] = _Cheapest(open_to[kind], expected, rates)
                instance = cheapest[key].take(
                    partial(
                        _closed_to,
                        request=request,
                        work=work,
                        expected=expected,
                        queued=queued,
                        fastest=fastest,
                        fast_capacity=fast_capacity,
                    )
                )
                queued.paid(expected)
                if instance is None:
                    waiting.append(request)
                    continue
                assignments.append(request_table.start(request, instance))
                cheapest[key].put(instance)
                work.started(request, instance.instance_id)
                free -= 1
                continue
            candidates = open_to[kind] = [
                c
                for c in open_to[kind]
                if c.free_slots > 0 and (request.exact_version or not beyond_saturation(c, request, work))
            ]
            if not candidates and (request.exact_version or not slow_present):
                waiting.append(request)
                continue
            expected = request.expected_remaining(mean_length)
            queued.placing = 0.0 if request.exact_version else expected
            # The tail rule is about a training step's end; an exact-version request can only run
            # where its version is served, which the fast instances may not be.
            candidates = [
                c
                for c in candidates
                if request.exact_version or not too_slow_for_the_tail(c, expected, queued, fastest, fast_capacity)
            ]
            if not request.exact_version:
                queued.paid(expected)
            elif request.policy_version in work.holders:
                candidates = [c for c in candidates if c.instance_id in work.holders[request.policy_version]]
            if (
                not request.background
                and work.background
                and _some_free_of_background(may_run[kind], work.background, kind, others_free_of_background)
            ):
                candidates = [c for c in candidates if c.instance_id not in work.background]
            if not candidates:
                waiting.append(request)
                continue
            # A sample that failed somewhere goes elsewhere when it can: the fault may be the instance's.
            candidates = [c for c in candidates if c.instance_id not in request.failed_on] or candidates
            preferred = [c for c in candidates if c.instance_id == (request.migrate_to or request.affinity)]
            instance = (
                preferred[0]
                if preferred
                else min(
                    candidates, key=lambda i: ((i.outstanding_tokens + expected) / rates[i.instance_id], i.instance_id)
                )
            )
            assignments.append(request_table.start(request, instance))
            work.started(request, instance.instance_id)
            free -= 1
        waiting.extend(request_table.queue)
        request_table.queue = waiting
        return assignments


def _closed_to(
    instance: Instance,
    request: SampleRequest,
    work: RunningWork,
    expected: float,
    queued: QueuedTokens,
    fastest: float,
    fast_capacity: float,
) -> bool:
    return beyond_saturation(instance, request, work) or too_slow_for_the_tail(
        instance, expected, queued, fastest, fast_capacity
    )


def _plain(request: SampleRequest) -> bool:
    """A training request with nowhere it should prefer or avoid: the cheapest instance takes it."""
    return not (
        request.exact_version or request.background or request.failed_on or request.affinity or request.migrate_to
    )


class _Cheapest:
    """The instances of one version's requests of one expected length, cheapest first: the one
    expected to finish its work soonest, (outstanding + expected) / rate, then by id. Within one
    assignment pass outstanding work only grows, slots only fill, and an instance beyond its
    saturation or too slow for the tail stays so, so a lazy heap holds: an entry whose cost grew is
    put back at its new cost, and one that can no longer take the request leaves for good."""

    def __init__(self, instances: list[Instance], expected: float, rates: dict[str, float]) -> None:
        self.expected = expected
        self.rates = rates
        self.heap = [(self.cost(i), i.instance_id, i) for i in instances if i.free_slots > 0]
        heapq.heapify(self.heap)

    def cost(self, instance: Instance) -> float:
        return (instance.outstanding_tokens + self.expected) / self.rates[instance.instance_id]

    def take(self, excluded: Callable[[Instance], bool]) -> Instance | None:
        while self.heap:
            cost, instance_id, instance = self.heap[0]
            if instance.free_slots <= 0 or excluded(instance):
                heapq.heappop(self.heap)
                continue
            now = self.cost(instance)
            if now > cost:
                heapq.heapreplace(self.heap, (now, instance_id, instance))
                continue
            heapq.heappop(self.heap)
            return instance
        return None

    def put(self, instance: Instance) -> None:
        if instance.free_slots > 0:
            heapq.heappush(self.heap, (self.cost(instance), instance.instance_id, instance))


def _some_free_of_background(
    eligible: list[Instance],
    background: set[str],
    kind: tuple[int, bool],
    known: dict[tuple[int, bool], tuple[int, bool]],
) -> bool:
    """Whether an instance that may run requests of `kind` runs no background work; remembered per
    kind while the set of instances running background work keeps its size (it only grows)."""
    seen = known.get(kind)
    if seen is None or seen[0] != len(background):
        seen = known[kind] = (len(background), any(i.instance_id not in background for i in eligible))
    return seen[1]


def beyond_saturation(instance: Instance, request: SampleRequest, work: RunningWork) -> bool:
    """Whether starting this training request would slow the stragglers of an earlier step: the
    instance already runs its saturation batch (a larger batch gains no throughput, every sequence
    just decodes slower) and the request is for a later step than the oldest it runs. The trainer
    waits for that oldest step; a later one is needed only after it, so it fills just what the
    knee leaves free. With no earlier step running, the instance fills up to its max batch."""
    saturation = instance.saturation_batch_size
    if not saturation or len(instance.running) < saturation:
        return False
    return request.policy_version > work.oldest_version.get(instance.instance_id, request.policy_version)


class QueuedTokens:
    """The expected tokens of the training requests from the one being placed to the end of the
    queue, which only the tail rule reads: summed the first time it does, then paid down by each
    request placed (or left waiting) after it."""

    def __init__(self, queue: deque[SampleRequest], mean_length: float | None) -> None:
        self.queue = queue
        self.mean_length = mean_length
        self.placing = 0.0
        """Expected tokens of the training request being placed (already off the queue)."""
        self._tokens: float | None = None

    @property
    def tokens(self) -> float:
        if self._tokens is None:
            rest = sum(r.expected_remaining(self.mean_length) for r in self.queue if not r.exact_version)
            self._tokens = self.placing + rest
        return self._tokens

    def paid(self, expected: float) -> None:
        if self._tokens is not None:
            self._tokens -= expected


def too_slow_for_the_tail(
    instance: Instance, expected: float, queued: QueuedTokens, fastest: float, fast_capacity: float
) -> bool:
    """Near the end of the queue a much slower instance should start nothing: the fast ones
    would drain what is queued and finish this request sooner than it could."""
    rate = instance.sequence_tokens_per_second
    if rate <= 0 or fast_capacity <= 0 or rate * MIGRATION_SPEEDUP >= fastest:
        return False
    return queued.tokens / fast_capacity < expected / rate


class RoundRobin:
    """Strict turns, ignoring speed and load: the next request waits for the next instance's free slot."""

    migrates = False

    def __init__(self) -> None:
        self.turn = 0

    def assign(self, scheduler: SchedulerView) -> list[Assignment]:
        request_table, instances = scheduler.request_table, scheduler.instances
        assignments: list[Assignment] = []
        order = sorted(instances)
        while request_table.queue and order:
            request = request_table.queue[0]
            instance = instances[order[self.turn % len(order)]]
            if not scheduler.admission.may_run(instance, request):
                if not scheduler.eligible(request):
                    break
                self.turn += 1
                continue
            if instance.free_slots <= 0:
                break
            request_table.queue.popleft()
            self.turn += 1
            assignments.append(request_table.start(request, instance))
        return assignments


def dispatch_policy(name: PolicyName) -> DispatchPolicy:
    return RoundRobin() if name == "round_robin" else Balanced()
