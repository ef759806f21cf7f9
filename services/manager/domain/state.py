"""The manager's domain state: one facade over the modules that each hold one job (registry,
admission, scheduling, request table, sessions, delivery), sharing the tracker the journal reads what
changed from. Plain Python, driven by the server from one event loop."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import InvalidArgument, NotFound
from services.manager.domain import breaker
from services.manager.domain.admission import Admission, Prompt, check_sampling
from services.manager.domain.breaker import Failure
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.delivery import Delivery, Taken
from services.manager.domain.dispatch_policy import PolicyName, dispatch_policy
from services.manager.domain.journaled import BATCH, Changed, ChangeTracker, Records
from services.manager.domain.records import (
    Assignment,
    Batch,
    Instance,
    Limits,
    SampleRequest,
    Segment,
    Session,
    TurnState,
)
from services.manager.domain.registry import InstanceRegistry
from services.manager.domain.request_table import RequestTable
from services.manager.domain.scheduling import Scheduler
from services.manager.domain.sessions import Sessions
from services.manager.domain.stage_balance import Balance, StageBalancer, StepTiming

MAX_STEP_SECONDS = 1e6
"""A reported training step longer than this (11 days) is a bad value: its average would overflow."""


def instance_capacity(instance: Instance) -> float:
    """Tokens/s the instance gives with its batch full: a sequence's measured rate times its
    saturation batch (else its max batch), at least what it was measured to give in all."""
    batch = instance.saturation_batch_size or instance.max_batch_size
    return max(instance.tokens_per_second, instance.sequence_tokens_per_second * batch)


class ManagerState:
    def __init__(
        self,
        lease_seconds: float,
        max_staleness: int,
        policy: PolicyName = "balanced",
        clock: Callable[[], float] = time.monotonic,
        queue_ahead: int = 0,
    ) -> None:
        self.clock = clock
        self.tracker = ChangeTracker()
        self.registry = InstanceRegistry(self.tracker, lease_seconds, clock(), queue_ahead)
        self.admission = Admission(self.tracker, max_staleness)
        batches: Records[Batch] = Records(self.tracker, BATCH)
        self.request_table = RequestTable(self.tracker, self.registry.instances, batches, clock)
        self.sessions = Sessions(self.tracker, self.request_table, batches, clock)
        # How a session's turn ends, and a session batch forgotten, go from the table to the sessions.
        self.request_table.turn_finished = self.sessions.turn_finished
        self.request_table.turn_refused = self.sessions.turn_refused
        self.request_table.turn_failed = self.sessions.turn_failed
        self.request_table.session_batch_forgotten = self.sessions.forget
        self.delivery = Delivery(batches, self.request_table, self.sessions.sessions, clock)
        self.scheduler = Scheduler(
            self.registry.instances, batches, self.request_table, self.admission, dispatch_policy(policy)
        )
        self.balancer = StageBalancer()

    @property
    def instances(self) -> dict[str, Instance]:
        return self.registry.instances

    @property
    def requests(self) -> dict[str, SampleRequest]:
        return self.request_table.requests

    @property
    def batches(self) -> dict[str, Batch]:
        return self.delivery.batches

    @property
    def queue(self) -> deque[SampleRequest]:
        return self.request_table.queue

    @property
    def published_version(self) -> int:
        return self.admission.published_version

    @property
    def max_staleness(self) -> int:
        return self.admission.max_staleness

    @property
    def registrations(self) -> int:
        return self.registry.registrations

    def take_changes(self) -> Changed:
        return self.tracker.take()

    def restore(
        self,
        instances: list[Instance],
        batches: list[Batch],
        published_version: int,
        registrations: int,
        now: float,
        sessions: list[Session] | None = None,
        turns: list[SampleRequest] | None = None,
    ) -> None:
        """Takes over what a journal kept. Every restored instance gets a fresh lease to heartbeat
        within; its streams died with the manager before, so every unfinished request (a session's
        running turn too) is queued to continue from its tokens so far."""
        self.admission.published_version = published_version
        self.registry.restore(instances, registrations, now)
        self.delivery.restore(batches)
        self.request_table.restore(batches)
        self.sessions.restore(sessions or [], turns or [])

    # Instances ---------------------------------------------------------------------------

    def register(
        self,
        instance_id: str,
        address: str,
        weight_version: int,
        max_batch_size: int,
        now: float,
        preemptible: bool = False,
        token: str = "",
        saturation_batch_size: int = 0,
    ) -> tuple[Instance, list[SampleRequest]]:
        """See InstanceRegistry.register; returns the instance with the requests of the expired
        incarnation it replaces, requeued."""
        instance, replaced = self.registry.register(
            instance_id,
            address,
            weight_version,
            max_batch_size,
            now,
            preemptible,
            token,
            self.published_version,
            saturation_batch_size,
        )
        return instance, self.request_table.requeue_running(replaced) if replaced else []

    def heartbeat(
        self, instance_id: str, weight_version: int, now: float, draining: bool = False, *, token: str
    ) -> None:
        self.registry.heartbeat(instance_id, weight_version, now, draining, token)

    def deregister(self, instance_id: str, token: str, now: float = 0.0) -> list[SampleRequest]:
        """The instance leaves; returns its requests, requeued."""
        self.registry.incarnation(instance_id, token)
        return self._drop(instance_id, now)

    def remove(self, instance_id: str, now: float = 0.0) -> list[SampleRequest]:
        """Drops an instance the manager found gone (unreachable); returns its requests, requeued."""
        self.registry.instance(instance_id)
        return self._drop(instance_id, now)

    def expire(self, now: float) -> list[tuple[Instance, list[SampleRequest]]]:
        """Drops instances whose lease ran out; returns them with their requeued requests."""
        return [(instance, self._drop(instance.instance_id, now)) for instance in self.registry.expired(now)]

    def _drop(self, instance_id: str, now: float) -> list[SampleRequest]:
        return self.request_table.requeue_running(self.registry.drop(instance_id, now))

    def publish(self, version: int) -> None:
        self.admission.publish(version)

    def starved_seconds(self, now: float) -> float:
        """How long work has been waiting with no instance registered at all (0 if any is)."""
        if self.registry.empty_since is None or not self.requests:
            return 0.0
        return now - self.registry.empty_since

    # Requests ----------------------------------------------------------------------------

    def submit(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[Prompt],
        sampling: common_pb2.SamplingParams,
        exact_version: bool = False,
        background: bool = False,
    ) -> int:
        """Queues n samples per prompt (see Admission.admit); returns how many. `exact_version`:
        every token is to come from exactly policy_version (held-out evaluation). `background`:
        instances decode them only with the CPU other work leaves."""
        batch = self.admission.admit(
            batch_id, policy_version, prompts, sampling, exact_version, background, self.batches, self.clock()
        )
        self.batches[batch_id] = batch
        return self.request_table.add(batch)

    # Sessions ----------------------------------------------------------------------------

    def open_sessions(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[Prompt],
        sampling: common_pb2.SamplingParams,
        limits: Limits,
    ) -> list[Session]:
        """A batch of n multi-turn sessions per prompt (see Sessions.open)."""
        batch = self.admission.admit(
            batch_id, policy_version, prompts, sampling, False, False, self.batches, self.clock(), sessions=True
        )
        problem = limits.problem()
        if problem:
            raise InvalidArgument(problem)
        self.batches[batch_id] = batch
        self.request_table.add(batch)
        return self.sessions.open(batch, limits)

    def run_turn(
        self,
        session_id: str,
        turn: int,
        append: list[Segment],
        keep_tokens: int | None,
        sampling: common_pb2.SamplingParams | None,
        conversation: list[LoggedMessage] | None = None,
    ) -> TurnState:
        if sampling is not None:
            check_sampling(sampling, "sampling")
        return self.sessions.run_turn(session_id, turn, append, keep_tokens, sampling, conversation)

    def close_session(self, session_id: str, status: int, detail: str) -> tuple[Session, SampleRequest | None]:
        """Returns the session and the turn it dropped (to cancel on its instance)."""
        session = self.sessions.get(session_id)
        return session, self.sessions.close(session, status, detail)

    def assign(self) -> list[Assignment]:
        return self.scheduler.assign()

    def plan_migrations(self) -> list[SampleRequest]:
        return self.scheduler.plan_migrations()

    def migration_failed(self, request: SampleRequest) -> None:
        """The abort did not reach the instance: the request stays where it runs."""
        request.migrate_to = None

    def record_chunk(
        self,
        request_id: str,
        attempt: int,
        token_ids: list[int],
        logprobs: list[float],
        weight_versions: list[int],
        finish_reason: int,
    ) -> bool:
        return self.request_table.record_chunk(request_id, attempt, token_ids, logprobs, weight_versions, finish_reason)

    def record_progress(
        self, request_id: str, attempt: int, token_count: int, first_version: int, last_version: int, finish_reason: int
    ) -> bool:
        return self.request_table.record_progress(
            request_id, attempt, token_count, first_version, last_version, finish_reason
        )

    def count_continued(self, tokens: int) -> None:
        self.request_table.continued_tokens += tokens

    def relay_lost(self, address: str) -> list[SampleRequest]:
        return self.request_table.relay_lost(address)

    def version_refused(self, request_id: str, attempt: int) -> bool:
        return self.request_table.version_refused(request_id, attempt)

    def stream_lost(self, request_id: str, attempt: int) -> bool:
        return self.request_table.stream_lost(request_id, attempt)

    def reject(self, request_id: str, attempt: int, reason: str) -> bool:
        return self.request_table.reject(request_id, attempt, reason)

    def request_failed(self, request_id: str, attempt: int, reason: str) -> Failure | None:
        return self.request_table.failed(request_id, attempt, reason)

    def release_quarantines(self, now: float) -> list[Instance]:
        return breaker.release_due(self.instances.values(), now)

    # Delivery ----------------------------------------------------------------------------

    def take_micro_batch(
        self,
        batch_id: str,
        groups: int,
        min_groups: int | None = None,
        max_tokens: int = 0,
        position: int | None = None,
    ) -> Taken | None:
        return self.delivery.take_micro_batch(batch_id, groups, min_groups, max_tokens, position)

    def take_ready(self, batch_id: str, position: int | None = None) -> Taken:
        return self.delivery.take_ready(batch_id, position)

    def acknowledge(self, batch_id: str) -> bool:
        return self.delivery.acknowledge(batch_id)

    def cancel_batch(self, batch_id: str) -> int:
        return self.delivery.cancel(batch_id)

    # Balance between training and rollout, and measurements -------------------------------

    def report_training_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> Balance:
        """The trainer's timing of the step that consumed `batch_id`, with the batch's rollout time."""
        finished = self.delivery.finished.get(batch_id)
        if finished is None:
            raise NotFound(f"batch {batch_id!r} was not fully delivered (or is too old to remember)")
        if not (0 < step_seconds <= MAX_STEP_SECONDS and 0 <= wait_seconds <= step_seconds):
            raise InvalidArgument(
                f"need 0 < step_seconds <= {MAX_STEP_SECONDS:g} and 0 <= wait_seconds <= step_seconds, "
                f"got {step_seconds}, {wait_seconds}"
            )
        submitted, completed, tokens = finished
        reserved = sum(i.tokens_per_second for i in self.instances.values() if not i.preemptible)
        fleet = sum(instance_capacity(i) for i in self.instances.values())
        timing = StepTiming(step_seconds, wait_seconds, completed - submitted, tokens)
        return self.balancer.observe(timing, len(self.instances), reserved, fleet, overlapped=self.max_staleness > 0)

    def token_staleness(self) -> list[int]:
        return self.request_table.token_staleness(self.published_version)

    def measure(self, now: float) -> None:
        """Updates the measured tokens/s, per instance and overall."""
        self.registry.measure(now)
        self.request_table.measure(now)
