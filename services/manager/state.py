"""The manager's domain state: instances with leases, every sample request with its tokens so
far, dispatch under the staleness gate, and assembly of complete groups. Plain Python, driven
by the server from one event loop."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
_RATE_SMOOTHING = 0.3
MAX_GROUP_SIZE = 1024


@dataclass(slots=True)
class Instance:
    instance_id: str
    address: str
    weight_version: int
    max_batch_size: int
    lease_expires: float
    min_version: int
    """Version it must serve before it gets work: the latest published when it joined."""
    incarnation: int = 0
    """Manager-wide registration counter: tells a restarted process from the one before it."""
    running: set[str] = field(default_factory=set)
    outstanding_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_second: float = 0.0
    _rate_tokens: int = 0
    _rate_time: float = 0.0

    @property
    def schedulable(self) -> bool:
        return self.weight_version >= self.min_version


@dataclass(slots=True)
class SampleRequest:
    request_id: str
    batch_id: str
    prompt_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    policy_version: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    instance_ids: list[str] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    attempt: int = 0
    instance_id: str | None = None

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason in FINISHED

    def continuation(self) -> tuple[list[int], int]:
        """Prompt plus the tokens generated so far, and how many tokens may still come."""
        return self.prompt_token_ids + self.token_ids, self.remaining_tokens


@dataclass(slots=True)
class Batch:
    batch_id: str
    policy_version: int
    groups: dict[str, list[SampleRequest]]
    ready: deque[str] = field(default_factory=deque)
    delivered: int = 0
    error: str = ""
    """Why the batch cannot complete (an instance refused one of its requests as invalid)."""

    @property
    def remaining(self) -> int:
        return len(self.groups) - self.delivered


@dataclass(frozen=True, slots=True)
class Assignment:
    request: SampleRequest
    instance: Instance
    attempt: int


class ManagerState:
    def __init__(self, lease_seconds: float, max_staleness: int) -> None:
        self.lease_seconds = lease_seconds
        self.max_staleness = max_staleness
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, SampleRequest] = {}
        self.batches: dict[str, Batch] = {}
        self.queue: deque[SampleRequest] = deque()
        self.published_version = 0
        self.delivered_groups = 0
        self.generated_tokens = 0
        self.requeued_samples = 0
        self.registrations = 0
        self.tokens_per_second = 0.0
        self._rate_tokens = 0
        self._rate_time = 0.0

    # Instances ---------------------------------------------------------------------------

    def register(self, instance_id: str, address: str, weight_version: int, max_batch_size: int, now: float) -> list[SampleRequest]:
        """Adds (or replaces) an instance; returns requests of a replaced registration, requeued."""
        if not instance_id:
            raise InvalidArgument("instance_id is required")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        if max_batch_size < 1:
            raise InvalidArgument("max_batch_size must be at least 1")
        requeued = self._drop(instance_id) if instance_id in self.instances else []
        self.registrations += 1
        self.instances[instance_id] = Instance(
            instance_id=instance_id,
            address=address,
            weight_version=weight_version,
            max_batch_size=max_batch_size,
            lease_expires=now + self.lease_seconds,
            min_version=self.published_version,
            incarnation=self.registrations,
            _rate_time=now,
        )
        return requeued

    def heartbeat(self, instance_id: str, weight_version: int, now: float) -> None:
        instance = self._instance(instance_id)
        if weight_version < instance.weight_version:
            raise InvalidArgument(f"weight_version {weight_version} is older than the reported {instance.weight_version}")
        instance.weight_version = weight_version
        instance.lease_expires = now + self.lease_seconds

    def deregister(self, instance_id: str) -> list[SampleRequest]:
        self._instance(instance_id)
        return self._drop(instance_id)

    def expire(self, now: float) -> list[tuple[Instance, list[SampleRequest]]]:
        """Drops instances whose lease ran out; returns them with their requeued requests."""
        expired = [inst for inst in self.instances.values() if inst.lease_expires < now]
        return [(instance, self._drop(instance.instance_id)) for instance in expired]

    def _drop(self, instance_id: str) -> list[SampleRequest]:
        instance = self.instances.pop(instance_id)
        requeued = [self.requests[r] for r in sorted(instance.running) if r in self.requests]
        for request in requeued:
            self._requeue(request)
        return requeued

    def _instance(self, instance_id: str) -> Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} is not registered (lease expired?)") from None

    def publish(self, version: int) -> None:
        if version < self.published_version:
            raise FailedPrecondition(f"version {version} is older than the published {self.published_version}")
        self.published_version = version

    # Requests ----------------------------------------------------------------------------

    def submit(self, batch_id: str, policy_version: int, prompts: list[tuple[str, list[int], int]], sampling: common_pb2.SamplingParams) -> int:
        """Queues n samples per prompt; validates everything before accepting anything."""
        if not batch_id:
            raise InvalidArgument("batch_id is required")
        if batch_id in self.batches:
            raise AlreadyExists(f"batch {batch_id!r} was already submitted")
        if not prompts:
            raise InvalidArgument("prompts is empty")
        if sampling.max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens must be at least 1")
        if sampling.temperature < 0:
            raise InvalidArgument("sampling.temperature must be >= 0")
        if not 0 <= sampling.top_p <= 1:
            raise InvalidArgument("sampling.top_p must be in [0, 1] (0 means 1)")
        if policy_version < 0:
            raise InvalidArgument("policy_version must be >= 0")
        seen: set[str] = set()
        for prompt_id, token_ids, n in prompts:
            if not prompt_id or "/" in prompt_id:
                raise InvalidArgument(f"prompt_id {prompt_id!r} must be non-empty and contain no '/'")
            if prompt_id in seen:
                raise InvalidArgument(f"prompt_id {prompt_id!r} appears twice in batch {batch_id!r}")
            seen.add(prompt_id)
            if not token_ids:
                raise InvalidArgument(f"prompt {prompt_id!r} has no tokens")
            if not 1 <= n <= MAX_GROUP_SIZE:
                raise InvalidArgument(f"prompt {prompt_id!r}: n must be in [1, {MAX_GROUP_SIZE}], got {n}")
        groups: dict[str, list[SampleRequest]] = {}
        for prompt_id, token_ids, n in prompts:
            groups[prompt_id] = [
                SampleRequest(f"{batch_id}/{prompt_id}/{i}", batch_id, prompt_id, list(token_ids), sampling, policy_version)
                for i in range(n)
            ]
        self.batches[batch_id] = Batch(batch_id, policy_version, groups)
        for group in groups.values():
            for request in group:
                self.requests[request.request_id] = request
                self.queue.append(request)
        return sum(len(g) for g in groups.values())

    def assign(self) -> list[Assignment]:
        """Dispatches queued requests, oldest first, each to the eligible instance with the fewest
        outstanding tokens; eligible means it holds the version it must, is fresh enough for the
        request (staleness gate) and has a free batch slot."""
        assignments: list[Assignment] = []
        waiting: deque[SampleRequest] = deque()
        while self.queue:
            request = self.queue.popleft()
            floor = request.policy_version - self.max_staleness
            candidates = [
                inst
                for inst in self.instances.values()
                if inst.schedulable and inst.weight_version >= floor and len(inst.running) < inst.max_batch_size
            ]
            if not candidates:
                waiting.append(request)
                continue
            instance = min(candidates, key=lambda i: (i.outstanding_tokens, len(i.running), i.instance_id))
            request.attempt += 1
            request.instance_id = instance.instance_id
            request.instance_ids.append(instance.instance_id)
            instance.running.add(request.request_id)
            instance.outstanding_tokens += request.remaining_tokens
            assignments.append(Assignment(request, instance, request.attempt))
        self.queue = waiting
        return assignments

    def _current(self, request_id: str, attempt: int) -> SampleRequest | None:
        request = self.requests.get(request_id)
        if request is None or request.attempt != attempt or request.instance_id is None:
            return None
        return request

    def record_chunk(self, request_id: str, attempt: int, token_ids: list[int], logprobs: list[float], weight_versions: list[int], finish_reason: int) -> bool:
        """Appends a chunk from the request's current attempt; chunks from an abandoned attempt
        are ignored so nothing is counted twice. Returns whether the chunk was taken."""
        request = self._current(request_id, attempt)
        if request is None:
            return False
        if not (len(token_ids) == len(logprobs) == len(weight_versions)):
            raise InvalidArgument(f"chunk for {request_id}: token, logprob and version counts differ")
        instance = self.instances.get(request.instance_id)
        accepted = min(len(token_ids), request.remaining_tokens)
        request.token_ids += token_ids[:accepted]
        request.logprobs += logprobs[:accepted]
        request.weight_versions += weight_versions[:accepted]
        self.generated_tokens += accepted
        if instance:
            instance.outstanding_tokens = max(0, instance.outstanding_tokens - accepted)
            instance.generated_tokens += accepted
        if finish_reason in FINISHED or request.remaining_tokens <= 0:
            reason = finish_reason if finish_reason in FINISHED else common_pb2.FINISH_REASON_LENGTH
            self._detach(request)
            self._complete(request, reason)
        elif finish_reason == common_pb2.FINISH_REASON_ABORT:
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
        batch.error = batch.error or f"prompt {request.prompt_id!r} was refused by an instance: {reason}"
        waiting = {r.request_id for group in batch.groups.values() for r in group}
        self.queue = deque(r for r in self.queue if r.request_id not in waiting)
        return True

    def _detach(self, request: SampleRequest) -> None:
        instance = self.instances.get(request.instance_id or "")
        if instance and request.request_id in instance.running:
            instance.running.discard(request.request_id)
            instance.outstanding_tokens = max(0, instance.outstanding_tokens - request.remaining_tokens)
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
        batch = self.batches[request.batch_id]
        if all(r.done for r in batch.groups[request.prompt_id]):
            batch.ready.append(request.prompt_id)

    # Delivery ----------------------------------------------------------------------------

    def take_micro_batch(self, batch_id: str, groups: int) -> tuple[list[list[SampleRequest]], int] | None:
        """Up to `groups` complete groups (fewer only for the batch's last micro-batch) and the
        number still to come; None while not enough are ready."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was fully delivered")
        if groups < 1:
            raise InvalidArgument("micro_batch_groups must be at least 1")
        if batch.error:
            self._forget(batch)
            raise InvalidArgument(f"batch {batch_id!r} failed: {batch.error}")
        want = min(groups, batch.remaining)
        if want == 0 or len(batch.ready) < want:
            return None
        taken = [batch.groups[batch.ready.popleft()] for _ in range(want)]
        batch.delivered += want
        self.delivered_groups += want
        return taken, batch.remaining

    def return_groups(self, batch_id: str, groups: list[list[SampleRequest]]) -> None:
        """Groups whose delivery failed go back to the front, to be streamed again."""
        batch = self.batches.get(batch_id)
        if batch is None:
            return
        for group in reversed(groups):
            batch.ready.appendleft(group[0].prompt_id)
        batch.delivered -= len(groups)
        self.delivered_groups -= len(groups)

    def finish_batch(self, batch_id: str) -> None:
        """Forgets a batch whose every group was delivered."""
        batch = self.batches.get(batch_id)
        if batch is not None and batch.remaining == 0:
            self._forget(batch)

    def cancel_batch(self, batch_id: str) -> int:
        """Drops a batch nobody will read (its trainer stopped); returns its unfinished samples."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was fully delivered")
        unfinished = sum(1 for group in batch.groups.values() for r in group if not r.done)
        self._forget(batch)
        return unfinished

    def _forget(self, batch: Batch) -> None:
        del self.batches[batch.batch_id]
        self.queue = deque(r for r in self.queue if r.batch_id != batch.batch_id)
        for group in batch.groups.values():
            for request in group:
                self._detach(request)
                self.requests.pop(request.request_id, None)

    # Observability -----------------------------------------------------------------------

    def measure(self, now: float) -> None:
        """Updates tokens/s per instance and overall (smoothed)."""
        for instance in self.instances.values():
            elapsed = now - instance._rate_time
            if elapsed > 0:
                rate = (instance.generated_tokens - instance._rate_tokens) / elapsed
                instance.tokens_per_second += _RATE_SMOOTHING * (rate - instance.tokens_per_second)
                instance._rate_tokens, instance._rate_time = instance.generated_tokens, now
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
