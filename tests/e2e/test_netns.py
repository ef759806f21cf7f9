"""Rollout instances in network namespaces: what a killed `rlmesh up` left is swept by the next one
(a live mesh's namespaces are kept), and without the privileges `rlmesh up --rollout-netns` stops
with a clear message. The chaos suite runs a namespaced instance and cuts its link."""

import subprocess
import sys

import pytest

from rlmesh.launch.netns import (
    NETNS_PREFIX,
    NetnsLayout,
    NetnsLink,
    create_netns,
    netns_problem,
    remove_netns,
    sweep_netns,
)
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.e2e


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def loopback_addresses() -> str:
    return subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True
    ).stdout


def layout(tag: str, pid: int, subnet: str) -> NetnsLayout:
    link = NetnsLink(f"{NETNS_PREFIX}{tag}-{pid}-0", f"rlm{tag}h0", f"rlm{tag}n0", f"{subnet}.1", f"{subnet}.2")
    return NetnsLayout(tag, f"{subnet}.254", (link,))


@pytest.mark.skipif(bool(netns_problem()), reason=netns_problem() or "network namespaces available")
def test_sweep_removes_what_a_killed_mesh_left_and_keeps_a_live_mesh():
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    # A process whose command line names rlmesh stands for a live `rlmesh up`.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rlmesh"])
    left, live = layout("0dead0", dead_pid.pid, "10.250.1"), layout("0a11e0", alive.pid, "10.250.2")
    try:
        create_netns(left)
        create_netns(live)
        removed = sweep_netns()
        assert left.links[0].namespace in removed and f"{left.manager_label} {left.manager_host}/32" in removed
        assert left.links[0].namespace not in namespaces() and left.manager_host not in loopback_addresses()
        assert live.links[0].namespace in namespaces() and live.manager_host in loopback_addresses()
    finally:
        alive.kill()
        alive.wait()
        remove_netns(left)
        remove_netns(live)
    assert live.links[0].namespace not in namespaces() and live.manager_host not in loopback_addresses()


def test_up_without_the_privileges_for_namespaces_says_so(tmp_path):
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--rollout-netns",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    if not netns_problem():
        # Root here: take away the two capabilities the namespaces need.
        command = ["setpriv", "--inh-caps=-all", "--bounding-set=-net_admin,-sys_admin", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert (
        "mesh.rollout_netns = 1 runs rollout instances in network namespaces, which this process cannot create"
        in result.stderr
    )
    assert not (tmp_path / "run").exists()
