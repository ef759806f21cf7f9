"""The simulation: the manager's own domain (registry, admission and the capacity rule,
scheduling, request table, delivery) under a virtual clock, driven by simulated instances, a
fleet trace and a simulated trainer, in ticks as the server's event loop would."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.simulation.fleet import BOOTING, GONE, LOADING, SERVING, InstanceModel, Sequence, SimInstance
from bench.simulation.traces import FleetEvent, TraceName, TraceSettings, trace_events, warning_of
from bench.simulation.trainer import SimTrainer, TrainerModel
from rlmesh.common.v1 import common_pb2
from rlmesh.launch.autoscale import POLL_SECONDS, Autoscaler
from services.manager.domain.state import ManagerState

ABORT = common_pb2.FINISH_REASON_ABORT
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one simulation runs: the fleet and its instances, the trainer, the manager's settings
    (staleness bound, lease, heartbeats, dispatch policy) and the event loop's periods."""

    fleet: int
    instance: InstanceModel
    trainer: TrainerModel
    steps: int
    max_staleness: int = 2
    speeds: tuple[float, float] = (0.8, 1.2)
    """Each instance's speed factor, uniform in this range..."""
    fixed_speeds: tuple[float, ...] = ()
    """...unless given here, by slot."""
    token_unit: int = 1
    """Real tokens each simulated token stands for (a chunk's worth at scale: memory and time stay
    within a machine's); every token figure below is in these units."""
    tick_seconds: float = 0.5
    """The event loop's granularity: chunks, completions and dispatch are handled per tick."""
    flush_seconds: float = 2.0
    """How often every running sequence's tokens reach the manager (its rates are measured from them)."""
    measure_seconds: float = 1.0
    lease_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    push_seconds: tuple[float, float] = (3.0, 6.0)
    """A new version reaches a serving instance after this long (uniform, drawn per instance)..."""
    shared_push_seconds: tuple[float, float] = (0.0, 0.0)
    """...plus this long (uniform, drawn once per version) that every instance waits alike: the
    trainer's upload to the weights service, before it pushes to any instance."""
    join_push_seconds: float = 15.0
    """A joiner's first weights take this long after it registers."""
    boot_seconds: float = 0.0
    """A joining instance registers this long after its machine starts (paid, not yet serving)."""
    policy: str = "balanced"
    autoscale: tuple[int, int] | None = None
    """(fewest, most) instances the real autoscaler (rlmesh.launch.autoscale) may ask for, following
    the manager's recommendation; None: the fleet's size is the trace's."""
    autoscale_patience_seconds: float = 30.0
    autoscale_cooldown_seconds: float = 60.0
    trace_settings: TraceSettings = field(default_factory=TraceSettings)
    max_seconds: float = 6 * 3600.0


@dataclass(slots=True)
class Outcome:
    """What a simulation measured, token figures in the scenario's units."""

    seconds: float = 0.0
    steps: int = 0
    ideal_seconds: float = 0.0
    fleet_bound_seconds: float = 0.0
    trainer_bound_seconds: float = 0.0
    instance_seconds: float = 0.0
    """Machine time the rollout fleet was paid for: every instance from its start (booting too) until it left."""
    capacity_unit_seconds: float = 0.0
    """Units the registered fleet could have generated, saturated (instances still loading their
    first weights count: the weight plane is the mesh's; a machine still booting does not)."""
    generated_units: int = 0
    lost_in_flight_units: int = 0
    regenerated_units: int = 0
    manager_cpu_seconds: float = 0.0
    manager_calls: int = 0
    preemptions: int = 0
    crashes: int = 0
    joins: int = 0
    scale_changes: list[tuple[float, int]] = field(default_factory=list)
    """(time, instance count asked for) at each of the autoscaler's changes."""
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, instances serving, trainer steps done) once per simulated 10 s."""


class Simulation:
    """`Simulation(scenario, trace, seed).run()`: the outcome of the trainer's steps through the trace."""

    def __init__(self, scenario: Scenario, trace: TraceName, seed: int = 0, record: Callable | None = None) -> None:
        self.scenario = scenario
        self.now = 0.0
        self.rng = random.Random(seed)
        self.state = ManagerState(
            scenario.lease_seconds, scenario.max_staleness, scenario.policy, clock=lambda: self.now
        )
        self.trainer = SimTrainer(
            scenario.trainer, scenario.steps, scenario.max_staleness, seed * 1000 + 1, self.manager
        )
        self.events = trace_events(trace, scenario.fleet, scenario.max_seconds, seed, scenario.trace_settings)
        self.outcome = Outcome()
        self.instances: dict[int, SimInstance] = {}
        self.by_id: dict[str, SimInstance] = {}
        self.retired: list[SimInstance] = []
        self.timers: list[tuple[float, str, SimInstance]] = []
        """(time, what, instance): boots ending, pushes arriving, machines going after a notice."""
        self._next_flush = self._next_measure = self._next_heartbeat = self._next_sample = self._next_poll = 0.0
        self.target = scenario.fleet
        """The instance count asked for: the fleet's, or the autoscaler's."""
        self.scaler = (
            Autoscaler(*scenario.autoscale, scenario.autoscale_patience_seconds, scenario.autoscale_cooldown_seconds)
            if scenario.autoscale
            else None
        )
        self._next_slot = scenario.fleet
        first: dict[int, str] = {}
        for event in self.events:
            first.setdefault(event.slot, event.kind)
        for slot in range(scenario.fleet):
            if first.get(slot) != "join":
                self._join(slot, booted=True)

    # The manager's calls, timed -------------------------------------------------------------

    def manager(self, call: Callable, *args, **kwargs):
        started = time.process_time()
        try:
            return call(*args, **kwargs)
        finally:
            self.outcome.manager_cpu_seconds += time.process_time() - started
            self.outcome.manager_calls += 1

    # Fleet ---------------------------------------------------------------------------------

    def _join(self, slot: int, booted: bool = False) -> None:
        low, high = self.scenario.speeds
        fixed = self.scenario.fixed_speeds
        instance = SimInstance(
            f"i{slot}-{self.outcome.joins}",
            self.scenario.instance,
            fixed[slot] if slot < len(fixed) else self.rng.uniform(low, high),
            warning_of(slot, self.rng, self.scenario.trace_settings),
            alive_since=self.now,
        )
        self.outcome.joins += 0 if booted else 1
        self.instances[slot] = instance
        self.by_id[instance.instance_id] = instance
        if booted:
            self._register(instance, self.trainer.step)
        else:
            self.timers.append((self.now + self.scenario.boot_seconds, "booted", instance))

    def _register(self, instance: SimInstance, version: int) -> None:
        model = instance.model
        registered, _ = self.manager(
            self.state.register,
            instance.instance_id,
            f"10.0.0.1:{len(self.by_id)}",
            version,
            model.max_batch_size,
            self.now,
            preemptible=instance.preemptible,
            saturation_batch_size=model.declared_saturation_batch_size,
        )
        instance.token = registered.token
        instance.version = version
        instance.switches = [(0.0, version)]
        if version < self.state.published_version:
            instance.phase = LOADING
            instance.pushed = self.state.published_version
            self.timers.append((self.now + self.scenario.join_push_seconds, "pushed", instance))
        else:
            instance.phase = SERVING

    def _event(self, event: FleetEvent) -> None:
        if event.kind == "join":
            # The cloud gives back what it took, as far as the count asked for wants it.
            if event.slot not in self.instances and len(self.instances) < self.target:
                self._join(event.slot)
            return
        instance = self.instances.pop(event.slot, None)
        if instance is None:
            return
        if instance.phase == BOOTING:
            instance.phase = GONE
        elif instance.warning_seconds > 0:
            self.outcome.preemptions += 1
            self._drain(instance)
        else:
            self.outcome.crashes += 1
            self._crash(instance)
        self.retired.append(instance)

    def _drain(self, instance: SimInstance) -> None:
        """What the rollout service does on a notice: announce the drain, abort every request (each
        ends with its tokens so far), deregister. The instance leaves the fleet at once; the rest of
        its machine's notice is not counted as paid time."""
        self.manager(self.state.heartbeat, instance.instance_id, instance.version, self.now, True, token=instance.token)
        for sequence in list(instance.running.values()):
            instance.drop(sequence.request.request_id)
            self._send(instance, sequence, *instance.unsent(sequence, sent_in_chunks=False), ABORT)
        self.manager(self.state.deregister, instance.instance_id, instance.token, self.now)
        instance.phase = GONE

    def _crash(self, instance: SimInstance) -> None:
        """The machine vanishes: what its streams carried so far reached the manager, the rest of the
        chunk under way is lost; the manager finds out when the lease runs out."""
        for sequence in list(instance.running.values()):
            first, sent = instance.unsent(sequence, sent_in_chunks=True)
            self.outcome.lost_in_flight_units += instance.generated_units(sequence) - sent
            self._send(instance, sequence, first, sent, UNSPECIFIED)
        instance.running.clear()
        instance.phase = GONE

    def _timer(self, what: str, instance: SimInstance) -> None:
        if instance.phase == GONE:
            return
        if what == "booted":
            self._register(instance, 0)
        elif what == "pushed" and instance.pushed is not None:
            instance.switch(instance.pushed)
            instance.pushed = None
            instance.phase = SERVING
            self.manager(self.state.heartbeat, instance.instance_id, instance.version, self.now, token=instance.token)

    def _push(self, version: int) -> None:
        low, high = self.scenario.push_seconds
        # Drawn only when there is one: a scenario without keeps its random sequence.
        shared = self.rng.uniform(*self.scenario.shared_push_seconds) if any(self.scenario.shared_push_seconds) else 0.0
        for instance in self.instances.values():
            if instance.phase == SERVING:
                instance.pushed = version
                self.timers.append((self.now + shared + self.rng.uniform(low, high), "pushed", instance))
            elif instance.phase == LOADING:
                instance.pushed = version

    # Streams -------------------------------------------------------------------------------

    def _send(self, instance: SimInstance, sequence: Sequence, first: int, last: int, finish: int) -> bool:
        """One chunk of units [first, last) of the sequence to the manager."""
        count = last - first
        if count <= 0 and finish == UNSPECIFIED:
            return True
        sequence.recorded = max(sequence.recorded, last)
        return self.manager(
            self.state.record_chunk,
            sequence.request.request_id,
            sequence.attempt,
            [7] * count,
            [-1.0] * count,
            instance.versions(sequence, first, last),
            finish,
        )

    def _dispatch(self) -> None:
        for assignment in self.manager(self.state.assign):
            instance = self.by_id[assignment.instance.instance_id]
            ended = instance.start(assignment)
            if ended is not None:
                self._send(instance, ended, 0, 0, ended.reason)

    def _migrate(self) -> None:
        for request in self.manager(self.state.plan_migrations):
            instance = self.by_id[request.instance_id or ""]
            sequence = instance.drop(request.request_id)
            if sequence is not None:
                self._send(instance, sequence, *instance.unsent(sequence, sent_in_chunks=False), ABORT)

    # The loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        scenario = self.scenario
        events = iter(self.events)
        upcoming = next(events, None)
        while not self.trainer.done and self.now < scenario.max_seconds:
            self.now += scenario.tick_seconds
            while upcoming is not None and upcoming.at <= self.now:
                self._event(upcoming)
                upcoming = next(events, None)
            due = [t for t in self.timers if t[0] <= self.now]
            if due:
                self.timers = [t for t in self.timers if t[0] > self.now]
                for _, what, instance in sorted(due, key=lambda t: t[0]):
                    self._timer(what, instance)
            self._decode()
            self._housekeeping()
            published = len(self.trainer.published)
            self.trainer.tick(self.now, self.state)
            for _, version in self.trainer.published[published:]:
                self._push(version)
            self._autoscale()
            self._dispatch()
            self.state.take_changes()
            self._account()
        return self._finish()

    def _autoscale(self) -> None:
        """Polls the recommendation as `rlmesh autoscale` does (every POLL_SECONDS) through the real
        rule; a new instance joins as a spot machine does, one asked to go drains."""
        if self.scaler is None or self.now < self._next_poll:
            return
        self._next_poll = self.now + POLL_SECONDS
        balance = self.trainer.balance
        wanted = self.scaler.observe(self.now, balance.recommended_rollout_instances if balance else 0, self.target)
        if wanted is None:
            return
        self.target = wanted
        self.outcome.scale_changes.append((self.now, wanted))
        while len(self.instances) < self.target:
            self._join(self._next_slot)
            self._next_slot += 1
        while len(self.instances) > self.target:
            slot = max(self.instances, key=lambda s: (self.instances[s].alive_since, s))
            instance = self.instances.pop(slot)
            if instance.phase in (SERVING, LOADING):
                self._drain(instance)
            instance.phase = GONE
            self.retired.append(instance)

    def _decode(self) -> None:
        flush = self.now >= self._next_flush
        if flush:
            self._next_flush = self.now + self.scenario.flush_seconds
        for instance in list(self.instances.values()):
            if instance.phase != SERVING and not instance.running:
                continue
            for sequence in instance.advance(self.scenario.tick_seconds):
                self._send(instance, sequence, sequence.recorded, sequence.target, sequence.reason)
            if flush:
                for sequence in list(instance.running.values()):
                    first, last = instance.unsent(sequence, sent_in_chunks=False)
                    if not self._send(instance, sequence, first, last, UNSPECIFIED):
                        instance.drop(sequence.request.request_id)

    def _housekeeping(self) -> None:
        if self.now >= self._next_heartbeat:
            self._next_heartbeat = self.now + self.scenario.heartbeat_seconds
            for instance in self.instances.values():
                if instance.phase in (SERVING, LOADING):
                    self.manager(
                        self.state.heartbeat, instance.instance_id, instance.version, self.now, token=instance.token
                    )
        for _, requeued in self.manager(self.state.expire, self.now):
            for request in requeued:
                owner = self.by_id.get(request.instance_ids[-1] if request.instance_ids else "")
                if owner is not None:
                    owner.drop(request.request_id)
        if self.now >= self._next_measure:
            self._next_measure = self.now + self.scenario.measure_seconds
            self.manager(self.state.measure, self.now)
            self._migrate()

    def _account(self) -> None:
        capacity = self.scenario.instance.throughput
        alive = [i for i in self.instances.values() if i.phase != GONE]
        self.outcome.instance_seconds += len(alive) * self.scenario.tick_seconds
        self.outcome.capacity_unit_seconds += (
            sum(capacity * i.speed for i in alive if i.phase != BOOTING) * self.scenario.tick_seconds
        )
        if self.now >= self._next_sample:
            self._next_sample = self.now + 10.0
            serving = sum(1 for i in alive if i.phase == SERVING)
            self.outcome.timeline.append((self.now, serving, self.trainer.step))

    def _finish(self) -> Outcome:
        outcome, accounts = self.outcome, self.trainer.accounts
        outcome.seconds = self.now
        outcome.steps = self.trainer.step
        everyone = list(self.instances.values()) + self.retired
        outcome.generated_units = sum(i.generated for i in everyone)
        table = self.state.request_table
        outcome.regenerated_units = table.discarded_tokens
        mean_capacity = outcome.capacity_unit_seconds / max(self.now, 1e-9)
        outcome.fleet_bound_seconds = accounts.trained_tokens / mean_capacity if mean_capacity else float("inf")
        outcome.trainer_bound_seconds = accounts.trainer_busy_seconds
        outcome.ideal_seconds = max(outcome.fleet_bound_seconds, outcome.trainer_bound_seconds)
        return outcome
