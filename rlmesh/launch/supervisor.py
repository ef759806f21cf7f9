"""The supervisor of a mesh's processes: starts them in dependency order, restarts each one that
exits under one restart policy with backoff (the trainer, which resumes from its checkpoint,
included), keeps the rollout instances at the count asked for (the scale file, the autoscaler),
keeps mesh.json current, and reports what it does as events for the console."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.ports import metrics_address
from rlmesh.launch.processes import Child, ServiceSpec, describe_exit, spawn, stop_children, wait_started
from rlmesh.launch.scale import ScaleRequests, plan_scale
from rlmesh.launch.services import (
    MANAGER_JOURNAL_FILE,
    RELAY_JOURNAL_FILES,
    manager_spec,
    relay_spec,
    rollout_spec,
    trainer_spec,
    weights_spec,
)
from rlmesh.launch.state import STATE_FILE, write_state

RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
"""Waits before restarting a service that exited, growing with each restart in a row."""
STABLE_SECONDS = 60.0
"""A service that ran this long is healthy again: its next restart waits the shortest time."""
TRAINER_RESTARTS = 20
"""Most times a trainer killed by a signal is started again in one run."""
TICK_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Whether a service that exited is started again, and after how long."""

    backoff_seconds: tuple[float, ...] = RESTART_BACKOFF_SECONDS
    stable_seconds: float = STABLE_SECONDS
    restart_after_exit_code: bool = True
    """False: an exit with a code (not a kill by a signal) is the service's last word."""
    max_restarts: int | None = None
    """Most restarts in one run (None: no limit)."""

    def restarts(self, code: int, restarts_total: int) -> bool:
        if code >= 0 and not self.restart_after_exit_code:
            return False
        return self.max_restarts is None or restarts_total < self.max_restarts

    def wait_seconds(self, restarts_in_a_row: int) -> float:
        return self.backoff_seconds[min(restarts_in_a_row, len(self.backoff_seconds) - 1)]


SERVICE_RESTARTS = RestartPolicy()
"""The manager, the weights service and the rollout instances: restarted whatever ended them."""
TRAINER_RESTARTS_POLICY = RestartPolicy(
    backoff_seconds=(0.0, *RESTART_BACKOFF_SECONDS), restart_after_exit_code=False, max_restarts=TRAINER_RESTARTS
)
"""The trainer killed by a signal (the OOM killer, a lost machine, an operator) resumes from its
latest checkpoint; an exit code (0: trained every step; else: failed) ends the run. Its first
restart in a row is at once: it only restarts after a kill from outside, never after failing by
itself, and each start already takes the time to load the model and the checkpoint."""


@dataclass(frozen=True, slots=True)
class Notice:
    """A line for the console: a service exited, restarted or left, the instance count changed."""

    text: str


@dataclass(frozen=True, slots=True)
class ServiceEnded:
    """A service exited and its policy does not start it again; the trainer's code is the run's."""

    name: str
    code: int


Event = Notice | ServiceEnded


@dataclass(slots=True)
class Supervised:
    """A service the supervisor keeps running: `start` spawns it again after it exited."""

    name: str
    start: Callable[[], Child]
    policy: RestartPolicy
    child: Child
    started_at: float
    resumes: bool = False
    """It takes up its work from its latest checkpoint when started again (the trainer)."""
    restarts_in_a_row: int = 0
    restarts_total: int = 0
    restart_at: float | None = None
    retiring: bool = False
    """Being scaled down: its exit is expected and it is not restarted."""
    ended: bool = False

    def state(self) -> dict:
        return {
            "name": self.name,
            "pid": self.child.process.pid,
            "address": self.child.address,
            "metrics": metrics_address(self.child.address),
            "restarts": self.restarts_in_a_row,
            "restarts_total": self.restarts_total,
        }


class Supervisor:
    """`spawn_service` starts a service and `wait_serving` waits until services serve (the real
    ones by default; tests give fakes); `clock` tells the time the backoff counts in."""

    def __init__(
        self,
        plan: LaunchPlan,
        spawn_service: Callable[[ServiceSpec], Child] | None = None,
        wait_serving: Callable[[list[Child]], Awaitable[None]] = wait_started,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self._spawn = spawn_service or partial(spawn, log_dir=plan.log_dir, mesh_id=str(plan.output_dir))
        self._wait_serving = wait_serving
        self._clock = clock
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.manager: Supervised | None = None
        self.relays: list[Supervised] = []
        self.weights: Supervised | None = None
        self.rollouts: dict[int, Supervised] = {}
        self.trainer: Supervised | None = None
        self.target_instances = plan.mesh.rollout_instances
        self._scale_requests = ScaleRequests(plan.output_dir)

    def _supervise(
        self, make_spec: Callable[[], ServiceSpec], policy: RestartPolicy = SERVICE_RESTARTS, resumes: bool = False
    ) -> Supervised:
        """Starts a service; `make_spec` is called again at each restart (the trainer's rendezvous port is
        new each time)."""

        def start() -> Child:
            return self._spawn(make_spec())

        child = start()
        return Supervised(child.name, start, policy, child, self._clock(), resumes=resumes)

    def _supervise_rollout(self, index: int) -> Supervised:
        return self._supervise(partial(rollout_spec, self.plan, index))

    def _notice(self, text: str) -> None:
        self.events.put_nowait(Notice(text))

    async def start_services(self) -> None:
        """The relay shards and the manager first, then the weights service and the rollout instances, each serving."""
        plan = self.plan
        # A journal left by an earlier `rlmesh up` of this folder describes batches past the checkpoint
        # the trainer resumes from; only restarts within this run take up the manager's state.
        for stale in [
            *plan.output_dir.glob(f"{MANAGER_JOURNAL_FILE}*"),
            *plan.output_dir.glob(RELAY_JOURNAL_FILES.format(index="*")),
        ]:
            stale.unlink()
        self.relays = [self._supervise(partial(relay_spec, plan, index)) for index in range(plan.mesh.relay_shards)]
        await self._wait_serving([relay.child for relay in self.relays])
        self.manager = self._supervise(partial(manager_spec, plan))
        await self._wait_serving([self.manager.child])
        self.weights = self._supervise(partial(weights_spec, plan))
        for index in range(plan.mesh.rollout_instances):
            self.rollouts[index] = self._supervise_rollout(index)
        await self._wait_serving([self.weights.child, *(r.child for r in self.rollouts.values())])
        self.write_state()

    async def start_trainer(self) -> Supervised:
        self.trainer = self._supervise(partial(trainer_spec, self.plan), TRAINER_RESTARTS_POLICY, resumes=True)
        await self._wait_serving([self.trainer.child])
        self.write_state()
        return self.trainer

    def state(self) -> dict:
        plan = self.plan
        rollouts = sorted(self.rollouts.items())
        running = []
        for index, service in rollouts:
            if service.retiring:
                continue
            link = plan.netns_link(index)
            running.append(
                service.state() | ({"netns": link.namespace, "link": link.host_device} if link is not None else {})
            )
        state = {
            "pid": os.getpid(),
            "manager": plan.manager_address,
            "services": [s.state() for s in (*self.relays, self.manager, self.weights) if s is not None],
            "rollout_instances": {
                "min": plan.mesh.rollout_instances,
                "max": plan.mesh.instance_cap,
                "target": self.target_instances,
                "running": running,
                "leaving": [s.name for _, s in rollouts if s.retiring],
            },
            "autoscale": plan.mesh.autoscale,
            "secrets_dir": str(plan.secrets_dir) if plan.secrets_dir is not None else None,
        }
        if self.trainer is not None:
            state["trainer"] = self.trainer.state()
        return state

    def write_state(self) -> None:
        write_state(self.plan.output_dir, self.state())

    def scale_to(self, count: int, why: str) -> None:
        """Drains or adds rollout instances toward `count`, kept within the mesh's bounds."""
        mesh = self.plan.mesh
        count = min(max(count, mesh.rollout_instances), mesh.instance_cap)
        if count == self.target_instances:
            return
        self._notice(f"rollout instances: {self.target_instances} -> {count} ({why})")
        self.target_instances = count
        self._reconcile_instances()
        self.write_state()

    def _reconcile_instances(self) -> None:
        serving = [index for index, service in self.rollouts.items() if not service.retiring]
        leaving = [index for index, service in self.rollouts.items() if service.retiring]
        steps = plan_scale(serving, leaving, self.target_instances, self.plan.mesh.instance_cap)
        for index in steps.drain:
            # SIGTERM drains: the instance hands its requests back with their tokens, then leaves.
            service = self.rollouts[index]
            service.retiring = True
            if service.child.process.poll() is None:
                service.child.process.send_signal(signal.SIGTERM)
        for index in steps.start:
            self.rollouts[index] = self._supervise_rollout(index)

    def _read_scale_request(self) -> None:
        try:
            wanted = self._scale_requests.new_request()
        except ValueError as exc:
            self._notice(str(exc))
            return
        if wanted is not None:
            self.scale_to(wanted, "rlmesh scale")

    def _after_exit(self, service: Supervised, now: float) -> None:
        """Decides, then after the backoff carries out, what follows a service's exit."""
        code = service.child.process.returncode
        if service.ended:
            return
        if service.restart_at is None:
            if not service.policy.restarts(code, service.restarts_total):
                service.ended = True
                self.events.put_nowait(ServiceEnded(service.name, code))
                return
            if now - service.started_at >= service.policy.stable_seconds:
                service.restarts_in_a_row = 0
            wait = service.policy.wait_seconds(service.restarts_in_a_row)
            service.restart_at = now + wait
            if service.resumes:
                self._notice(
                    f"{service.name} {describe_exit(code)}; starting it again in {wait:.0f} s "
                    f"(restart {service.restarts_total + 1}): it resumes from its latest checkpoint; "
                    f"see {service.child.log_path}"
                )
            else:
                self._notice(
                    f"{service.name} {describe_exit(code)}; restarting in {wait:.0f} s; see {service.child.log_path}"
                )
        if now >= service.restart_at:
            service.child = service.start()
            service.started_at, service.restart_at = now, None
            service.restarts_in_a_row += 1
            service.restarts_total += 1
            self._notice(
                f"{service.name} restarted (pid {service.child.process.pid}, "
                f"restart {service.restarts_in_a_row} in a row)"
            )
            self.write_state()

    def tick(self) -> None:
        """Applies a new scale request, lets drained instances go (starting those that waited for
        their indices) and restarts what exited once its backoff is over."""
        now = self._clock()
        self._read_scale_request()
        for index, service in list(self.rollouts.items()):
            if service.child.process.poll() is None:
                continue
            if service.retiring:
                del self.rollouts[index]
                self._notice(f"{service.name} left (drained)")
                self._reconcile_instances()
                self.write_state()
            else:
                self._after_exit(service, now)
        for service in (*self.relays, self.manager, self.weights, self.trainer):
            if service is not None and service.child.process.poll() is not None:
                self._after_exit(service, now)

    async def run(self) -> None:
        """Ticks until cancelled."""
        while True:
            self.tick()
            await asyncio.sleep(TICK_SECONDS)

    def stop(self) -> None:
        """The trainer first, the rollout instances, the weights service, the manager, its relay shards last."""
        services = [
            *self.relays,
            self.manager,
            self.weights,
            *(s for _, s in sorted(self.rollouts.items())),
            self.trainer,
        ]
        stop_children([s.child for s in services if s is not None])
        (self.plan.output_dir / STATE_FILE).unlink(missing_ok=True)
