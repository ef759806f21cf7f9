"""The manager's domain state: instances with leases and measured speeds, every sample request
with its tokens so far, dispatch under the staleness gate, straggler migration, and assembly of
complete groups into micro-batches. Plain Python, driven by the server from one event loop."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange, bounded
from rlmesh.sampling import MAX_SEED, sampling_problem
from services.manager.stage_balance import Balance, StageBalancer, StepTiming

FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
_RATE_SMOOTHING = 0.5
_LENGTH_SMOOTHING = 0.05
MAX_GROUP_SIZE = 1024
MAX_STEP_SECONDS = 1e6
"""A reported training step longer than this (11 days) is a bad value: its average would overflow."""
MIGRATION_SPEEDUP = 1.5
"""A straggler moves only to an instance at least this much faster per sequence."""
MIGRATION_MIN_SECONDS = 0.25
"""...and only when it is expected to run at least this long where it is."""
MAX_MIGRATIONS = 2
"""Per sample, so that no request bounces between instances."""
FINISHED_BATCHES_KEPT = 64
Policy = Literal["balanced", "round_robin"]


class WrongIncarnation(Exception):
    """A call for a registered instance id without the token of its live incarnation: it comes from
    a process that is not (or no longer) that instance. The server answers PERMISSION_DENIED."""

    def __init__(self, message: str) -> None:
        # Cut like a DomainError's: the message quotes the caller's id, which may be of any length.
        super().__init__(bounded(message))


@dataclass(slots=True)
class Instance:
    instance_id: str
    address: str
    weight_version: int
    """The newest version it is known to serve: the one it reported, or one its chunks carried since."""
    max_batch_size: int
    lease_expires: float
    min_version: int
    """Version it must serve before it gets work: the latest published when it joined."""
    incarnation: int = 0
    """Manager-wide registration counter: tells a restarted process from the one before it."""
    token: str = ""
    """Secret of this incarnation: its heartbeats and deregistration present it."""
    preemptible: bool = False
    draining: bool = False
    reported_version: int = 0
    """The version of its last registration or heartbeat: a report never goes below it."""
    refused_version: int = -1
    """The newest version it refused an exact-version request for (it moved on): it gets none of
    that version again."""
    running: set[str] = field(default_factory=set)
    outstanding_tokens: float = 0.0
    """Tokens its running requests are still expected to generate."""
    generated_tokens: int = 0
    tokens_per_second: float = 0.0
    """Measured while busy (smoothed): what the instance delivers in total."""
    sequence_tokens_per_second: float = 0.0
    """Measured while busy (smoothed): what one of its sequences gets."""
    _rate_tokens: int = 0
    _rate_time: float = 0.0
    _busy_samples: float = 0.0

    @property
    def schedulable(self) -> bool:
        return self.weight_version >= self.min_version and not self.draining

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.running)


@dataclass(slots=True)
class SampleRequest:
    request_id: str
    batch_id: str
    prompt_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    policy_version: int
    exact_version: bool = False
    """Every token must come from exactly policy_version (held-out evaluation): background work."""
    background: bool = False
    """Instances decode it at the lowest CPU priority while nothing else shares their batch."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    instance_ids: list[str] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    attempt: int = 0
    instance_id: str | None = None
    charged: float = 0.0
    """Expected tokens still counted in its instance's outstanding_tokens."""
    migrate_to: str | None = None
    """Set while it is being moved off a slow instance: where it continues."""
    migrations: int = 0

    @property
    def engine_request_id(self) -> str:
        """Unique per attempt, so a late chunk of an abandoned attempt is never taken for the current one."""
        return f"{self.request_id}@{self.attempt}"

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason in FINISHED

    def expected_remaining(self, mean_length: float | None) -> float:
        """Tokens it is still expected to generate. Lengths are long-tailed, so a request that has
        already run long is expected to run as long again; before any length was observed,
        max_tokens is the only bound known."""
        if mean_length is None:
            return float(self.remaining_tokens)
        generated = len(self.token_ids)
        return float(max(1, min(self.remaining_tokens, max(mean_length, 2 * generated) - generated)))


@dataclass(slots=True)
class Batch:
    batch_id: str
    policy_version: int
    groups: dict[str, list[SampleRequest]]
    submitted_at: float = 0.0
    completed_at: float | None = None
    """When its last group became complete."""
    ready: deque[str] = field(default_factory=deque)
    """Complete groups not yet sent, by prompt id."""
    sent: list[str] = field(default_factory=list)
    """Groups sent, by prompt id, in stream order: a resumed stream resends from any position."""
    exact_version: bool = False
    """Its samples are generated by exactly policy_version (see SampleRequest.exact_version)."""
    background: bool = False
    """Its samples are background work (see SampleRequest.background)."""
    error: str = ""
    """Why the batch cannot complete: an instance refused one of its requests as invalid, or (with
    version_gone) no instance serves its exact version any more."""
    version_gone: bool = False

    @property
    def unfinished(self) -> int:
        """Samples still to generate."""
        return sum(1 for group in self.groups.values() for r in group if not r.done)

    @property
    def response_tokens(self) -> int:
        return sum(len(r.token_ids) for group in self.groups.values() for r in group)

    @property
    def remaining(self) -> int:
        """Groups still to be sent."""
        return len(self.groups) - len(self.sent)


@dataclass(slots=True)
class Changed:
    """What changed since the journal last wrote: records to write again, or to delete."""

    requests: set[str] = field(default_factory=set)
    new_requests: set[str] = field(default_factory=set)
    """Submitted since the last write: written whole, the others only in their progress."""
    batches: set[str] = field(default_factory=set)
    forgotten_batches: set[str] = field(default_factory=set)
    instances: set[str] = field(default_factory=set)
    dropped_instances: set[str] = field(default_factory=set)
    counters: bool = False

    def __bool__(self) -> bool:
        return bool(self.requests or self.batches or self.forgotten_batches or self.instances or self.dropped_instances or self.counters)

    def absorb(self, other: Changed) -> None:
        for name in ("requests", "new_requests", "batches", "forgotten_batches", "instances", "dropped_instances"):
            getattr(self, name).update(getattr(other, name))
        self.counters = self.counters or other.counters


@dataclass(frozen=True, slots=True)
class Assignment:
    request: SampleRequest
    instance: Instance
    attempt: int


class ManagerState:
    def __init__(self, lease_seconds: float, max_staleness: int, policy: Policy = "balanced", clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.max_staleness = max_staleness
        self.policy: Policy = policy
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, SampleRequest] = {}
        self.batches: dict[str, Batch] = {}
        self.queue: deque[SampleRequest] = deque()
        self.published_version = 0
        self.delivered_groups = 0
        self.generated_tokens = 0
        self.requeued_samples = 0
        self.discarded_tokens = 0
        self.migrated_samples = 0
        self.continued_tokens = 0
        self.registrations = 0
        self.tokens_per_second = 0.0
        self.mean_length: float | None = None
        """Smoothed length of finished responses: what a fresh request is expected to generate."""
        self.empty_since: float | None = clock()
        """Since when no instance has been registered (None while some are)."""
        self.balancer = StageBalancer()
        self._finished: dict[str, tuple[float, float, int]] = {}
        """Delivered batches: submission time, completion time, response tokens (for the balance)."""
        self._round_robin = 0
        self._rate_tokens = 0
        self._rate_time = 0.0
        self.changed = Changed()

    def take_changes(self) -> Changed:
        changed, self.changed = self.changed, Changed()
        return changed

    def restore(self, instances: list[Instance], batches: list[Batch], published_version: int, registrations: int, now: float) -> None:
        """Takes over what a journal kept. Every restored instance gets a fresh lease to heartbeat
        within; its streams died with the manager before, so every unfinished request is queued
        to continue from its tokens so far."""
        self.published_version, self.registrations = published_version, registrations
        for instance in instances:
            instance.lease_expires, instance._rate_time = now + self.lease_seconds, now
            self.instances[instance.instance_id] = instance
        self.empty_since = None if self.instances else now
        for batch in batches:
            self.batches[batch.batch_id] = batch
            sent = set(batch.sent)
            for prompt_id, group in batch.groups.items():
                for request in group:
                    self.requests[request.request_id] = request
                    if not request.done and not batch.error:
                        self.queue.append(request)
                if prompt_id not in sent and all(r.done for r in group):
                    batch.ready.append(prompt_id)

    # Instances ---------------------------------------------------------------------------

    def register(self, instance_id: str, address: str, weight_version: int, max_batch_size: int, now: float,
                 preemptible: bool = False, token: str = "") -> tuple[Instance, list[SampleRequest]]:
        """Admits an instance as a new incarnation when its id is free or its lease expired, and
        returns it with the requests of an expired incarnation not yet swept, requeued. While the
        lease is live, only the registered process (same address, its token) may register again,
        keeping its incarnation and its running requests; anyone else is refused."""
        if not instance_id:
            raise InvalidArgument("instance_id is required")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        if max_batch_size < 1:
            raise InvalidArgument("max_batch_size must be at least 1")
        current = self.instances.get(instance_id)
        if current is not None and current.lease_expires >= now:
            if address != current.address or not _same_token(token, current.token):
                raise AlreadyExists(
                    f"instance {instance_id!r} is registered at {current.address} and its lease is live (expires in "
                    f"{current.lease_expires - now:.1f} s); a new registration under its id must wait for the lease to "
                    f"expire or come from that address with its incarnation token"
                )
            self._renew(current, weight_version, now)
            current.max_batch_size, current.preemptible = max_batch_size, preemptible
            self.changed.instances.add(instance_id)
            return current, []
        requeued = self._drop(instance_id, now) if current is not None else []
        self.registrations += 1
        instance = Instance(
            instance_id=instance_id,
            address=address,
            weight_version=weight_version,
            max_batch_size=max_batch_size,
            lease_expires=now + self.lease_seconds,
            min_version=self.published_version,
            incarnation=self.registrations,
            token=secrets.token_hex(16),
            preemptible=preemptible,
            reported_version=weight_version,
            _rate_time=now,
        )
        self.instances[instance_id] = instance
        self.empty_since = None
        self.changed.instances.add(instance_id)
        self.changed.counters = True
        return instance, requeued

    def heartbeat(self, instance_id: str, weight_version: int, now: float, draining: bool = False, *, token: str) -> None:
        instance = self._incarnation(instance_id, token)
        if weight_version > instance.weight_version or (draining and not instance.draining):
            self.changed.instances.add(instance_id)
        self._renew(instance, weight_version, now)
        # Draining is one-way: an instance that announced its departure gets no new work.
        instance.draining = instance.draining or draining

    def _renew(self, instance: Instance, weight_version: int, now: float) -> None:
        if weight_version < instance.reported_version:
            raise InvalidArgument(f"weight_version {weight_version} is older than the reported {instance.reported_version}")
        instance.reported_version = weight_version
        # A report sent just before a switch may arrive after a chunk of the new version raised the record.
        instance.weight_version = max(instance.weight_version, weight_version)
        instance.lease_expires = now + self.lease_seconds

    def deregister(self, instance_id: str, token: str, now: float = 0.0) -> list[SampleRequest]:
        """The instance leaves; returns its requests, requeued."""
        self._incarnation(instance_id, token)
        return self._drop(instance_id, now)

    def remove(self, instance_id: str, now: float = 0.0) -> list[SampleRequest]:
        """Drops an instance the manager found gone (unreachable); returns its requests, requeued."""
        self._instance(instance_id)
        return self._drop(instance_id, now)

    def expire(self, now: float) -> list[tuple[Instance, list[SampleRequest]]]:
        """Drops instances whose lease ran out; returns them with their requeued requests."""
        expired = [inst for inst in self.instances.values() if inst.lease_expires < now]
        return [(instance, self._drop(instance.instance_id, now)) for instance in expired]

    def _drop(self, instance_id: str, now: float = 0.0) -> list[SampleRequest]:
        instance = self.instances.pop(instance_id)
        self.changed.dropped_instances.add(instance_id)
        requeued = [self.requests[r] for r in sorted(instance.running) if r in self.requests]
        for request in requeued:
            self._requeue(request)
        if not self.instances:
            self.empty_since = now
        return requeued

    def _instance(self, instance_id: str) -> Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} is not registered (lease expired?)") from None

    def _incarnation(self, instance_id: str, token: str) -> Instance:
        instance = self._instance(instance_id)
        if not _same_token(token, instance.token):
            problem = "carries no incarnation token" if not token else "carries the token of another incarnation"
            raise WrongIncarnation(
                f"instance {instance_id!r}: the call {problem}; it does not come from the process registered "
                f"at {instance.address} (incarnation {instance.incarnation})"
            )
        return instance

    def publish(self, version: int) -> None:
        if version < self.published_version:
            raise FailedPrecondition(f"version {version} is older than the published {self.published_version}")
        self.published_version = version
        self.changed.counters = True

    def starved_seconds(self, now: float) -> float:
        """How long work has been waiting with no instance registered at all (0 if any is)."""
        if self.empty_since is None or not self.requests:
            return 0.0
        return now - self.empty_since

    # Requests ----------------------------------------------------------------------------

    def submit(self, batch_id: str, policy_version: int,
               prompts: list[tuple[str, list[int], int] | tuple[str, list[int], int, common_pb2.SamplingParams | None]],
               sampling: common_pb2.SamplingParams, exact_version: bool = False, background: bool = False) -> int:
        """Queues n samples per prompt, each prompt with its own sampling if it has one, else the
        batch's; validates everything before accepting anything. `exact_version`: every token is
        to come from exactly policy_version (held-out evaluation). `background`: instances decode
        them only with the CPU other work leaves."""
        if not batch_id:
            raise InvalidArgument("batch_id is required")
        if batch_id in self.batches:
            raise AlreadyExists(f"batch {batch_id!r} was already submitted")
        if not prompts:
            raise InvalidArgument("prompts is empty")
        check_sampling(sampling, "sampling")
        if policy_version < 0:
            raise InvalidArgument("policy_version must be >= 0")
        seen: set[str] = set()
        for entry in prompts:
            prompt_id, token_ids, n = entry[:3]
            if not prompt_id or "/" in prompt_id or "@" in prompt_id:
                raise InvalidArgument(f"prompt_id {prompt_id!r} must be non-empty and contain no '/' or '@'")
            if prompt_id in seen:
                raise InvalidArgument(f"prompt_id {prompt_id!r} appears twice in batch {batch_id!r}")
            seen.add(prompt_id)
            if not token_ids:
                raise InvalidArgument(f"prompt {prompt_id!r} has no tokens")
            if not 1 <= n <= MAX_GROUP_SIZE:
                raise InvalidArgument(f"prompt {prompt_id!r}: n must be in [1, {MAX_GROUP_SIZE}], got {n}")
            if len(entry) > 3 and entry[3] is not None:
                check_sampling(entry[3], f"prompt {prompt_id!r}: sampling")
        groups: dict[str, list[SampleRequest]] = {}
        for entry in prompts:
            prompt_id, token_ids, n = entry[:3]
            own = entry[3] if len(entry) > 3 and entry[3] is not None else sampling
            groups[prompt_id] = [
                SampleRequest(f"{batch_id}/{prompt_id}/{i}", batch_id, prompt_id, list(token_ids),
                              per_sample_sampling(own, prompt_id, i), policy_version, exact_version, background)
                for i in range(n)
            ]
        self.batches[batch_id] = Batch(batch_id, policy_version, groups, submitted_at=self.clock(), exact_version=exact_version,
                                       background=background)
        self.changed.batches.add(batch_id)
        for group in groups.values():
            for request in group:
                self.requests[request.request_id] = request
                self.queue.append(request)
                self.changed.requests.add(request.request_id)
                self.changed.new_requests.add(request.request_id)
        return sum(len(g) for g in groups.values())

    def assign(self) -> list[Assignment]:
        """Dispatches queued requests, exact-version ones (a validation) first, then the others
        oldest first: a validation never preempts a running sample, but it takes the slots that
        free up before training does, so all of it runs while its instance holds its version (a
        request arriving after the hold ended would be refused, the instance having switched).
        A validation stays on the instance that started it, waiting for its slots: the others
        never hold its version, and keep taking new versions for training. A training request
        goes to no instance running background work (a validation) while another instance may
        run it, waiting for that one's slots instead: background work then decodes alone, at the
        lowest CPU priority.
        Eligible instances hold the version they must, may run the request (staleness
        gate and capacity rule, or exactly its version), are not draining and have a free slot.
        `balanced` picks the one expected to finish its work soonest, counting outstanding
        tokens against measured throughput; `round_robin` takes instances in turn."""
        self._fail_versions_gone()
        validating = any(r.exact_version for r in self.queue)
        if validating:
            # Stable: each kind keeps its order (continuations first).
            self.queue = deque(sorted(self.queue, key=lambda r: not r.exact_version))
        if self.policy == "round_robin":
            return self._assign_round_robin()
        assignments: list[Assignment] = []
        free = sum(max(0, i.free_slots) for i in self.instances.values() if i.schedulable)
        if not free or not self.queue:
            return assignments
        waiting: deque[SampleRequest] = deque()
        rates = self._rates()
        fastest = max((i.sequence_tokens_per_second for i in self.instances.values() if i.schedulable), default=0.0)
        fast_capacity = sum(
            i.tokens_per_second for i in self.instances.values()
            if i.schedulable and i.sequence_tokens_per_second * MIGRATION_SPEEDUP >= fastest
        )
        # The queue's expected work matters only when some instance is much slower than the rest.
        slow_present = any(
            0 < i.sequence_tokens_per_second and i.sequence_tokens_per_second * MIGRATION_SPEEDUP < fastest
            for i in self.instances.values() if i.schedulable
        )
        queued_tokens = sum(r.expected_remaining(self.mean_length) for r in self.queue if not r.exact_version) if slow_present else 0.0
        holders, background = self._running_work()
        # Whether an instance may run a request depends only on the request's version and kind: a
        # queue of thousands, most of it beyond the capacity rule, is then looked at once per batch.
        may_run: dict[tuple[int, bool], list[Instance]] = {}
        while self.queue and free:
            request = self.queue.popleft()
            kind = (request.policy_version, request.exact_version)
            if kind not in may_run:
                may_run[kind] = [i for i in self.instances.values() if self._may_run(i, request)]
            candidates = [c for c in may_run[kind] if c.free_slots > 0]
            if not candidates and (request.exact_version or not slow_present):
                waiting.append(request)
                continue
            expected = request.expected_remaining(self.mean_length)
            # The tail rule is about a training step's end; an exact-version request can only run
            # where its version is served, which the fast instances may not be.
            candidates = [
                c for c in candidates
                if request.exact_version or not self._too_slow_for_the_tail(c, expected, queued_tokens, fastest, fast_capacity)
            ]
            if not request.exact_version:
                queued_tokens -= expected
            elif request.policy_version in holders:
                candidates = [c for c in candidates if c.instance_id in holders[request.policy_version]]
            if not request.background and background and any(i.instance_id not in background for i in may_run[kind]):
                candidates = [c for c in candidates if c.instance_id not in background]
            if not candidates:
                waiting.append(request)
                continue
            preferred = [c for c in candidates if c.instance_id == request.migrate_to]
            instance = preferred[0] if preferred else min(
                candidates, key=lambda i: ((i.outstanding_tokens + expected) / rates[i.instance_id], i.instance_id)
            )
            assignments.append(self._start(request, instance))
            if request.exact_version:
                holders.setdefault(request.policy_version, set()).add(instance.instance_id)
            if request.background:
                background.add(instance.instance_id)
            free -= 1
        waiting.extend(self.queue)
        self.queue = waiting
        return assignments

    def _running_work(self) -> tuple[dict[int, set[str]], set[str]]:
        """In one pass over the running requests: the instances running exact-version requests, by
        version, and those running background work."""
        holders: dict[int, set[str]] = {}
        background: set[str] = set()
        for instance in self.instances.values():
            for request_id in instance.running:
                request = self.requests[request_id]
                if request.exact_version:
                    holders.setdefault(request.policy_version, set()).add(instance.instance_id)
                if request.background:
                    background.add(instance.instance_id)
        return holders, background

    @staticmethod
    def _too_slow_for_the_tail(instance: Instance, expected: float, queued_tokens: float, fastest: float, fast_capacity: float) -> bool:
        """Near the end of the queue a much slower instance should start nothing: the fast ones
        would drain what is queued and finish this request sooner than it could."""
        rate = instance.sequence_tokens_per_second
        if rate <= 0 or fast_capacity <= 0 or rate * MIGRATION_SPEEDUP >= fastest:
            return False
        return queued_tokens / fast_capacity < expected / rate

    def _assign_round_robin(self) -> list[Assignment]:
        """Strict turns: the next request waits for the next instance's free slot."""
        assignments: list[Assignment] = []
        order = sorted(self.instances)
        while self.queue and order:
            request = self.queue[0]
            instance = self.instances[order[self._round_robin % len(order)]]
            if not self._may_run(instance, request):
                if not self._eligible(request):
                    break
                self._round_robin += 1
                continue
            if instance.free_slots <= 0:
                break
            self.queue.popleft()
            self._round_robin += 1
            assignments.append(self._start(request, instance))
        return assignments

    def within_capacity(self, request: SampleRequest) -> bool:
        """The capacity rule (AReaL, SkyRL): a sample enters generation only while
        accepted + running <= (max_staleness + v + 1) * B, v the published version and B the
        samples of a step. A step's batch carries the version it will be trained at, so in
        versions the rule reads: policy_version <= v + max_staleness. Nothing generated is then
        ever older than policy_version - max_staleness when it is trained, and a group a trainer
        drops and refills for the same step stays within the rule: it cannot deadlock."""
        return request.policy_version <= self.published_version + self.max_staleness

    def _may_run(self, instance: Instance, request: SampleRequest) -> bool:
        """A training sample: the instance is fresh enough (staleness gate) and the sample within
        the capacity rule. An exact-version sample is not training data, so neither applies: the
        instance must serve exactly its version."""
        if request.exact_version:
            return self._serves_exactly(instance, request.policy_version)
        return (instance.schedulable and self.within_capacity(request)
                and instance.weight_version >= request.policy_version - self.max_staleness)

    @staticmethod
    def _serves_exactly(instance: Instance, version: int) -> bool:
        return instance.schedulable and instance.weight_version == version and instance.refused_version < version

    def _eligible(self, request: SampleRequest) -> list[Instance]:
        return [i for i in self.instances.values() if self._may_run(i, request) and i.free_slots > 0]

    def _version_gone(self, version: int) -> bool:
        """No instance can serve `version` any more: the pool moved past it (a newer version is
        published, served, or an instance refused it as moved on; pushes carry only the latest, and a
        joining instance gets the latest before any work) and no schedulable instance still serves it."""
        moved_on = self.published_version > version or any(
            i.weight_version > version or i.refused_version >= version for i in self.instances.values()
        )
        return moved_on and not any(self._serves_exactly(i, version) for i in self.instances.values())

    def _fail_versions_gone(self) -> None:
        """An exact-version batch with a sample waiting for an instance fails once none can take it:
        its evaluation is skipped. Its samples still running are let go (their next chunk ends their
        stream), so they no longer hold their instance's switch back."""
        versions = {r.policy_version for r in self.queue if r.exact_version}
        gone = {v for v in versions if self._version_gone(v)}
        if not gone:
            return
        failed = {r.batch_id for r in self.queue if r.exact_version and r.policy_version in gone}
        for batch_id in sorted(failed):
            batch = self.batches[batch_id]
            batch.error = (f"version {batch.policy_version} is no longer served by any instance: evaluation of it is skipped "
                           f"({batch.unfinished} of its samples unfinished; published version {self.published_version})")
            batch.version_gone = True
            self.changed.batches.add(batch_id)
            for group in batch.groups.values():
                for request in group:
                    if request.instance_id is not None:
                        self._detach(request)
        self.queue = deque(r for r in self.queue if r.batch_id not in failed)

    def _rates(self) -> dict[str, float]:
        """Measured throughput per instance; one never measured counts as the pool's mean."""
        measured = [i.tokens_per_second for i in self.instances.values() if i.tokens_per_second > 0]
        default = sum(measured) / len(measured) if measured else 1.0
        return {i.instance_id: i.tokens_per_second or default for i in self.instances.values()}

    def _start(self, request: SampleRequest, instance: Instance) -> Assignment:
        if request.migrate_to is not None:
            if request.migrate_to == instance.instance_id:
                self.migrated_samples += 1
            request.migrate_to = None
        if request.token_ids:
            self.continued_tokens += len(request.token_ids)
        request.attempt += 1
        request.instance_id = instance.instance_id
        self.changed.requests.add(request.request_id)
        request.instance_ids.append(instance.instance_id)
        request.charged = request.expected_remaining(self.mean_length)
        instance.running.add(request.request_id)
        instance.outstanding_tokens += request.charged
        return Assignment(request, instance, request.attempt)

    def _current(self, request_id: str, attempt: int) -> SampleRequest | None:
        request = self.requests.get(request_id)
        if request is None or request.attempt != attempt or request.instance_id is None:
            return None
        return request

    def record_chunk(self, request_id: str, attempt: int, token_ids: list[int], logprobs: list[float], weight_versions: list[int], finish_reason: int) -> bool:
        """Appends a chunk from the request's current attempt; chunks from an abandoned attempt
        are counted as discarded, never kept, so nothing is counted twice. An ABORT (the instance
        drains, or the request is being migrated) continues the request elsewhere. A chunk of a
        version newer than the instance's known one tells the manager of its switch before the
        next heartbeat does. Returns whether the stream goes on (False: cancel it)."""
        request = self._current(request_id, attempt)
        if request is None:
            self.discarded_tokens += len(token_ids)
            return False
        if not (len(token_ids) == len(logprobs) == len(weight_versions)):
            raise InvalidArgument(f"chunk for {request_id}: token, logprob and version counts differ")
        instance = self.instances.get(request.instance_id or "")
        if instance and weight_versions and max(weight_versions) > instance.weight_version:
            instance.weight_version = max(weight_versions)
            self.changed.instances.add(instance.instance_id)
        accepted = min(len(token_ids), request.remaining_tokens)
        if request.exact_version:
            # An instance that did not hold the pin (one predating it) switched mid-request: the
            # tokens of the version are kept and the request continues from them on another instance.
            on_version = next((i for i, v in enumerate(weight_versions) if v != request.policy_version), len(weight_versions))
            if on_version < accepted:
                if instance:
                    instance.refused_version = max(instance.refused_version, request.policy_version)
                self._record_tokens(request, instance, token_ids[:on_version], logprobs, weight_versions)
                self.discarded_tokens += len(token_ids) - on_version
                self._requeue(request)
                return False
        self.discarded_tokens += len(token_ids) - accepted
        self._record_tokens(request, instance, token_ids[:accepted], logprobs, weight_versions)
        if finish_reason in FINISHED or request.remaining_tokens <= 0:
            reason = finish_reason if finish_reason in FINISHED else common_pb2.FINISH_REASON_LENGTH
            self._detach(request)
            self._complete(request, reason)
        elif finish_reason == common_pb2.FINISH_REASON_ABORT:
            self._requeue(request)
        return True

    def _record_tokens(self, request: SampleRequest, instance: Instance | None, token_ids: list[int], logprobs: list[float],
                       weight_versions: list[int]) -> None:
        """Appends `token_ids` with the logprobs and versions at the same positions."""
        count = len(token_ids)
        self.changed.requests.add(request.request_id)
        request.token_ids += token_ids
        request.logprobs += logprobs[:count]
        request.weight_versions += weight_versions[:count]
        self.generated_tokens += count
        paid = min(request.charged, count)
        request.charged -= paid
        if instance:
            instance.outstanding_tokens = max(0.0, instance.outstanding_tokens - paid)
            instance.generated_tokens += count

    def version_refused(self, request_id: str, attempt: int) -> bool:
        """The instance refused an exact-version request: it serves a newer version or is about to
        switch to one. It gets no request of that version again; the request waits for another
        instance serving it, and its batch fails when none is left (see assign)."""
        request = self._current(request_id, attempt)
        if request is None:
            return False
        instance = self.instances.get(request.instance_id or "")
        if instance:
            instance.refused_version = max(instance.refused_version, request.policy_version)
        # Refused before generating anything: the instance had no part in the sample.
        request.instance_ids.pop()
        self._requeue(request)
        return True

    def stream_lost(self, request_id: str, attempt: int) -> bool:
        """The stream of the current attempt ended without finishing: continue elsewhere."""
        request = self._current(request_id, attempt)
        if request is None:
            return False
        self._requeue(request)
        return True

    def reject(self, request_id: str, attempt: int, reason: str) -> bool:
        """An instance refused the request as invalid: retrying elsewhere would fail the same way,
        so the whole batch fails with the reason instead of cycling forever."""
        request = self._current(request_id, attempt)
        if request is None:
            return False
        self._detach(request)
        batch = self.batches[request.batch_id]
        self.changed.batches.add(batch.batch_id)
        batch.error = batch.error or f"prompt {request.prompt_id!r} was refused by an instance: {reason}"
        waiting = {r.request_id for group in batch.groups.values() for r in group}
        self.queue = deque(r for r in self.queue if r.request_id not in waiting)
        return True

    def _detach(self, request: SampleRequest) -> None:
        instance = self.instances.get(request.instance_id or "")
        if instance and request.request_id in instance.running:
            instance.running.discard(request.request_id)
            instance.outstanding_tokens = max(0.0, instance.outstanding_tokens - request.charged)
        request.charged = 0.0
        request.instance_id = None

    def _requeue(self, request: SampleRequest) -> None:
        """Keeps the tokens generated so far; the request continues from them, first in line."""
        self._detach(request)
        if request.remaining_tokens <= 0:
            self._complete(request, common_pb2.FINISH_REASON_LENGTH)
            return
        self.requeued_samples += 1
        self.queue.appendleft(request)

    def _complete(self, request: SampleRequest, reason: int) -> None:
        request.finish_reason = reason
        self.changed.requests.add(request.request_id)
        length = len(request.token_ids)
        self.mean_length = length if self.mean_length is None else self.mean_length + _LENGTH_SMOOTHING * (length - self.mean_length)
        batch = self.batches[request.batch_id]
        if all(r.done for r in batch.groups[request.prompt_id]):
            batch.ready.append(request.prompt_id)
            if len(batch.ready) + len(batch.sent) == len(batch.groups):
                batch.completed_at = self.clock()

    # Stragglers --------------------------------------------------------------------------

    def plan_migrations(self) -> list[SampleRequest]:
        """Near the end of a step (nothing queued but exact-version samples, background work) an
        instance with free slots takes over the requests expected to run longest on instances much
        slower per sequence; the caller aborts each on its instance, and the abort's chunk brings
        it back here to continue."""
        if self.policy != "balanced" or any(not r.exact_version for r in self.queue):
            return []
        planned: list[SampleRequest] = []
        in_flight = [self.requests[r] for i in self.instances.values() for r in i.running if r in self.requests]
        incoming: dict[str, int] = {}
        for request in in_flight:
            if request.migrate_to is not None:
                incoming[request.migrate_to] = incoming.get(request.migrate_to, 0) + 1
        targets = sorted(
            (i for i in self.instances.values() if i.schedulable and i.sequence_tokens_per_second > 0),
            key=lambda i: -i.sequence_tokens_per_second,
        )
        for target in targets:
            free = target.free_slots - incoming.get(target.instance_id, 0)
            if free <= 0:
                continue
            choices = []
            for request in in_flight:
                source = self.instances[request.instance_id] if request.instance_id else None
                if (
                    source is None or source is target or request.migrate_to is not None
                    or request.migrations >= MAX_MIGRATIONS or not self._may_run(target, request)
                    or len(source.running) <= len(target.running)
                ):
                    continue
                source_rate = source.sequence_tokens_per_second
                if source_rate <= 0 or target.sequence_tokens_per_second < MIGRATION_SPEEDUP * source_rate:
                    continue
                seconds_left = request.expected_remaining(self.mean_length) / source_rate
                if seconds_left >= MIGRATION_MIN_SECONDS:
                    choices.append((seconds_left, request.request_id, request))
            for _, _, request in sorted(choices, reverse=True)[:free]:
                request.migrate_to = target.instance_id
                request.migrations += 1
                self.changed.requests.add(request.request_id)
                planned.append(request)
        return planned

    def migration_failed(self, request: SampleRequest) -> None:
        """The abort did not reach the instance: the request stays where it runs."""
        request.migrate_to = None

    # Delivery ----------------------------------------------------------------------------

    def take_micro_batch(self, batch_id: str, groups: int, min_groups: int | None = None, max_tokens: int = 0,
                         position: int | None = None) -> tuple[list[list[SampleRequest]], int] | None:
        """The micro-batch at `position` of the batch's stream order (default: after every group
        sent). Below the groups sent so far it is those groups again, as many as fit; at the end
        it is between `min_groups` (default: `groups`) and `groups` complete groups, fewer only
        for the batch's last micro-batch, within a budget of `max_tokens` prompt + response
        tokens (0: none; a group over budget travels alone; groups are never split). Returns them
        with the number still to come after them, or None while fewer than the lower bound are
        ready."""
        if groups < 1:
            raise InvalidArgument("micro_batch_groups must be at least 1")
        lower = groups if not min_groups else min_groups
        if lower > groups:
            raise InvalidArgument(f"min_groups ({lower}) exceeds micro_batch_groups ({groups})")
        if max_tokens < 0:
            raise InvalidArgument("max_tokens must be >= 0")
        batch = self._deliverable(batch_id)
        position = self._position(batch, position)
        if position < len(batch.sent):
            return self._resend(batch, position, groups, max_tokens)
        want = min(lower, batch.remaining)
        if want and len(batch.ready) < want:
            return None
        return self._take(batch, groups, max_tokens)

    def take_ready(self, batch_id: str, position: int | None = None) -> tuple[list[list[SampleRequest]], int]:
        """From `position` on: the groups sent before and every complete group ready now, possibly none."""
        batch = self._deliverable(batch_id)
        position = self._position(batch, position)
        again, _ = self._resend(batch, position, len(batch.sent), 0)
        taken, remaining = self._take(batch, len(batch.ready), 0)
        return again + taken, remaining

    @staticmethod
    def _position(batch: Batch, position: int | None) -> int:
        if position is None:
            return len(batch.sent)
        if not 0 <= position <= len(batch.sent):
            raise InvalidArgument(f"resume_from {position} is past the {len(batch.sent)} groups of batch {batch.batch_id!r} sent so far")
        return position

    def _deliverable(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was acknowledged")
        if batch.error:
            self._forget(batch)
            if batch.version_gone:
                raise OutOfRange(f"batch {batch_id!r} failed: {batch.error}")
            raise InvalidArgument(f"batch {batch_id!r} failed: {batch.error}")
        return batch

    @staticmethod
    def _within_budget(sizes: list[int], most: int, max_tokens: int) -> int:
        """How many of the groups (by token size, in order) make one micro-batch."""
        count = tokens = 0
        for size in sizes[:most]:
            if max_tokens and count and tokens + size > max_tokens:
                break
            count += 1
            tokens += size
        return count

    def _resend(self, batch: Batch, position: int, most: int, max_tokens: int) -> tuple[list[list[SampleRequest]], int]:
        pending = [batch.groups[p] for p in batch.sent[position:]]
        count = self._within_budget([_group_tokens(g) for g in pending], most, max_tokens)
        return pending[:count], len(batch.groups) - position - count

    def _take(self, batch: Batch, most: int, max_tokens: int) -> tuple[list[list[SampleRequest]], int]:
        ready = [batch.groups[p] for p in batch.ready]
        count = self._within_budget([_group_tokens(g) for g in ready], most, max_tokens)
        for _ in range(count):
            batch.sent.append(batch.ready.popleft())
        if count:
            self.changed.batches.add(batch.batch_id)
        self.delivered_groups += count
        if batch.remaining == 0 and count:
            self._delivered(batch)
        return ready[:count], batch.remaining

    def _delivered(self, batch: Batch) -> None:
        """Every group was sent: the timing the stage balance needs is kept after the batch is forgotten."""
        self._finished[batch.batch_id] = (batch.submitted_at, batch.completed_at or self.clock(), batch.response_tokens)
        while len(self._finished) > FINISHED_BATCHES_KEPT:
            del self._finished[next(iter(self._finished))]
        unacknowledged = [b for b in self.batches.values() if b.remaining == 0]
        for stale in unacknowledged[:-FINISHED_BATCHES_KEPT]:
            self._forget(stale)

    def acknowledge(self, batch_id: str) -> bool:
        """The reader holds every group of the batch: forget it. False when it was not known."""
        batch = self.batches.get(batch_id)
        if batch is None:
            return False
        if batch.remaining:
            raise FailedPrecondition(f"batch {batch_id!r} has {batch.remaining} groups still to be sent")
        self._forget(batch)
        return True

    def cancel_batch(self, batch_id: str) -> int:
        """Drops a batch nobody will read (its trainer stopped); returns its unfinished samples."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was acknowledged")
        unfinished = batch.unfinished
        self._forget(batch)
        return unfinished

    def _forget(self, batch: Batch) -> None:
        del self.batches[batch.batch_id]
        self.changed.forgotten_batches.add(batch.batch_id)
        self.queue = deque(r for r in self.queue if r.batch_id != batch.batch_id)
        for group in batch.groups.values():
            for request in group:
                self._detach(request)
                self.requests.pop(request.request_id, None)

    # Balance between training and rollout ------------------------------------------------

    def report_training_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> Balance:
        """The trainer's timing of the step that consumed `batch_id`, with the batch's rollout time."""
        finished = self._finished.get(batch_id)
        if finished is None:
            raise NotFound(f"batch {batch_id!r} was not fully delivered (or is too old to remember)")
        if not (0 < step_seconds <= MAX_STEP_SECONDS and 0 <= wait_seconds <= step_seconds):
            raise InvalidArgument(f"need 0 < step_seconds <= {MAX_STEP_SECONDS:g} and 0 <= wait_seconds <= step_seconds, "
                                  f"got {step_seconds}, {wait_seconds}")
        submitted, completed, tokens = finished
        reserved = sum(i.tokens_per_second for i in self.instances.values() if not i.preemptible)
        timing = StepTiming(step_seconds, wait_seconds, completed - submitted, tokens)
        return self.balancer.observe(timing, len(self.instances), reserved)

    # Observability -----------------------------------------------------------------------

    def token_staleness(self) -> list[int]:
        """For each sample holding tokens and not yet delivered: versions between its oldest token's
        and the published one (its staleness if trained now)."""
        return [self.published_version - r.weight_versions[0] for r in self.requests.values() if r.weight_versions]

    def measure(self, now: float) -> None:
        """Updates tokens/s per instance (total and per sequence, only over busy intervals, so
        idle time does not read as slowness) and overall; smoothed."""
        for instance in self.instances.values():
            elapsed = now - instance._rate_time
            if elapsed <= 0:
                continue
            tokens = instance.generated_tokens - instance._rate_tokens
            busy = max(instance._busy_samples, len(instance.running))
            if tokens > 0 and busy > 0:
                rate = tokens / elapsed
                instance.tokens_per_second += _RATE_SMOOTHING * (rate - instance.tokens_per_second)
                per_sequence = rate / busy
                instance.sequence_tokens_per_second += _RATE_SMOOTHING * (per_sequence - instance.sequence_tokens_per_second)
            instance._rate_tokens, instance._rate_time = instance.generated_tokens, now
            instance._busy_samples = len(instance.running)
        elapsed = now - self._rate_time
        if self._rate_time and elapsed > 0:
            rate = (self.generated_tokens - self._rate_tokens) / elapsed
            self.tokens_per_second += _RATE_SMOOTHING * (rate - self.tokens_per_second)
        self._rate_tokens, self._rate_time = self.generated_tokens, now

    @property
    def running_samples(self) -> int:
        return sum(len(i.running) for i in self.instances.values())

    @property
    def ready_groups(self) -> int:
        return sum(len(b.ready) for b in self.batches.values())


def _group_tokens(group: list[SampleRequest]) -> int:
    return sum(len(r.prompt_token_ids) + len(r.token_ids) for r in group)


def _same_token(given: str, expected: str) -> bool:
    return bool(given) and secrets.compare_digest(given.encode(), expected.encode())


def check_sampling(sampling: common_pb2.SamplingParams, where: str) -> None:
    problem = sampling_problem(sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.seed)
    if problem:
        raise InvalidArgument(f"{where}.{problem}")


def per_sample_sampling(sampling: common_pb2.SamplingParams, prompt_id: str, index: int) -> common_pb2.SamplingParams:
    """A seeded prompt gives each of its samples its own seed, derived from the prompt's: samples
    of a group must differ, and a rerun must draw the same. The batch id plays no part: a prompt
    submitted again under another batch (a trainer resuming) draws what it drew the first time."""
    params = common_pb2.SamplingParams()
    params.CopyFrom(sampling)
    if sampling.seed:
        digest = hashlib.blake2b(f"{sampling.seed}:{prompt_id}/{index}".encode(), digest_size=8).digest()
        params.seed = (int.from_bytes(digest, "little") % MAX_SEED) or 1
    return params
