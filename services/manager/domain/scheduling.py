"""Scheduling: dispatch of queued requests through the dispatch policy (validations first), the
failure of exact-version batches whose version is gone, and the planning of straggler migration."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

from services.manager.domain.admission import Admission
from services.manager.domain.dispatch_policy import MIGRATION_SPEEDUP, DispatchPolicy, RunningWork
from services.manager.domain.records import Assignment, Batch, Instance, SampleRequest
from services.manager.domain.request_table import RequestTable

MIGRATION_MIN_SECONDS = 0.25
"""A straggler moves only when it is expected to run at least this long where it is."""
MAX_MIGRATIONS = 2
"""Per sample, so that no request bounces between instances."""


class Scheduler:
    def __init__(
        self,
        instances: Mapping[str, Instance],
        batches: Mapping[str, Batch],
        request_table: RequestTable,
        admission: Admission,
        policy: DispatchPolicy,
    ) -> None:
        self.instances = instances
        self.batches = batches
        self.request_table = request_table
        self.admission = admission
        self.policy = policy

    def assign(self) -> list[Assignment]:
        """Dispatches queued requests, exact-version ones (a validation) first, then the others
        oldest first: a validation never preempts a running sample, but it takes the slots that
        free up before training does, so all of it runs while its instance holds its version (a
        request arriving after the hold ended would be refused, the instance having switched).
        Eligible instances hold the version they must, may run the request (staleness gate and
        capacity rule, or exactly its version), are not draining and have a free slot; the policy
        picks among them."""
        self._fail_versions_gone()
        if any(r.exact_version for r in self.request_table.queue):
            # Stable: each kind keeps its order (continuations first).
            self.request_table.queue = deque(sorted(self.request_table.queue, key=lambda r: not r.exact_version))
        return self.policy.assign(self)

    def eligible(self, request: SampleRequest) -> list[Instance]:
        return [i for i in self.instances.values() if self.admission.may_run(i, request) and i.free_slots > 0]

    def running_work(self) -> RunningWork:
        """Read from the batches of exact-version and background work, and lazily per instance."""
        special = [
            request
            for batch in self.batches.values()
            if batch.exact_version or batch.background
            for group in batch.groups.values()
            for request in group
            if self._runs(request)
        ]
        return RunningWork(self.request_table.requests, special)

    def _runs(self, request: SampleRequest) -> bool:
        instance = self.instances.get(request.instance_id or "")
        return instance is not None and request.request_id in instance.running

    def rates(self) -> dict[str, float]:
        """Measured throughput per instance; one never measured counts as the pool's mean."""
        measured = [i.tokens_per_second for i in self.instances.values() if i.tokens_per_second > 0]
        default = sum(measured) / len(measured) if measured else 1.0
        return {i.instance_id: i.tokens_per_second or default for i in self.instances.values()}

    def _fail_versions_gone(self) -> None:
        """An exact-version batch with a sample waiting for an instance fails once none can take it:
        its evaluation is skipped. Its samples still running are let go (their next chunk ends their
        stream), so they no longer hold their instance's switch back."""
        queue = self.request_table.queue
        versions = {r.policy_version for r in queue if r.exact_version}
        gone = {v for v in versions if self.admission.version_gone(v, self.instances.values())}
        if not gone:
            return
        failed = {r.batch_id for r in queue if r.exact_version and r.policy_version in gone}
        for batch_id in sorted(failed):
            batch = self.batches[batch_id]
            batch.error = (
                f"version {batch.policy_version} is no longer served by any instance: evaluation of it is skipped "
                f"({batch.unfinished} of its samples unfinished; published version {self.admission.published_version})"
            )
            batch.version_gone = True
            for group in batch.groups.values():
                for request in group:
                    if request.instance_id is not None:
                        self.request_table.detach(request)
        self.request_table.unqueue(failed)

    def plan_migrations(self) -> list[SampleRequest]:
        """Near the end of a step (nothing queued but exact-version samples, background work) an
        instance with free slots takes over the requests expected to run longest on instances much
        slower per sequence; the caller aborts each on its instance, and the abort's chunk brings
        it back here to continue."""
        if not self.policy.migrates or any(not r.exact_version for r in self.request_table.queue):
            return []
        if not any(i.schedulable and i.free_decode_slots > 0 for i in self.instances.values()):
            # Every instance decodes a full batch (most of a step): no slot for a straggler to move to.
            return []
        planned: list[SampleRequest] = []
        requests = self.request_table.requests
        in_flight = [requests[r] for i in self.instances.values() for r in i.running if r in requests]
        incoming: dict[str, int] = {}
        for request in in_flight:
            if request.migrate_to is not None:
                incoming[request.migrate_to] = incoming.get(request.migrate_to, 0) + 1
        targets = sorted(
            (i for i in self.instances.values() if i.schedulable and i.sequence_tokens_per_second > 0),
            key=lambda i: -i.sequence_tokens_per_second,
        )
        fastest_open = max(
            (t.sequence_tokens_per_second for t in targets if t.free_decode_slots - incoming.get(t.instance_id, 0) > 0),
            default=0.0,
        )
        # Each source's movable requests, longest expected first (then by id, descending), weighed
        # once; a source no open target is fast enough for is not looked into, so a fleet of a
        # thousand instances of similar speed costs next to nothing here.
        movable: dict[str, tuple[Instance, list[tuple[float, str, SampleRequest]]]] = {}
        for request in in_flight:
            source = self.instances[request.instance_id] if request.instance_id else None
            if source is None or request.migrate_to is not None or request.migrations >= MAX_MIGRATIONS:
                continue
            source_rate = source.sequence_tokens_per_second
            if source_rate <= 0 or fastest_open < MIGRATION_SPEEDUP * source_rate:
                continue
            seconds_left = request.expected_remaining(self.request_table.mean_length) / source_rate
            if seconds_left >= MIGRATION_MIN_SECONDS:
                movable.setdefault(source.instance_id, (source, []))[1].append(
                    (seconds_left, request.request_id, request)
                )
        for _, entries in movable.values():
            entries.sort(key=_longest_first, reverse=True)
        for target in targets:
            # A straggler moves only to a slot that decodes it at once, not into an engine's queue.
            free = target.free_decode_slots - incoming.get(target.instance_id, 0)
            if free <= 0:
                continue
            sources = [
                entries
                for source, entries in movable.values()
                if source is not target
                and len(source.running) > len(target.running)
                and target.sequence_tokens_per_second >= MIGRATION_SPEEDUP * source.sequence_tokens_per_second
            ]
            chosen = []
            for _, _, request in heapq.merge(*sources, key=_longest_first, reverse=True):
                if request.migrate_to is not None or not self.admission.may_run(target, request):
                    continue
                chosen.append(request)
                if len(chosen) == free:
                    break
            for request in chosen:
                request.migrate_to = target.instance_id
                request.migrations += 1
                planned.append(request)
        return planned


def _longest_first(entry: tuple[float, str, SampleRequest]) -> tuple[float, str]:
    return entry[0], entry[1]
