"""`rlmesh status`'s view of the mesh: what it shows of each rollout instance, and whether the mesh runs insecure."""

from rich.console import Console

from rlmesh.cli.status import Snapshot, render
from rlmesh.manager.v1 import manager_pb2


def shown(*instances: manager_pb2.InstanceStatus) -> str:
    console = Console(width=200, record=True)
    console.print(render(Snapshot(manager_pb2.GetStatusResponse(instances=instances), None, None, {})))
    return console.export_text()


def test_an_instance_with_a_saturation_batch_shows_it_beside_what_it_runs():
    text = shown(
        manager_pb2.InstanceStatus(instance_id="r0", running_requests=40, saturation_batch_size=36, schedulable=True),
        manager_pb2.InstanceStatus(instance_id="r1", running_requests=7, schedulable=True),
    )
    (r0,) = [line for line in text.splitlines() if "r0" in line]
    (r1,) = [line for line in text.splitlines() if "r1" in line]
    assert "40 (knee 36)" in r0 and "ready" in r0
    assert "knee" not in r1 and " 7 " in r1


def test_a_quarantined_instance_shows_how_long_it_has_left():
    text = shown(manager_pb2.InstanceStatus(instance_id="r0", quarantine_remaining_seconds=3.6, quarantines=2))
    (r0,) = [line for line in text.splitlines() if "r0" in line]
    assert "quarantined 4 s (2x)" in r0


def test_a_mesh_running_insecure_says_so():
    def view(authorization: str) -> str:
        console = Console(width=300, record=True)
        console.print(render(Snapshot(manager_pb2.GetStatusResponse(authorization=authorization), None, None, {})))
        return console.export_text()

    assert "INSECURE: authorization off" in view("off")
    assert "authorization: bearer secrets" in view("bearer secrets") and "INSECURE" not in view("bearer secrets")
