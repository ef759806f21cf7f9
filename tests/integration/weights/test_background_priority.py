"""Weight transfers yield the CPU: a rank's receiving and checking threads are idle-class, and a
background process (the weights service) runs at nice 19 with its session's autogroup; a
session lowered for background work always comes back, even where the kernel defers changes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from rlmesh.lifecycle import CAP_SYS_ADMIN, SessionPriority, effective_capabilities
from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import TcpListener
from tests.support.paths import REPO_ROOT


def test_receiving_and_checking_threads_are_idle_class_only_when_asked():
    for background, policy in ((True, os.SCHED_IDLE), (False, os.SCHED_OTHER)):
        receiver = RankReceiver(0, background=background)
        listener = TcpListener("127.0.0.1", receiver)
        try:
            for thread in (receiver._verifier, listener._thread):
                assert os.sched_getscheduler(thread.native_id) == policy, (thread.name, background)
        finally:
            listener.close()
            receiver.close()


def test_a_background_process_lowers_its_threads_and_its_autogroup():
    # A session of its own, as the launcher gives every service: the autogroup written is its own.
    script = (
        "import os, threading\n"
        "from rlmesh.lifecycle import background_process\n"
        "background_process()\n"
        "later = threading.Thread(target=lambda: print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))\n"
        "later.start(); later.join()\n"
        "print(open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') else 19)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    assert out.stdout.split() == ["19", "19"], out.stderr


class ScriptedAutogroup:
    """/proc/self/autogroup with the kernel's answers scripted: each write raises the next of
    `errors` while any are left."""

    def __init__(self) -> None:
        self.nice = 0
        self.errors: list[OSError] = []

    def read_text(self) -> str:
        return f"/autogroup-7 nice {self.nice}\n"

    def write_text(self, text: str) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.nice = int(text)


def test_a_deferred_change_is_asked_for_again_until_the_kernel_takes_it(monkeypatch):
    autogroup = ScriptedAutogroup()
    monkeypatch.setattr(SessionPriority, "AUTOGROUP", autogroup)
    priority = SessionPriority()
    priority.lower(True)
    assert autogroup.nice == 19 and priority.lowered
    # A process without CAP_SYS_ADMIN that changed its autogroup less than 100 ms ago.
    autogroup.errors = [BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")] * 3
    for _ in range(3):
        priority.lower(False)
        assert autogroup.nice == 19 and priority.lowered and priority.usable
    priority.lower(False)
    assert autogroup.nice == 0 and not priority.lowered and priority.usable


def test_a_refused_change_leaves_the_priority_alone_for_good(monkeypatch):
    autogroup = ScriptedAutogroup()
    monkeypatch.setattr(SessionPriority, "AUTOGROUP", autogroup)
    autogroup.errors = [PermissionError(errno.EPERM, "Operation not permitted")]
    priority = SessionPriority()
    priority.lower(True)
    assert not priority.usable and not priority.lowered
    priority.lower(True)
    assert autogroup.nice == 0


def test_without_cap_sys_admin_a_lowered_session_comes_back_within_the_kernels_rate_limit():
    """The kernel's own answer: a process without CAP_SYS_ADMIN lowers its session, and asking
    straight back is deferred (EAGAIN); asked again on the following calls, it comes back."""
    if not SessionPriority().usable or not os.access(SessionPriority.AUTOGROUP, os.W_OK):
        pytest.skip("this kernel shows no autogroup priority, or does not let it be written")
    script = (
        "import json, time\n"
        "from rlmesh.lifecycle import SessionPriority\n"
        "priority = SessionPriority()\n"
        "before = priority.read()\n"
        "deadline = time.monotonic() + 10\n"
        "while not priority.lowered and time.monotonic() < deadline:\n"
        "    priority.lower(True)\n"
        "low = priority.read()\n"
        "priority.lower(False)\n"
        "straight_back = priority.read()\n"
        "while priority.lowered and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "    priority.lower(False)\n"
        "print(json.dumps({'before': before, 'low': low, 'straight_back': straight_back, 'after': priority.read(),\n"
        "                  'usable': priority.usable}))\n"
    )
    command = [sys.executable, "-c", script]
    if effective_capabilities() >> CAP_SYS_ADMIN & 1:
        if shutil.which("setpriv") is None:
            pytest.skip("running with CAP_SYS_ADMIN, and util-linux's setpriv is not here to drop it")
        command = ["setpriv", "--inh-caps=-all", "--bounding-set=-sys_admin", *command]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["low"] == 19
    if seen["straight_back"] != 19:
        pytest.skip("this kernel took two changes within 100 ms: it has no rate limit to defer with")
    assert seen["after"] == seen["before"] and seen["usable"], seen
