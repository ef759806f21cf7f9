"""The fork server as a real process, started by the launcher or forked for it by the warm fork
server: services forked from it run `python -m module` with their own arguments, environment, log,
session and network namespace; their exits, signals and crashes read as subprocess.Popen's would; it
refuses to fork after imports that started threads; its end takes its services with it."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from rlmesh.forking.forkserver import FORK_SERVER_NAME, ForkServer, ForkServerError, process_alive
from rlmesh.launch.netns import NETNS_DIR, netns_problem
from rlmesh.launch.processes import process_name
from tests.support.processes import parent_pid
from tests.support.waiting import wait_until

REPORTING_MODULE = """
import json, os, sys, time
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
report = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in ("ASKED", "DROPPED")},
          "session_leader": os.getsid(0) == os.getpid(), "name": __name__,
          "preloaded": "forkmod_preload" in sys.modules, "netns_inode": os.stat("/proc/self/ns/net").st_ino}
open(os.environ["REPORT"], "w").write(json.dumps(report))
if sys.argv[1:] == ["sleep"]:
    time.sleep(60)
if sys.argv[1:] == ["crash"]:
    raise KeyError("crashed on purpose")
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture(params=["own", "warm"])
def server(request, tmp_path, warm_fork_server):
    (tmp_path / "forkmod.py").write_text(REPORTING_MODULE)
    (tmp_path / "forkmod_preload.py").write_text("PRELOADED = True\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}", "DROPPED": "at start"}
    warm_socket = warm_fork_server.socket if request.param == "warm" else None
    forks = ForkServer(["forkmod_preload"], env, tmp_path / "forkserver.log", warm_socket)
    forks.wait_ready(60)
    yield forks
    forks.close()


def spawn(server: ForkServer, tmp_path: Path, *args: str, netns: str | None = None) -> tuple:
    report = tmp_path / f"report-{'-'.join(args) or 'none'}.json"
    env = {k: v for k, v in os.environ.items() if k != "DROPPED"} | {
        "ASKED": "yes",
        "REPORT": str(report),
        "PYTHONPATH": str(tmp_path),
    }
    process = server.spawn("forkmod", list(args), env, tmp_path / "service.log", netns)
    return process, report


def test_a_forked_module_runs_as_main_with_its_arguments_environment_log_and_session(server, tmp_path):
    process, report = spawn(server, tmp_path, "3", "more")
    assert process.wait(30) == 3 and process.poll() == 3 and process.returncode == 3
    seen = json.loads(report.read_text())
    assert seen["argv"] == ["3", "more"] and seen["name"] == "__main__" and seen["preloaded"]
    # What the launcher asked for is set; what it no longer has is gone.
    assert seen["env"] == {"ASKED": "yes", "DROPPED": None}
    assert seen["session_leader"]
    assert seen["netns_inode"] == os.stat("/proc/self/ns/net").st_ino
    assert (tmp_path / "service.log").read_text().splitlines() == ["to stdout", "to stderr"]


@pytest.mark.skipif(bool(netns_problem()), reason=netns_problem() or "network namespaces available")
def test_a_service_forked_into_a_network_namespace_lives_there(server, tmp_path):
    # Not named like a mesh's namespaces, which a concurrent test's sweep may remove.
    namespace = f"forktest-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        process, report = spawn(server, tmp_path, "0", netns=namespace)
        assert process.wait(30) == 0
        assert json.loads(report.read_text())["netns_inode"] == os.stat(NETNS_DIR / namespace).st_ino
        assert os.stat(NETNS_DIR / namespace).st_ino != os.stat("/proc/self/ns/net").st_ino
    finally:
        subprocess.run(["ip", "netns", "delete", namespace], check=True)

    missing, _ = spawn(server, tmp_path, "0", netns=namespace)
    assert missing.wait(30) == 1
    assert f"No such file or directory: '{NETNS_DIR / namespace}'" in (tmp_path / "service.log").read_text()


def test_signals_and_crashes_read_as_popen_codes(server, tmp_path):
    sleeping, report = spawn(server, tmp_path, "sleep")
    wait_until(report.exists, 30, "the sleeping service to start")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(0.2)
    assert sleeping.poll() is None
    sleeping.send_signal(signal.SIGTERM)
    assert sleeping.wait(30) == -signal.SIGTERM
    sleeping.kill()

    crashing, _ = spawn(server, tmp_path, "crash")
    assert crashing.wait(30) == 1
    assert "KeyError: 'crashed on purpose'" in (tmp_path / "service.log").read_text()


@pytest.mark.parametrize("warm", [False, True], ids=["own", "warm"])
def test_imports_that_start_a_thread_make_it_refuse_to_fork(tmp_path, warm, warm_fork_server):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}"}
    forks = ForkServer(["threaded"], env, tmp_path / "forkserver.log", warm_fork_server.socket if warm else None)
    try:
        with pytest.raises(ForkServerError, match="started 1 threads; forking is unsafe"):
            forks.wait_ready(60)
        with pytest.raises(ForkServerError):
            forks.spawn("threaded", [], env, tmp_path / "service.log")
    finally:
        forks.close()


def test_when_the_server_dies_its_services_get_sigterm_and_read_as_ended(server, tmp_path, warm_fork_server):
    process, report = spawn(server, tmp_path, "sleep")
    wait_until(report.exists, 30, "the service to start")
    assert process_name(server.pid) == FORK_SERVER_NAME
    assert parent_pid(server.pid) in (os.getpid(), warm_fork_server.pid)
    os.kill(server.pid, signal.SIGKILL)
    assert process.wait(30) == -signal.SIGTERM
    with pytest.raises(ForkServerError, match="stopped|cannot fork"):
        spawn(server, tmp_path, "0")


SLOW_WATCH = """
import time
import rlmesh.forking.forkserver as forkserver
watch = forkserver.die_with_parent
def slow_watch(*args):
    time.sleep(1.0)
    watch(*args)
forkserver.die_with_parent = slow_watch
"""


@pytest.mark.parametrize("warm", [False, True], ids=["own", "warm"])
def test_a_service_whose_server_dies_before_the_kernel_watches_still_ends(tmp_path, warm, warm_fork_server):
    # The server is killed while its new service is still before the kernel's watch (a second's
    # sleep there, patched in): no SIGTERM will come, and the service must end by itself.
    (tmp_path / "forkmod.py").write_text(REPORTING_MODULE)
    (tmp_path / "slow_watch.py").write_text(SLOW_WATCH)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}"}
    forks = ForkServer(["slow_watch"], env, tmp_path / "forkserver.log", warm_fork_server.socket if warm else None)
    try:
        forks.wait_ready(60)
        process, report = spawn(forks, tmp_path, "sleep")
        os.kill(forks.pid, signal.SIGKILL)
        wait_until(lambda: not process_alive(process.pid), 30, "the service to end")
        assert not report.exists()
    finally:
        forks.close()
