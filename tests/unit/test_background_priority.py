"""Weight transfers yield the CPU: a rank's receiving and checking threads are idle-class, and a
background process (the weights service) runs at nice 19 with its session's autogroup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlmesh.transfer.receiver import RankReceiver
from rlmesh.transfer.tcp import TcpListener


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
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, start_new_session=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["19", "19"], out.stderr
