"""Helper processes (`python -m module`) forked for this process by the warm fork server named in
RLMESH_FORK_SERVER, past the imports that cost an exec'd one 6 to 10 CPU-seconds; None where it
cannot fork one, and the caller execs it as before."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import structlog

from rlmesh.forking.forkserver import process_alive, read_line

log = structlog.get_logger()

WARM_FORK_SERVER_ENV = "RLMESH_FORK_SERVER"
"""The warm fork server's socket: where `rlmesh up` finds it when --fork-server is not given, and
the processes it starts ask it for their helpers."""
REPLY_TIMEOUT_SECONDS = 60.0
"""How long a request waits for the helper's pid: a warm server answers once its own imports are done."""


def _request(
    module: str, args: list[str], env: dict[str, str], fds: dict[int, int]
) -> tuple[socket.socket, int, bytes] | None:
    """Asks the warm fork server for `python -m module args...` holding `fds` (its descriptor number →
    this process's descriptor): the keeper's connection, the helper's pid and what followed the pid;
    None, said in the log, where no server answers or it refuses."""
    path = os.environ.get(WARM_FORK_SERVER_ENV)
    if not path:
        return None
    hello = {
        "helper": module,
        "args": args,
        "env": env,
        "cwd": os.getcwd(),
        "fds": list(fds),
        "executable": sys.executable,
        "netns": os.stat("/proc/self/ns/net").st_ino,
    }
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(REPLY_TIMEOUT_SECONDS)
        connection.connect(path)
        data = (json.dumps(hello) + "\n").encode()
        sent = socket.send_fds(connection, [data], list(fds.values()))
        connection.sendall(data[sent:])
        line, rest = read_line(connection)
        reply = json.loads(line)
        if "pid" not in reply:
            raise ConnectionRefusedError(reply.get("refused", line.decode()))
    except (OSError, EOFError, ValueError) as exc:
        connection.close()
        log.info(
            "no warm fork server forks this helper; starting it by exec", module=module, socket=path, reason=str(exc)
        )
        return None
    connection.settimeout(None)
    return connection, reply["pid"], rest


class _KeptHelper:
    """What both handles share: the keeper's connection, on which it reports the helper's exit and
    takes signals for it; closing it (or this process's end) has the keeper end the helper."""

    def __init__(self, connection: socket.socket, pid: int, received: bytes) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection
        self._received = received

    def _report(self) -> bool:
        """Whether the keeper has said how the helper ended; sets returncode if so."""
        if b"\n" not in self._received:
            return False
        self.returncode = json.loads(self._received.split(b"\n", 1)[0])["exited"]
        self._connection.close()
        return True

    def _keeper_gone(self) -> None:
        """The keeper ended without a report; the kernel sent the helper SIGTERM, and it is gone."""
        self.returncode = -signal.SIGTERM
        self._connection.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self._connection.sendall((json.dumps({"signal": int(sig)}) + "\n").encode())
            except OSError:
                pass  # the keeper is gone; the kernel sent the helper SIGTERM

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmHelper(_KeptHelper):
    """A helper behind subprocess.Popen's interface; any thread may wait while another polls."""

    def __init__(self, connection: socket.socket, pid: int, received: bytes) -> None:
        super().__init__(connection, pid, received)
        self._reading = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None and self._reading.acquire(blocking=False):
            try:
                self._read(0)
            finally:
                self._reading.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._reading.acquire(timeout=-1 if remaining is None else remaining):
                try:
                    if self.returncode is None:
                        self._read(remaining)
                finally:
                    self._reading.release()
            if self.returncode is None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        """Takes what the keeper sends within `timeout` (None: until it sends something)."""
        if self._report() or not select.select([self._connection], [], [], timeout)[0]:
            return
        chunk = self._connection.recv(4096)
        if chunk:
            self._received += chunk
            self._report()
            return
        while process_alive(self.pid):
            time.sleep(0.05)
        self._keeper_gone()


class AsyncWarmHelper(_KeptHelper):
    """A helper with pipes on its stdin and stdout, behind what end_child and rank 0's handles use
    of asyncio.subprocess.Process."""

    def __init__(
        self,
        connection: socket.socket,
        pid: int,
        received: bytes,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
    ) -> None:
        super().__init__(connection, pid, received)
        self.stdin = stdin
        self.stdout = stdout
        connection.setblocking(False)
        self._watching = asyncio.create_task(self._watch(), name=f"helper {pid}")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._report():
            chunk = await loop.sock_recv(self._connection, 4096)
            if not chunk:
                while process_alive(self.pid):
                    await asyncio.sleep(0.05)
                self._keeper_gone()
                return
            self._received += chunk

    async def wait(self) -> int:
        await asyncio.shield(self._watching)
        assert self.returncode is not None
        return self.returncode


def start_helper(module: str, args: list[str], env: dict[str, str], fds: dict[int, int]) -> WarmHelper | None:
    """`python -m module args...` with `env`, holding `fds` (its descriptor number → this process's)
    besides stdin on /dev/null and this process's stdout and stderr; None where it must be exec'd."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        started = _request(module, args, env, {0: devnull, 1: 1, 2: 2, **fds})
    finally:
        os.close(devnull)
    return WarmHelper(*started) if started else None


async def start_async_helper(module: str, args: list[str], env: dict[str, str]) -> AsyncWarmHelper | None:
    """`python -m module args...` with `env`, pipes on its stdin and stdout and this process's stderr,
    as asyncio.create_subprocess_exec(..., stdin=PIPE, stdout=PIPE) gives it; None where it must be exec'd."""
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    try:
        started = await asyncio.to_thread(_request, module, args, env, {0: stdin_read, 1: stdout_write, 2: 2})
    finally:
        os.close(stdin_read)
        os.close(stdout_write)
    if started is None:
        os.close(stdin_write)
        os.close(stdout_read)
        return None
    loop = asyncio.get_running_loop()
    stdout = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(stdout_read, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(stdin_write, "wb", 0)
    )
    return AsyncWarmHelper(*started, asyncio.StreamWriter(transport, protocol, None, loop), stdout)
