"""Helpers forked by the warm fork server (`rlmesh.forking.helpers`): a helper holds the descriptors
sent, at their numbers, and no other, runs with its environment and arguments, and its exit code
(or the signal that ended it) comes back; a requester killed takes its helper with it, not the warm
server; with no warm server to ask, or one that cannot serve it, the requester execs the helper."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlmesh.forking.forkserver import FORK_SERVER_NAME, process_alive
from rlmesh.forking.helpers import WARM_FORK_SERVER_ENV, WarmHelper, start_async_helper, start_helper
from rlmesh.forking.warm_forkserver import KEEPER_NAME
from rlmesh.launch.processes import process_name
from services.trainer.ranks.child_process import start_child
from tests.support.processes import parent_pid
from tests.support.waiting import wait_until

REPORTING_HELPER = """
import json, os, sys, time

def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False

report = {"argv": sys.argv[1:], "name": __name__, "asked": os.environ.get("ASKED"), "stdin": sys.stdin.read(),
          "fds": [fd for fd in range(256) if is_open(fd)], "parent": os.getppid()}
os.write(3, json.dumps(report).encode())
print("to stdout", flush=True)
if sys.argv[1:] == ["sleep"]:
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""

ECHO_HELPER = """
import os, sys
sys.stdout.write(f"{os.getppid()} " + sys.stdin.read().upper())
"""

REQUESTER = """
import os, sys, time
from rlmesh.forking.helpers import start_helper
helper = start_helper("reporting", ["sleep"], dict(os.environ), {3: os.open(os.devnull, os.O_WRONLY)})
print(helper.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def helper_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "reporting.py").write_text(REPORTING_HELPER)
    (tmp_path / "echo.py").write_text(ECHO_HELPER)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}", "ASKED": "yes"}


def start_reporting(env: dict[str, str], *args: str, stdin: bytes = b"") -> tuple[WarmHelper, socket.socket, int]:
    """The reporting helper, with `stdin` on its standard input, its report on descriptor 3 and a
    socket at 5; the end of the report's socket, and of its stdout's pipe."""
    stdin_read, stdin_write = os.pipe()
    os.write(stdin_write, stdin)
    os.close(stdin_write)
    stdout_read, stdout_write = os.pipe()
    report, report_end = socket.socketpair()
    extra, extra_end = socket.socketpair()
    helper = start_helper(
        "reporting", list(args), env, {0: stdin_read, 1: stdout_write, 3: report_end.fileno(), 5: extra_end.fileno()}
    )
    for fd in (stdin_read, stdout_write):
        os.close(fd)
    report_end.close()
    extra_end.close()
    extra.close()
    assert helper is not None, "the warm fork server did not fork the helper"
    return helper, report, stdout_read


def read_report(report: socket.socket) -> dict:
    return json.loads(report.makefile("rb").read())


def read_report_line(report: socket.socket) -> dict:
    """The report of a helper that goes on running (its socket stays open)."""
    received = b""
    while not received.endswith(b"}"):
        received += report.recv(65536)
    return json.loads(received)


def test_a_helper_holds_its_descriptors_environment_and_arguments_and_its_exit_code_comes_back(helper_env):
    helper, report, stdout = start_reporting(helper_env, "3", stdin=b"sent on stdin")
    seen = read_report(report)
    assert helper.wait(30) == 3 and helper.poll() == 3 and helper.returncode == 3
    assert seen["argv"] == ["3"] and seen["name"] == "__main__" and seen["asked"] == "yes"
    assert seen["fds"] == [0, 1, 2, 3, 5] and seen["stdin"] == "sent on stdin"
    with os.fdopen(stdout, "rb") as output:
        assert output.read() == b"to stdout\n"
    # Forked by its keeper, which the warm server forked: not this process's child.
    assert seen["parent"] != os.getpid()


def test_a_helper_ended_by_a_signal_reads_as_minus_the_signal(helper_env, warm_fork_server):
    helper, report, _ = start_reporting(helper_env, "sleep")
    seen = read_report_line(report)
    keeper = seen["parent"]
    assert process_name(keeper) == KEEPER_NAME and parent_pid(keeper) == warm_fork_server.pid
    assert process_name(helper.pid) == "reporting"
    with pytest.raises(subprocess.TimeoutExpired):
        helper.wait(0.2)
    helper.terminate()
    assert helper.wait(30) == -signal.SIGTERM
    wait_until(lambda: not process_alive(keeper), 30, "the keeper to exit")
    helper, report, _ = start_reporting(helper_env, "sleep")
    read_report_line(report)
    os.kill(helper.pid, signal.SIGKILL)
    assert helper.wait(30) == -signal.SIGKILL


async def test_an_async_helper_talks_over_pipes_and_is_waited_for(helper_env):
    helper = await start_async_helper("echo", [], helper_env)
    assert helper is not None
    helper.stdin.write(b"over the pipe")
    await helper.stdin.drain()
    helper.stdin.close()
    parent, echoed = (await asyncio.wait_for(helper.stdout.read(), 30)).decode().split(" ", 1)
    assert echoed == "OVER THE PIPE" and int(parent) != os.getpid()
    assert await asyncio.wait_for(helper.wait(), 30) == 0 and helper.returncode == 0


def test_a_requester_killed_takes_its_helper_and_keeper_with_it_not_the_warm_server(helper_env, warm_fork_server):
    requester = subprocess.Popen([sys.executable, "-c", REQUESTER], env=helper_env, stdout=subprocess.PIPE, text=True)
    try:
        helper = int(requester.stdout.readline())
        keeper = parent_pid(helper)
        assert process_name(keeper) == KEEPER_NAME
        requester.send_signal(signal.SIGKILL)
        requester.wait(30)
        wait_until(
            lambda: not process_alive(helper) and not process_alive(keeper), 30, "the helper and its keeper to end"
        )
        assert process_name(warm_fork_server.pid) == FORK_SERVER_NAME
    finally:
        if requester.poll() is None:
            requester.kill()


@pytest.mark.parametrize("server", ["unset", "nobody serves"])
async def test_a_requester_with_no_warm_server_to_ask_execs_its_helper(helper_env, server, tmp_path, monkeypatch):
    if server == "unset":
        monkeypatch.delenv(WARM_FORK_SERVER_ENV)
    else:
        monkeypatch.setenv(WARM_FORK_SERVER_ENV, str(tmp_path / "none.sock"))
    monkeypatch.setenv("PYTHONPATH", helper_env["PYTHONPATH"])
    helper = await start_child("echo")
    assert isinstance(helper, asyncio.subprocess.Process)
    helper.stdin.close()
    parent, _ = (await asyncio.wait_for(helper.stdout.read(), 60)).decode().split(" ", 1)
    assert int(parent) == os.getpid() and await helper.wait() == 0


NETNS_REQUESTER = textwrap.dedent("""
    import os
    from rlmesh.forking.helpers import start_helper
    extra_fds = {3: os.open(os.devnull, os.O_WRONLY)}
    print("forked" if start_helper("reporting", ["0"], dict(os.environ), extra_fds) else "exec")
""")


def test_a_requester_in_another_network_namespace_is_refused(helper_env):
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not let an unprivileged process make a network namespace")
    answered = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", NETNS_REQUESTER],
        env=helper_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answered.stdout.splitlines()[-1] == "exec", answered.stderr
    assert "the requester is in another network namespace" in answered.stdout + answered.stderr
