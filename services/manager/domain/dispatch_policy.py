"""Dispatch policies: which instance each queued request goes to. `balanced` weighs outstanding
tokens against measured throughput (and lets stragglers migrate); `round_robin` is the baseline."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Literal, Protocol

from services.manager.domain.admission import Admission
from services.manager.domain.records import Assignment, Instance, SampleRequest
from services.manager.domain.request_table import RequestTable

PolicyName = Literal["balanced", "round_robin"]
MIGRATION_SPEEDUP = 1.5
"""A straggler moves only to an instance at least this much faster per sequence; an instance this
much slower than the fastest starts nothing near the end of the queue."""


class RunningWork:
    """What the instances run, as the dispatch policy weighs it. Exact-version and background work
    come from their batches (validations: few); the oldest step an instance runs is read from its
    running requests the first time a pass asks (only instances at their saturation batch are
    asked), then kept up as the pass starts more: a pass costs what it looks at, not every request
    running in the fleet."""

    __slots__ = ("requests", "holders", "background", "_oldest")

    def __init__(self, requests: Mapping[str, SampleRequest], special: Iterable[SampleRequest]) -> None:
        """`special`: the running exact-version and background requests."""
        self.requests = requests
        self.holders: dict[int, set[str]] = {}
        """The instances running exact-version requests, by version."""
        self.background: set[str] = set()
        """The instances running background work."""
        self._oldest: dict[str, int | None] = {}
        for request in special:
            self._special(request, request.instance_id or "")

    def _special(self, request: SampleRequest, instance_id: str) -> None:
        if request.exact_version:
            self.holders.setdefault(request.policy_version, set()).add(instance_id)
        if request.background:
            self.background.add(instance_id)

    def oldest_version(self, instance: Instance) -> int | None:
        """The lowest policy version among the training requests the instance runs: the step whose
        stragglers it decodes (None: it runs none)."""
        if instance.instance_id not in self._oldest:
            running = [self.requests[r] for r in instance.running]
            self._oldest[instance.instance_id] = min(
                (r.policy_version for r in running if not r.exact_version), default=None
            )
        return self._oldest[instance.instance_id]

    def started(self, request: SampleRequest, instance_id: str) -> None:
        self._special(request, instance_id)
        if not request.exact_version and instance_id in self._oldest:
            oldest = self._oldest[instance_id]
            version = request.policy_version
            self._oldest[instance_id] = version if oldest is None else min(oldest, version)


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
        request_table = scheduler.request_table
        free = sum(max(0, i.free_slots) for i in scheduler.instances.values() if i.schedulable)
        if not free or not request_table.queue:
            return []
        placing = _Pass(scheduler)
        assignments: list[Assignment] = []
        waiting: deque[SampleRequest] = deque()
        while request_table.queue and free:
            request = request_table.queue.popleft()
            instance = placing.place(request)
            if instance is None:
                waiting.append(request)
                if placing.nothing_else_fits(request, request_table.queue):
                    break
                continue
            assignments.append(request_table.start(request, instance))
            placing.started(request, instance)
            free -= 1
        waiting.extend(request_table.queue)
        request_table.queue = waiting
        return assignments


class _Pass:
    """One assignment pass of `Balanced`: what it measured of the fleet when it began, and what it
    learns of each kind of request as it goes.

    Whether an instance may run a request depends only on the request's version and kind: a queue of
    thousands, most of it beyond the capacity rule, is then looked at once per batch. Slots only fill
    during a pass, and an instance beyond its saturation for a step stays so (it only runs more, and
    older, work): each kind's open instances are pruned as they close, so a request costs what the
    open instances cost, not the whole fleet; a plain training request, most of a large queue, costs
    a heap's log of them."""

    def __init__(self, scheduler: SchedulerView) -> None:
        instances = scheduler.instances.values()
        self.scheduler = scheduler
        self.rates = scheduler.rates()
        self.fastest = max((i.sequence_tokens_per_second for i in instances if i.schedulable), default=0.0)
        self.fast_capacity = sum(
            i.tokens_per_second
            for i in instances
            if i.schedulable and i.sequence_tokens_per_second * MIGRATION_SPEEDUP >= self.fastest
        )
        # The queue's expected work matters only when some instance is much slower than the rest.
        self.slow_present = any(
            0 < i.sequence_tokens_per_second and i.sequence_tokens_per_second * MIGRATION_SPEEDUP < self.fastest
            for i in instances
            if i.schedulable
        )
        self.mean_length = scheduler.request_table.mean_length
        self.queued = QueuedTokens(scheduler.request_table.queue, self.mean_length)
        self.work = scheduler.running_work()
        self.may_run: dict[tuple[int, bool], list[Instance]] = {}
        self.may_run_ids: dict[tuple[int, bool], set[str]] = {}
        self.open_to: dict[tuple[int, bool], list[Instance]] = {}
        self.others_free_of_background: dict[tuple[int, bool], tuple[int, bool]] = {}
        self.cheapest: dict[tuple[int, float], _Cheapest] = {}
        self.fit_checked: set[int] = set()
        """Versions `nothing_else_fits` looked at."""
        self.taken_from: _Cheapest | None = None
        """The heap the last request placed came from (None: another route)."""

    def nothing_else_fits(self, waiting: SampleRequest, rest: deque[SampleRequest]) -> bool:
        """Whether no request of `rest` could start anywhere: every instance with a free slot runs
        its saturation batch and a step older than any of them (exact-version requests, which the
        saturation rule lets by, are none of them). Looked at once per version a plain request was
        left waiting at: the fleet's free slots then stop a pass over a long queue that none can take."""
        if not _plain(waiting) or waiting.policy_version in self.fit_checked:
            return False
        self.fit_checked.add(waiting.policy_version)
        floors = []
        for instance in self.scheduler.instances.values():
            if instance.free_slots <= 0 or not instance.schedulable:
                continue
            oldest = self.work.oldest_version(instance)
            saturation = instance.saturation_batch_size
            if oldest is None or not saturation or len(instance.running) < saturation:
                return False
            floors.append(oldest)
        if any(r.exact_version for r in rest):
            return False
        highest_open = max(floors, default=-1)
        return all(r.policy_version > highest_open for r in rest)

    def started(self, request: SampleRequest, instance: Instance) -> None:
        self.work.started(request, instance.instance_id)
        if self.taken_from is not None:
            self.taken_from.put(instance)

    def place(self, request: SampleRequest) -> Instance | None:
        """The instance the request starts on now, or None: it waits."""
        kind = (request.policy_version, request.exact_version)
        self.taken_from = None
        if kind not in self.may_run:
            self.may_run[kind] = [
                i for i in self.scheduler.instances.values() if self.scheduler.admission.may_run(i, request)
            ]
            self.may_run_ids[kind] = {i.instance_id for i in self.may_run[kind]}
            self.open_to[kind] = self.may_run[kind]
        if _plain(request) and not self.work.background:
            return self._cheapest(request)
        wanted = self.scheduler.instances.get(request.migrate_to or request.affinity)
        if wanted is not None and wanted.instance_id not in request.failed_on:
            expected = request.expected_remaining(self.mean_length)
            self.queued.placing = 0.0 if request.exact_version else expected
            if self._may_take(wanted, request, kind, expected):
                if not request.exact_version:
                    self.queued.paid(expected)
                return wanted
        return self._scan(request, kind)

    def _cheapest(self, request: SampleRequest) -> Instance | None:
        """One heap per version and expected length finds the instance the scan would."""
        expected = self.queued.placing = request.expected_remaining(self.mean_length)
        key = (request.policy_version, expected)
        if key not in self.cheapest:
            self.cheapest[key] = _Cheapest(self.open_to[(request.policy_version, False)], expected, self.rates)
        self.taken_from = self.cheapest[key]
        instance = self.cheapest[key].take(
            partial(
                _closed_to,
                request=request,
                work=self.work,
                expected=expected,
                queued=self.queued,
                fastest=self.fastest,
                fast_capacity=self.fast_capacity,
            )
        )
        self.queued.paid(expected)
        return instance

    def _may_take(self, instance: Instance, request: SampleRequest, kind: tuple[int, bool], expected: float) -> bool:
        """Whether the scan would keep `instance` among the request's candidates (every rule but the
        choice among them, where the instance the request names wins)."""
        if instance.instance_id not in self.may_run_ids[kind] or instance.free_slots <= 0:
            return False
        if not request.exact_version and (
            beyond_saturation(instance, request, self.work)
            or too_slow_for_the_tail(instance, expected, self.queued, self.fastest, self.fast_capacity)
        ):
            return False
        holders = self.work.holders.get(request.policy_version) if request.exact_version else None
        if holders is not None and instance.instance_id not in holders:
            return False
        return not self._keeps_off_background(request, kind) or instance.instance_id not in self.work.background

    def _keeps_off_background(self, request: SampleRequest, kind: tuple[int, bool]) -> bool:
        return (
            not request.background
            and bool(self.work.background)
            and _some_free_of_background(self.may_run[kind], self.work.background, kind, self.others_free_of_background)
        )

    def _scan(self, request: SampleRequest, kind: tuple[int, bool]) -> Instance | None:
        """Every open instance weighed against every rule."""
        work = self.work
        candidates = self.open_to[kind] = [
            c
            for c in self.open_to[kind]
            if c.free_slots > 0 and (request.exact_version or not beyond_saturation(c, request, work))
        ]
        if not candidates and (request.exact_version or not self.slow_present):
            return None
        expected = request.expected_remaining(self.mean_length)
        self.queued.placing = 0.0 if request.exact_version else expected
        # The tail rule is about a training step's end; an exact-version request can only run
        # where its version is served, which the fast instances may not be.
        candidates = [
            c
            for c in candidates
            if request.exact_version
            or not too_slow_for_the_tail(c, expected, self.queued, self.fastest, self.fast_capacity)
        ]
        if not request.exact_version:
            self.queued.paid(expected)
        elif request.policy_version in work.holders:
            candidates = [c for c in candidates if c.instance_id in work.holders[request.policy_version]]
        if self._keeps_off_background(request, kind):
            candidates = [c for c in candidates if c.instance_id not in work.background]
        if not candidates:
            return None
        # A sample that failed somewhere goes elsewhere when it can: the fault may be the instance's.
        candidates = [c for c in candidates if c.instance_id not in request.failed_on] or candidates
        preferred = [c for c in candidates if c.instance_id == (request.migrate_to or request.affinity)]
        if preferred:
            return preferred[0]
        rates = self.rates
        return min(candidates, key=lambda i: ((i.outstanding_tokens + expected) / rates[i.instance_id], i.instance_id))


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
    oldest = work.oldest_version(instance)
    return oldest is not None and request.policy_version > oldest


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
