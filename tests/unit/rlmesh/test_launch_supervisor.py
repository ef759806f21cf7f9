"""The supervisor with fake processes: one restart policy with backoff for every service (the
trainer's resumable restart included), scaling (down and up again before the drained instances
have left), the autoscaler's task, mesh.json, and the order processes stop in."""

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.job import Job, MeshSection
from rlmesh.launch import autoscale
from rlmesh.launch.autoscale import Autoscaler, LocalInstances, follow_recommendations
from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.processes import Child, ServiceSpec
from rlmesh.launch.scale import plan_scale, request_scale
from rlmesh.launch.state import STATE_FILE
from rlmesh.launch.supervisor import TRAINER_RESTARTS, Notice, ServiceEnded, Supervisor


class FakeProcess:
    """A spawned process that runs until told to exit; SIGTERM ends it only when waited on, as a
    draining instance leaves once its requests are handed back."""

    def __init__(self, pid: int, stopped: list[str], name: str) -> None:
        self.pid, self.returncode, self.signals = pid, None, []
        self._stopped, self._name = stopped, name

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        if signal.SIGTERM in self.signals and self.returncode is None:
            self.returncode = -signal.SIGTERM
            self._stopped.append(self._name)
        return self.returncode

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL

    def exit(self, code: int) -> None:
        self.returncode = code


class FakeMesh:
    """Spawns fake processes, tells the time by hand, and collects the supervisor's events."""

    def __init__(self, tmp_path: Path, **mesh: object) -> None:
        self.now = 0.0
        self.pids = iter(range(1000, 2000))
        self.spawned: list[str] = []
        self.stopped: list[str] = []
        plan = LaunchPlan(Job(mesh=MeshSection(**mesh)), output_dir=tmp_path, model_dir=tmp_path)
        self.supervisor = Supervisor(plan, self.spawn, self.serving, lambda: self.now)
        asyncio.run(self.supervisor.start_services())
        asyncio.run(self.supervisor.start_trainer())

    def spawn(self, spec: ServiceSpec) -> Child:
        self.spawned.append(spec.name)
        return Child(
            spec.name, spec.address, FakeProcess(next(self.pids), self.stopped, spec.name), Path(f"{spec.name}.log")
        )

    async def serving(self, children: list[Child]) -> None:
        pass

    def events(self) -> list[str | ServiceEnded]:
        """The events since the last call: a notice as its line."""
        events = []
        while not self.supervisor.events.empty():
            event = self.supervisor.events.get_nowait()
            events.append(event.text if isinstance(event, Notice) else event)
        return events

    def tick_at(self, now: float) -> list[str | ServiceEnded]:
        self.now = now
        self.supervisor.tick()
        return self.events()

    def rollout(self, index: int) -> FakeProcess:
        return self.supervisor.rollouts[index].child.process

    def state(self) -> dict:
        return json.loads((self.supervisor.plan.output_dir / STATE_FILE).read_text())


def test_scaling_down_then_up_before_the_drained_instances_left_starts_them_once_their_indices_are_free(tmp_path):
    mesh = FakeMesh(tmp_path, rollout_instances=1, max_rollout_instances=3)
    supervisor = mesh.supervisor
    supervisor.scale_to(3, "rlmesh scale")
    supervisor.scale_to(1, "rlmesh scale")
    draining = [mesh.rollout(1), mesh.rollout(2)]
    assert all(p.signals == [signal.SIGTERM] for p in draining)
    supervisor.scale_to(3, "rlmesh scale")
    assert mesh.events() == [
        "rollout instances: 1 -> 3 (rlmesh scale)",
        "rollout instances: 3 -> 1 (rlmesh scale)",
        "rollout instances: 1 -> 3 (rlmesh scale)",
    ]
    state = mesh.state()["rollout_instances"]
    assert state["target"] == 3 and [r["name"] for r in state["running"]] == ["rollout-0"]
    assert state["leaving"] == ["rollout-1", "rollout-2"]

    draining[1].exit(0)
    assert mesh.tick_at(1.0) == ["rollout-2 left (drained)"]
    assert mesh.rollout(2) is not draining[1] and mesh.rollout(2).poll() is None
    draining[0].exit(0)
    assert mesh.tick_at(2.0) == ["rollout-1 left (drained)"]
    state = mesh.state()["rollout_instances"]
    assert [r["name"] for r in state["running"]] == ["rollout-0", "rollout-1", "rollout-2"] and state["leaving"] == []
    assert mesh.spawned.count("rollout-1") == mesh.spawned.count("rollout-2") == 2


def test_a_request_in_the_scale_file_is_read_once_and_kept_within_the_bounds(tmp_path):
    mesh = FakeMesh(tmp_path, rollout_instances=1, max_rollout_instances=2)
    request_scale(tmp_path, 5)
    assert mesh.tick_at(0.5) == ["rollout instances: 1 -> 2 (rlmesh scale)"]
    assert mesh.tick_at(1.0) == []
    assert mesh.spawned.count("rollout-1") == 1
    request = tmp_path / "scale.json"
    modified = request.stat().st_mtime
    request.write_text("{}")
    # Newer than the request read, however coarse the file system's clock.
    os.utime(request, (modified + 1, modified + 1))
    assert mesh.tick_at(1.5) == [f"ignored {tmp_path / 'scale.json'}: 'rollout_instances'"]


def test_every_service_restarts_after_a_backoff_that_grows_in_a_row_and_resets_once_it_ran_stably(tmp_path):
    mesh = FakeMesh(tmp_path)
    manager = mesh.supervisor.manager
    manager.child.process.exit(-9)
    assert mesh.tick_at(10.0) == ["manager exited (killed by signal 9); restarting in 1 s; see manager.log"]
    assert mesh.tick_at(10.5) == []
    restarted = mesh.tick_at(11.0)
    assert restarted == [f"manager restarted (pid {manager.child.process.pid}, restart 1 in a row)"]
    manager.child.process.exit(1)
    assert mesh.tick_at(12.0) == ["manager exited (exit code 1); restarting in 2 s; see manager.log"]
    assert mesh.tick_at(13.0) == []
    assert mesh.tick_at(14.0)[0].endswith("restart 2 in a row)")
    assert mesh.state()["services"][0] | {"pid": 0} == {
        "name": "manager",
        "pid": 0,
        "address": "127.0.0.1:50151",
        "metrics": "127.0.0.1:51151",
        "restarts": 2,
        "restarts_total": 2,
    }
    # Sixty seconds up: healthy again, so the next restart waits the shortest time.
    manager.child.process.exit(-9)
    assert mesh.tick_at(74.0) == ["manager exited (killed by signal 9); restarting in 1 s; see manager.log"]
    assert mesh.tick_at(75.0)[0].endswith("restart 1 in a row)") and manager.restarts_total == 3
    assert mesh.spawned.count("manager") == 4


def test_the_trainer_killed_by_a_signal_resumes_with_a_growing_backoff_and_an_exit_code_ends_the_run(tmp_path):
    mesh = FakeMesh(tmp_path)
    trainer = mesh.supervisor.trainer
    trainer.child.process.exit(-9)
    first = mesh.tick_at(1.0)
    assert first == [
        "trainer exited (killed by signal 9); starting it again in 0 s (restart 1): "
        "it resumes from its latest checkpoint; see trainer.log",
        f"trainer restarted (pid {trainer.child.process.pid}, restart 1 in a row)",
    ]
    assert mesh.state()["trainer"]["pid"] == trainer.child.process.pid
    trainer.child.process.exit(-9)
    assert mesh.tick_at(2.0) == [
        "trainer exited (killed by signal 9); starting it again in 1 s (restart 2): "
        "it resumes from its latest checkpoint; see trainer.log"
    ]
    assert mesh.tick_at(3.0)[0].endswith("restart 2 in a row)")
    trainer.child.process.exit(-9)
    assert "starting it again in 2 s (restart 3)" in mesh.tick_at(4.0)[0]
    assert mesh.tick_at(5.0) == []
    mesh.tick_at(6.0)
    trainer.child.process.exit(0)
    assert mesh.tick_at(7.0) == [ServiceEnded("trainer", 0)]
    assert mesh.tick_at(8.0) == []
    assert mesh.spawned.count("trainer") == 4


def test_the_trainer_is_started_again_at_most_its_policys_limit(tmp_path):
    mesh = FakeMesh(tmp_path)
    trainer = mesh.supervisor.trainer
    for restart in range(TRAINER_RESTARTS):
        trainer.child.process.exit(-9)
        mesh.tick_at(100.0 * restart)
        mesh.tick_at(100.0 * restart + 50)
    trainer.child.process.exit(-9)
    assert mesh.tick_at(1e6) == [ServiceEnded("trainer", -9)]
    assert mesh.spawned.count("trainer") == TRAINER_RESTARTS + 1


def test_a_killed_instance_restarts_but_a_drained_one_leaves(tmp_path):
    mesh = FakeMesh(tmp_path, rollout_instances=1, max_rollout_instances=2)
    mesh.supervisor.scale_to(2, "rlmesh scale")
    mesh.rollout(0).exit(-9)
    mesh.supervisor.scale_to(1, "rlmesh scale")
    mesh.rollout(1).exit(0)
    assert mesh.tick_at(1.0)[-2:] == [
        "rollout-0 exited (killed by signal 9); restarting in 1 s; see rollout-0.log",
        "rollout-1 left (drained)",
    ]
    mesh.tick_at(2.0)
    assert sorted(mesh.supervisor.rollouts) == [0] and mesh.rollout(0).poll() is None
    assert mesh.spawned.count("rollout-0") == 2 and mesh.spawned.count("rollout-1") == 1


def test_the_trainer_stops_first_and_the_manager_last(tmp_path):
    mesh = FakeMesh(tmp_path, rollout_instances=2)
    mesh.supervisor.stop()
    assert mesh.stopped == ["trainer", "rollout-1", "rollout-0", "weights", "manager"]
    assert not (tmp_path / STATE_FILE).exists()


@given(st.sets(st.integers(0, 7)), st.sets(st.integers(0, 7)), st.integers(1, 8))
def test_a_scale_plan_drains_the_highest_and_starts_on_free_indices_only(serving, leaving, target):
    leaving -= serving
    cap = 8
    steps = plan_scale(serving, leaving, target, cap)
    assert set(steps.drain) <= serving and all(
        index > kept for index in steps.drain for kept in serving - set(steps.drain)
    )
    assert not set(steps.start) & (serving | leaving) and all(0 <= index < cap for index in steps.start)
    after = len(serving) - len(steps.drain) + len(steps.start)
    assert after == min(target, cap - len(leaving)) if len(serving) < target else after == target


def test_the_autoscaler_task_asks_the_supervisor_for_the_count_the_rule_gives(tmp_path, monkeypatch):
    monkeypatch.setattr(autoscale, "POLL_SECONDS", 0)
    mesh = FakeMesh(tmp_path, rollout_instances=1, max_rollout_instances=3, autoscale=True)
    recommendations = iter([None, 3, 3, 3, 3])
    asked = asyncio.Event()

    async def recommendation() -> int | None:
        try:
            return next(recommendations)
        except StopIteration:
            asked.set()
            await asyncio.Event().wait()

    async def follow() -> None:
        clock = iter(range(100))
        task = asyncio.create_task(
            follow_recommendations(
                Autoscaler(1, 3, 1, 1), LocalInstances(mesh.supervisor), recommendation, lambda: next(clock)
            )
        )
        await asyncio.wait_for(asked.wait(), 30)
        task.cancel()

    asyncio.run(follow())
    assert mesh.supervisor.target_instances == 3
    assert mesh.events() == [
        "rollout instances: 1 -> 2 (autoscale: the manager recommends 3)",
        "rollout instances: 2 -> 3 (autoscale: the manager recommends 3)",
    ]


@pytest.mark.parametrize("count", [0, 4])
def test_scaling_outside_the_bounds_stops_at_them(tmp_path, count):
    mesh = FakeMesh(tmp_path, rollout_instances=1, max_rollout_instances=3)
    mesh.supervisor.scale_to(count, "rlmesh scale")
    assert mesh.supervisor.target_instances == (1 if count == 0 else 3)
