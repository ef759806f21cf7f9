"""The instance registry: who is registered under which incarnation, their leases, what version
they serve, and their measured throughput."""

from __future__ import annotations

import secrets
from typing import ClassVar

from rlmesh.errors import AlreadyExists, InvalidArgument, NotFound, bounded
from services.manager.domain.journaled import COUNTERS, INSTANCE, ChangeTracker, Journaled, Records
from services.manager.domain.records import Instance

RATE_SMOOTHING = 0.5


class WrongIncarnation(Exception):
    """A call for a registered instance id without the token of its live incarnation: it comes from
    a process that is not (or no longer) that instance. The server answers PERMISSION_DENIED."""

    def __init__(self, message: str) -> None:
        # Cut like a DomainError's: the message quotes the caller's id, which may be of any length.
        super().__init__(bounded(message))


class InstanceRegistry(Journaled):
    """Registration, renewal and departure; a departure returns the instance gone, whose running
    requests are the request table's to requeue."""

    __slots__ = ("tracker", "lease_seconds", "queue_ahead", "instances", "registrations", "empty_since")
    JOURNALED: ClassVar[frozenset[str]] = frozenset({"registrations"})
    KIND: ClassVar[str] = COUNTERS

    def __init__(self, tracker: ChangeTracker, lease_seconds: float, now: float, queue_ahead: int = 0) -> None:
        self.lease_seconds = lease_seconds
        self.queue_ahead = queue_ahead
        """Every instance's queue ahead (Instance.queue_ahead)."""
        self.instances: Records[Instance] = Records(tracker, INSTANCE)
        self.registrations = 0
        self.empty_since: float | None = now
        """Since when no instance has been registered (None while some are)."""
        self.tracker = tracker

    def restore(self, instances: list[Instance], registrations: int, now: float) -> None:
        """Every restored instance gets a fresh lease to heartbeat within."""
        self.registrations = registrations
        for instance in instances:
            instance.lease_expires, instance.rate_time = now + self.lease_seconds, now
            instance.queue_ahead = self.queue_ahead
        self.instances.restore(instances)
        self.empty_since = None if self.instances else now

    def register(
        self,
        instance_id: str,
        address: str,
        weight_version: int,
        max_batch_size: int,
        now: float,
        preemptible: bool,
        token: str,
        min_version: int,
        saturation_batch_size: int = 0,
    ) -> tuple[Instance, Instance | None]:
        """Admits an instance as a new incarnation when its id is free or its lease expired, and
        returns it with the expired incarnation it replaces, if one was not yet swept. While the
        lease is live, only the registered process (same address, its token) may register again,
        keeping its incarnation and its running requests; anyone else is refused."""
        if not instance_id:
            raise InvalidArgument("instance_id is required")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        if max_batch_size < 1:
            raise InvalidArgument("max_batch_size must be at least 1")
        if saturation_batch_size > max_batch_size:
            raise InvalidArgument(
                f"saturation_batch_size ({saturation_batch_size}) must not exceed max_batch_size ({max_batch_size})"
            )
        current = self.instances.get(instance_id)
        if current is not None and current.lease_expires >= now:
            if address != current.address or not same_token(token, current.token):
                raise AlreadyExists(
                    f"instance {instance_id!r} is registered at {current.address} and its lease is live (expires in "
                    f"{current.lease_expires - now:.1f} s); a new registration under its id must wait for the lease to "
                    f"expire or come from that address with its incarnation token"
                )
            self._renew(current, weight_version, now)
            current.max_batch_size, current.saturation_batch_size, current.preemptible = (
                max_batch_size,
                saturation_batch_size,
                preemptible,
            )
            return current, None
        replaced = self.drop(instance_id, now) if current is not None else None
        self.registrations += 1
        instance = Instance(
            instance_id=instance_id,
            address=address,
            weight_version=weight_version,
            max_batch_size=max_batch_size,
            saturation_batch_size=saturation_batch_size,
            lease_expires=now + self.lease_seconds,
            min_version=min_version,
            incarnation=self.registrations,
            token=secrets.token_hex(16),
            preemptible=preemptible,
            reported_version=weight_version,
            rate_time=now,
            queue_ahead=self.queue_ahead,
        )
        self.instances[instance_id] = instance
        self.empty_since = None
        return instance, replaced

    def heartbeat(self, instance_id: str, weight_version: int, now: float, draining: bool, token: str) -> None:
        instance = self.incarnation(instance_id, token)
        self._renew(instance, weight_version, now)
        # Draining is one-way: an instance that announced its departure gets no new work.
        instance.draining = instance.draining or draining

    def _renew(self, instance: Instance, weight_version: int, now: float) -> None:
        if weight_version < instance.reported_version:
            raise InvalidArgument(
                f"weight_version {weight_version} is older than the reported {instance.reported_version}"
            )
        instance.reported_version = weight_version
        # A report sent just before a switch may arrive after a chunk of the new version raised the record.
        instance.weight_version = max(instance.weight_version, weight_version)
        instance.lease_expires = now + self.lease_seconds

    def expired(self, now: float) -> list[Instance]:
        return [instance for instance in self.instances.values() if instance.lease_expires < now]

    def drop(self, instance_id: str, now: float) -> Instance:
        instance = self.instances.pop(instance_id)
        if not self.instances:
            self.empty_since = now
        return instance

    def instance(self, instance_id: str) -> Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} is not registered (lease expired?)") from None

    def incarnation(self, instance_id: str, token: str) -> Instance:
        """The registered instance, if the call carries its live incarnation's token."""
        instance = self.instance(instance_id)
        if not same_token(token, instance.token):
            problem = "carries no incarnation token" if not token else "carries the token of another incarnation"
            raise WrongIncarnation(
                f"instance {instance_id!r}: the call {problem}; it does not come from the process registered "
                f"at {instance.address} (incarnation {instance.incarnation})"
            )
        return instance

    def measure(self, now: float) -> None:
        """Updates tokens/s per instance, total and per sequence, only over busy intervals (so idle
        time does not read as slowness); smoothed."""
        for instance in self.instances.values():
            elapsed = now - instance.rate_time
            if elapsed <= 0:
                continue
            tokens = instance.generated_tokens - instance.rate_tokens
            busy = max(instance.busy_samples, instance.decoding)
            if tokens > 0 and busy > 0:
                rate = tokens / elapsed
                instance.tokens_per_second += RATE_SMOOTHING * (rate - instance.tokens_per_second)
                per_sequence = rate / busy
                instance.sequence_tokens_per_second += RATE_SMOOTHING * (
                    per_sequence - instance.sequence_tokens_per_second
                )
            instance.rate_tokens, instance.rate_time = instance.generated_tokens, now
            instance.busy_samples = instance.decoding

    @property
    def running_samples(self) -> int:
        return sum(len(i.running) for i in self.instances.values())


def same_token(given: str, expected: str) -> bool:
    return bool(given) and secrets.compare_digest(given.encode(), expected.encode())
