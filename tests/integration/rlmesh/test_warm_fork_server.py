"""`rlmesh fork-server` as a real process: each launcher that connects gets a run's server of its
own, whose processes carry the run's marker for `mesh_processes`; a launcher killed with SIGKILL
takes its run's processes with it, not the others'; bad sockets are refused with the reason."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.forking.forkserver import FORK_SERVER_NAME, ForkServer, ForkServerError
from rlmesh.forking.warm_forkserver import MARKER_ROOM
from rlmesh.launch.processes import MESH_ID_ENV, mesh_processes, process_name
from tests.support.processes import parent_pid
from tests.support.waiting import wait_until

SLEEPER = "import time\ntime.sleep(120)\n"

LAUNCHER = """
import json, sys, time
from pathlib import Path
from rlmesh.forking.forkserver import ForkServer
socket, run, env = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
forks = ForkServer([], env, run / "forkserver.log", Path(socket))
forks.wait_ready(60)
forks.spawn("sleeper", [], env, run / "sleeper.log")
print(forks.pid, flush=True)
time.sleep(120)
"""


def run_env(tmp_path: Path, run: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}", MESH_ID_ENV: str(run)}


def test_each_run_gets_its_own_server_marked_with_its_run(tmp_path, warm_fork_server):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    runs = [tmp_path / "run-a", tmp_path / "run-b"]
    servers = []
    try:
        for run in runs:
            forks = ForkServer([], run_env(tmp_path, run), run / "forkserver.log", warm_fork_server.socket)
            servers.append(forks)
            forks.wait_ready(60)
            forks.spawn("sleeper", [], run_env(tmp_path, run), run / "sleeper.log")
        for run, forks in zip(runs, servers):
            wait_until(lambda run=run: len(mesh_processes(run)) == 2, 30, "the run's server and its service")
            found = mesh_processes(run)
            assert forks.pid in found and warm_fork_server.pid not in found
            assert process_name(forks.pid) == FORK_SERVER_NAME and parent_pid(forks.pid) == warm_fork_server.pid
            assert [parent_pid(pid) for pid in found if pid != forks.pid] == [forks.pid]
        assert servers[0].pid != servers[1].pid
    finally:
        for forks in servers:
            forks.close()
    for run in runs:
        wait_until(lambda run=run: mesh_processes(run) == [], 30, "the run's processes to end")


def test_a_launcher_killed_takes_its_run_with_it_and_leaves_the_warm_server(tmp_path, warm_fork_server):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(warm_fork_server.socket), str(run), json.dumps(run_env(tmp_path, run))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server_pid = int(launcher.stdout.readline())
        wait_until(lambda: len(mesh_processes(run)) == 2, 30, "the run's server and its service")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        wait_until(lambda: mesh_processes(run) == [], 30, "the run's server and service to end")
        assert process_name(server_pid) is None
        assert process_name(warm_fork_server.pid) == FORK_SERVER_NAME
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_marker_longer_than_its_room_is_refused(tmp_path, warm_fork_server):
    run = tmp_path / ("r" * MARKER_ROOM)
    forks = ForkServer([], {**os.environ, MESH_ID_ENV: str(run)}, tmp_path / "forkserver.log", warm_fork_server.socket)
    try:
        with pytest.raises(ForkServerError, match=f"{MESH_ID_ENV} .* does not fit the {MARKER_ROOM} bytes held for it"):
            forks.wait_ready(60)
    finally:
        forks.close()


def test_bad_sockets_are_refused_with_the_reason(tmp_path, warm_fork_server):
    def fork_server(socket: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rlmesh.cli.main", "fork-server", "--socket", socket],
            capture_output=True,
            text=True,
            timeout=60,
        )

    taken = fork_server(str(warm_fork_server.socket))
    assert taken.returncode == 1 and f"a fork server already listens on {warm_fork_server.socket}" in taken.stderr
    assert warm_fork_server.socket.exists()
    missing = fork_server(str(tmp_path / "no-such-folder" / "s.sock"))
    assert missing.returncode == 2 and f"no folder {tmp_path / 'no-such-folder'}" in missing.stderr
    kept = tmp_path / "notes.txt"
    kept.write_text("not a socket")
    occupied = fork_server(str(kept))
    assert occupied.returncode == 1 and f"{kept} exists and is not a socket" in occupied.stderr
    assert kept.read_text() == "not a socket"
    long = fork_server(str(tmp_path / ("s" * 120)))
    assert long.returncode == 2 and "a Unix socket path is at most 107 bytes" in long.stderr
    with pytest.raises(ForkServerError, match=f"no warm fork server answers at {tmp_path / 'none.sock'}"):
        ForkServer([], dict(os.environ), tmp_path / "forkserver.log", tmp_path / "none.sock")
