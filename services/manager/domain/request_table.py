"""The request table: every sample request with its tokens so far, the queue of those waiting for
an instance, and each request's life (started, chunks recorded, continued elsewhere, finished)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import InvalidArgument
from services.manager.domain import breaker
from services.manager.domain.breaker import Failure
from services.manager.domain.journaled import REQUEST, ChangeTracker, Records
from services.manager.domain.records import FINISHED, Assignment, Batch, Instance, SampleRequest
from services.manager.domain.registry import RATE_SMOOTHING

LENGTH_SMOOTHING = 0.05


class RequestTable:
    """Every sample request by id, and the queue. A session's turn is a request too: how it ends is
    told through the turn hooks, which the sessions' owner registers (see ManagerState)."""

    def __init__(
        self,
        tracker: ChangeTracker,
        instances: Mapping[str, Instance],
        batches: Mapping[str, Batch],
        clock: Callable[[], float],
    ) -> None:
        self.instances = instances
        self.batches = batches
        self.clock = clock
        self.requests: Records[SampleRequest] = Records(tracker, REQUEST)
        self.queue: deque[SampleRequest] = deque()
        self.generated_tokens = 0
        self.requeued_samples = 0
        self.discarded_tokens = 0
        self.migrated_samples = 0
        self.continued_tokens = 0
        self.tokens_per_second = 0.0
        self.mean_length: float | None = None
        """Smoothed length of finished responses: what a fresh request is expected to generate."""
        self._rate_tokens = 0
        self._rate_time = 0.0
        self.turn_finished: Callable[[SampleRequest], None] = lambda turn: None
        """Told each session turn that finished: its tokens go to its session, not to a group."""
        self.turn_refused: Callable[[SampleRequest, str], None] = lambda turn, reason: None
        """Told each session turn an instance refused as invalid, with the reason."""
        self.turn_failed: Callable[[SampleRequest, str], None] = lambda turn, reason: None
        """Told each session turn that failed too often in a row (already off its instance), with the reason."""
        self.session_batch_forgotten: Callable[[Batch], None] = lambda batch: None
        """Told each session batch being forgotten, before its requests go: its sessions go with it."""

    def add(self, batch: Batch) -> int:
        """Queues the requests of a batch just accepted (a session batch's samples run turn by turn
        instead); returns how many."""
        for group in batch.groups.values():
            for request in group:
                self.requests[request.request_id] = request
                if not batch.sessions:
                    self.queue.append(request)
        return sum(len(g) for g in batch.groups.values())

    def add_turn(self, turn: SampleRequest, restored: bool = False) -> None:
        """Queues a session's turn; a restored one continues from its tokens, first in line."""
        if restored:
            self.requests.restore([turn])
            self.queue.appendleft(turn)
        else:
            self.requests[turn.request_id] = turn
            self.queue.append(turn)

    def drop_turn(self, turn: SampleRequest) -> None:
        """A turn whose session ended: off its instance, out of the queue and forgotten."""
        self.detach(turn)
        if turn in self.queue:
            self.queue.remove(turn)
        self.requests.pop(turn.request_id, None)

    def restore(self, batches: Iterable[Batch]) -> None:
        """Takes over the requests of restored batches: their streams died with the manager before,
        so every unfinished one is queued to continue from its tokens so far."""
        for batch in batches:
            for group in batch.groups.values():
                self.requests.restore(group)
                if not batch.sessions:
                    self.queue.extend(r for r in group if not r.done and not batch.error)

    def current(self, request_id: str, attempt: int) -> SampleRequest | None:
        """The request, if `attempt` is the one running now."""
        request = self.requests.get(request_id)
        if request is None or request.attempt != attempt or request.instance_id is None:
            return None
        return request

    def start(self, request: SampleRequest, instance: Instance) -> Assignment:
        if request.migrate_to is not None:
            if request.migrate_to == instance.instance_id:
                self.migrated_samples += 1
            request.migrate_to = None
        self.continued_tokens += request.token_count
        request.attempt += 1
        request.instance_id = instance.instance_id
        request.instance_ids += [instance.instance_id]
        request.charged = request.expected_remaining(self.mean_length)
        instance.running.add(request.request_id)
        instance.outstanding_tokens += request.charged
        return Assignment(request, instance, request.attempt)

    def record_chunk(
        self,
        request_id: str,
        attempt: int,
        token_ids: list[int],
        logprobs: list[float],
        weight_versions: list[int],
        finish_reason: int,
    ) -> bool:
        """Appends a chunk from the request's current attempt; chunks from an abandoned attempt
        are counted as discarded, never kept, so nothing is counted twice. An ABORT (the instance
        drains, or the request is being migrated) continues the request elsewhere. A chunk of a
        version newer than the instance's known one tells the manager of its switch before the
        next heartbeat does. Returns whether the stream goes on (False: cancel it)."""
        request = self.current(request_id, attempt)
        if request is None:
            self.discarded_tokens += len(token_ids)
            return False
        if not (len(token_ids) == len(logprobs) == len(weight_versions)):
            raise InvalidArgument(f"chunk for {request_id}: token, logprob and version counts differ")
        instance = self.instances.get(request.instance_id or "")
        if instance and weight_versions and max(weight_versions) > instance.weight_version:
            instance.weight_version = max(weight_versions)
        accepted = min(len(token_ids), request.remaining_tokens)
        if request.exact_version:
            # An instance that did not hold the pin (one predating it) switched mid-request: the
            # tokens of the version are kept and the request continues from them on another instance.
            on_version = next(
                (i for i, v in enumerate(weight_versions) if v != request.policy_version), len(weight_versions)
            )
            if on_version < accepted:
                if instance:
                    instance.refused_version = max(instance.refused_version, request.policy_version)
                self._record_tokens(request, instance, token_ids[:on_version], logprobs, weight_versions)
                self.discarded_tokens += len(token_ids) - on_version
                self.requeue(request)
                return False
        self.discarded_tokens += len(token_ids) - accepted
        self._record_tokens(request, instance, token_ids[:accepted], logprobs, weight_versions)
        if accepted:
            breaker.tokens_arrived(instance, request)
        self._ended_if(request, instance, finish_reason)
        return True

    def record_progress(
        self,
        request_id: str,
        attempt: int,
        token_count: int,
        first_version: int,
        last_version: int,
        finish_reason: int,
    ) -> bool:
        """A relay shard's cumulative report of the request's current attempt: the ledger counts
        the tokens the shard holds, as record_chunk does for tokens held here. Returns whether the
        attempt goes on (False: cancel it)."""
        request = self.current(request_id, attempt)
        if request is None:
            return False
        instance = self.instances.get(request.instance_id or "")
        if instance and last_version > instance.weight_version:
            instance.weight_version = last_version
        count = max(0, min(token_count, request.sampling.max_tokens) - request.relayed_tokens)
        if count:
            if not request.relayed_tokens:
                request.first_version = first_version
            request.relayed_tokens += count
            self._count_tokens(request, instance, count)
            breaker.tokens_arrived(instance, request)
        self._ended_if(request, instance, finish_reason)
        return True

    def _ended_if(self, request: SampleRequest, instance: Instance | None, finish_reason: int) -> None:
        """After the attempt's latest tokens: it finished (or reached max_tokens), or was aborted and
        continues elsewhere, or goes on."""
        if finish_reason in FINISHED or request.remaining_tokens <= 0:
            reason = finish_reason if finish_reason in FINISHED else common_pb2.FINISH_REASON_LENGTH
            breaker.request_finished(instance)
            self.detach(request)
            self._complete(request, reason)
        elif finish_reason == common_pb2.FINISH_REASON_ABORT:
            self.requeue(request)

    def relay_lost(self, address: str) -> list[SampleRequest]:
        """A relay shard restarted without the tokens it held: its requests not yet delivered start
        again from none (the tokens it held count as discarded); their groups are complete no more."""
        lost = []
        for request in list(self.requests.values()):
            batch = self.batches.get(request.batch_id)
            if request.relay != address or batch is None or request.prompt_id in batch.sent:
                continue
            self.discarded_tokens += request.relayed_tokens
            request.relayed_tokens = 0
            if request.done:
                request.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
                batch.sample_unfinished(request.prompt_id)
                self.requeue(request)
            elif request.instance_id is not None:
                self.requeue(request)
            lost.append(request)
        return lost

    def _record_tokens(
        self,
        request: SampleRequest,
        instance: Instance | None,
        token_ids: list[int],
        logprobs: list[float],
        weight_versions: list[int],
    ) -> None:
        """Appends `token_ids` with the logprobs and versions at the same positions."""
        count = len(token_ids)
        request.token_ids += token_ids
        request.logprobs += logprobs[:count]
        request.weight_versions += weight_versions[:count]
        self._count_tokens(request, instance, count)

    def _count_tokens(self, request: SampleRequest, instance: Instance | None, count: int) -> None:
        """`count` new tokens of the request: generated, and paid off what its instance was charged."""
        self.generated_tokens += count
        paid = min(request.charged, count)
        request.charged -= paid
        if instance:
            instance.outstanding_tokens = max(0.0, instance.outstanding_tokens - paid)
            instance.generated_tokens += count

    def version_refused(self, request_id: str, attempt: int) -> bool:
        """The instance refused an exact-version request: it serves a newer version or is about to
        switch to one. It gets no request of that version again; the request waits for another
        instance serving it, and its batch fails when none is left (see the scheduler)."""
        request = self.current(request_id, attempt)
        if request is None:
            return False
        instance = self.instances.get(request.instance_id or "")
        if instance:
            instance.refused_version = max(instance.refused_version, request.policy_version)
        # Refused before generating anything: the instance had no part in the sample.
        request.instance_ids = request.instance_ids[:-1]
        self.requeue(request)
        return True

    def stream_lost(self, request_id: str, attempt: int) -> bool:
        """The stream of the current attempt ended without finishing: continue elsewhere."""
        request = self.current(request_id, attempt)
        if request is None:
            return False
        self.requeue(request)
        return True

    def reject(self, request_id: str, attempt: int, reason: str) -> bool:
        """An instance refused the request as invalid: retrying elsewhere would fail the same way,
        so the whole batch fails with the reason instead of cycling forever."""
        request = self.current(request_id, attempt)
        if request is None:
            return False
        if request.session_id:
            self.turn_refused(request, reason)
            return True
        self._fail_batch(request, f"prompt {request.prompt_id!r} was refused by an instance: {reason}")
        return True

    def failed(self, request_id: str, attempt: int, reason: str) -> Failure | None:
        """The current attempt failed on its instance (an error, not a refusal or a lost
        connection): it counts against both (breaker.py), and the request continues elsewhere
        from its tokens, or ends its batch once it has failed too often in a row."""
        request = self.current(request_id, attempt)
        if request is None:
            return None
        instance = self.instances.get(request.instance_id or "")
        quarantine = breaker.request_failed(instance, self.clock()) if instance else 0.0
        if breaker.sample_failed(request, instance):
            if request.session_id:
                self.detach(request)
                self.turn_failed(request, reason)
                return Failure(quarantine, batch_failed=False)
            self._fail_batch(
                request,
                f"sample {request.request_id} failed {request.failures_in_a_row} times in a row on "
                f"{len(request.failed_on)} instances, the last on instance {request.instance_id}: {reason}",
            )
            return Failure(quarantine, batch_failed=True)
        self.requeue(request)
        return Failure(quarantine, batch_failed=False)

    def _fail_batch(self, request: SampleRequest, message: str) -> None:
        self.detach(request)
        batch = self.batches[request.batch_id]
        batch.error = batch.error or message
        self.unqueue({batch.batch_id})

    def unqueue(self, batch_ids: set[str]) -> None:
        self.queue = deque(r for r in self.queue if r.batch_id not in batch_ids)

    def detach(self, request: SampleRequest) -> None:
        instance = self.instances.get(request.instance_id or "")
        if instance and request.request_id in instance.running:
            instance.running.discard(request.request_id)
            instance.outstanding_tokens = max(0.0, instance.outstanding_tokens - request.charged)
        request.charged = 0.0
        request.instance_id = None

    def requeue_running(self, instance: Instance) -> list[SampleRequest]:
        """The requests of an instance gone, requeued."""
        requeued = [self.requests[r] for r in sorted(instance.running) if r in self.requests]
        for request in requeued:
            self.requeue(request)
        return requeued

    def requeue(self, request: SampleRequest) -> None:
        """Keeps the tokens generated so far; the request continues from them, first in line."""
        self.detach(request)
        if request.remaining_tokens <= 0:
            self._complete(request, common_pb2.FINISH_REASON_LENGTH)
            return
        self.requeued_samples += 1
        self.queue.appendleft(request)

    def _complete(self, request: SampleRequest, reason: int) -> None:
        request.finish_reason = reason
        length = request.token_count
        self.mean_length = (
            length if self.mean_length is None else self.mean_length + LENGTH_SMOOTHING * (length - self.mean_length)
        )
        if request.session_id:
            self.turn_finished(request)
        else:
            self.batches[request.batch_id].sample_finished(request.prompt_id, self.clock())

    def forget(self, batch: Batch) -> None:
        """Drops the requests of a batch nobody reads any more, wherever they are."""
        self.unqueue({batch.batch_id})
        if batch.sessions:
            self.session_batch_forgotten(batch)
        for group in batch.groups.values():
            for request in group:
                self.detach(request)
                self.requests.pop(request.request_id, None)

    def token_staleness(self, published_version: int) -> list[int]:
        """For each sample holding tokens and not yet delivered: versions between its oldest token's
        and the published one (its staleness if trained now)."""
        return [
            published_version - (r.first_version if r.relay else r.weight_versions[0])
            for r in self.requests.values()
            if r.token_count
        ]

    def measure(self, now: float) -> None:
        """Updates the overall tokens/s, smoothed."""
        elapsed = now - self._rate_time
        if self._rate_time and elapsed > 0:
            rate = (self.generated_tokens - self._rate_tokens) / elapsed
            self.tokens_per_second += RATE_SMOOTHING * (rate - self.tokens_per_second)
        self._rate_tokens, self._rate_time = self.generated_tokens, now
