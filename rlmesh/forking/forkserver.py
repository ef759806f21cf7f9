"""A fork server for the mesh's services: one process imports what they import (torch,
transformers, FSDP, gRPC) once, then forks each service start and restart from that state, which
would otherwise pay 1 to 6 CPU-seconds of imports in every process. The launcher starts its own, or
attaches to a run's server forked by a warm one (`rlmesh.forking.warm_forkserver`)."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from rlmesh.launch.netns import enter_netns
from rlmesh.lifecycle import die_with_parent, name_process, parent_lives

FORK_SERVER_NAME = "rlmesh-forksrv"
"""The server's /proc/<pid>/comm; a service it forks takes its own name when it starts."""
READY_TIMEOUT_SECONDS = 300.0
REPLY_TIMEOUT_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0


class ForkServerError(RuntimeError):
    """The fork server could not start or answer."""


class ServerSide:
    """The server's side: requests arrive as JSON lines on the `requests` descriptor (stdin, or the
    warm server's connection), answers and exits leave as JSON lines on the control descriptor;
    SIGCHLD wakes the loop through a pipe."""

    def __init__(self, control: int, requests: int = 0) -> None:
        self._control = control
        self._requests = requests
        self._initial_env = dict(os.environ)
        self._children: set[int] = set()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_write)

    def send(self, message: dict) -> None:
        os.write(self._control, (json.dumps(message) + "\n").encode())

    def _reap(self) -> None:
        for pid in list(self._children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._children.discard(pid)
                # As subprocess.Popen.returncode: the exit code, or minus the signal that killed it.
                self.send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def _spawn(self, request: dict) -> None:
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_service(request, server)
        self._children.add(pid)
        self.send({"pid": pid})

    def _signal(self, request: dict) -> None:
        # Only a child not yet reaped: its pid cannot have been reused by another process.
        pid = request["pid"]
        alive = pid in self._children
        if alive:
            os.kill(pid, request["signal"])
        self.send({"sent": alive})

    def _become_service(self, request: dict, server: int) -> NoReturn:
        """In the child: its own session, network namespace, environment and log, then `python -m module`."""
        run_as_main(lambda: self._prepare_service(request, server), request["module"], request["args"])

    def _prepare_service(self, request: dict, server: int) -> None:
        os.setsid()
        die_with_parent()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if not parent_lives(server):
            # The server died between the fork and the kernel's watch, so no SIGTERM will come:
            # end as that SIGTERM would have ended it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        # Standard input (the requests of a server the launcher started) is replaced below.
        for fd in {self._wake_read, self._wake_write, self._control, self._requests} - {0}:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        if request.get("netns"):
            enter_netns(request["netns"])
        env = request["env"]
        # What the launcher removed from its environment since the server started is removed;
        # what an import set (a library's defaults) stays, as it would in a fresh process.
        for name in self._initial_env.keys() - env.keys():
            os.environ.pop(name, None)
        os.environ.update(env)

    def serve(self, pending: bytes = b"") -> None:
        """Until the requests' end of file; `pending`: what was read of them already."""
        while True:
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if request["op"] == "spawn":
                    self._spawn(request)
                else:
                    self._signal(request)
            ready, _, _ = select.select([self._requests, self._wake_read], [], [])
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            self._reap()
            if self._requests in ready:
                chunk = os.read(self._requests, 65536)
                if not chunk:
                    return
                pending += chunk


def run_as_main(prepare: Callable[[], None], module: str, args: list[str]) -> NoReturn:
    """In a forked child: `prepare()`, then `python -m module args...` run as `__main__`; exits as that
    process would (SystemExit's code, 1 after an uncaught error, else 0) once its output is flushed."""
    code = 1
    try:
        prepare()
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def read_line(connection: socket.socket, received: bytes = b"") -> tuple[bytes, bytes]:
    """The first line on `connection` (`received`: what was read of it already) and what came after it."""
    while b"\n" not in received:
        chunk = connection.recv(65536)
        if not chunk:
            raise EOFError("the other end closed the connection before a whole line came")
        received += chunk
    line, rest = received.split(b"\n", 1)
    return line, rest


def import_modules(modules: list[str], imported: set[str]) -> str | None:
    """Imports those of `modules` (a package's `__main__` for what it imports) not in `imported`,
    adding them to it; says why forking is unsafe after, if it is."""
    for module in modules:
        if module in imported:
            continue
        importlib.import_module(module)
        imported.add(module)
        if module.endswith(".__main__"):
            # Imported for what it imports; a service's start runs it afresh as __main__ (runpy
            # warns of one found already imported).
            del sys.modules[module]
    threads = len(os.listdir("/proc/self/task"))
    return f"the imports started {threads - 1} threads; forking is unsafe" if threads != 1 else None


def serve(modules: list[str]) -> None:
    """Imports `modules`, says whether forking is safe (no thread started), then serves."""
    control = os.dup(1)
    os.dup2(2, 1)
    name_process(FORK_SERVER_NAME)
    if refusal := import_modules(modules, set()):
        os.write(control, (json.dumps({"refused": refusal}) + "\n").encode())
        return
    server = ServerSide(control)
    server.send({"ready": True})
    server.serve()
    # Its services are stopped by now; tearing down what it imported would take seconds.
    os._exit(0)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ForkServer:
    """The launcher's side: starts the server process (or, given `warm_socket`, has the warm fork
    server listening there fork one for it), asks it for services and relays their exits. A reader
    thread takes the server's lines; spawns and signals are one request at a time."""

    def __init__(
        self, modules: list[str], env: dict[str, str], log_path: Path, warm_socket: Path | None = None
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        if warm_socket is None:
            with log_path.open("ab") as log:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "rlmesh.forking.forkserver", *modules],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            self._pid: int | None = self._process.pid
            self._outgoing, self._incoming = self._process.stdin, self._process.stdout
        else:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._socket.settimeout(CONNECT_TIMEOUT_SECONDS)
                self._socket.connect(str(warm_socket))
                self._socket.settimeout(None)
            except OSError as exc:
                self._socket.close()
                raise ForkServerError(f"no warm fork server answers at {warm_socket}: {exc.strerror or exc}") from None
            self._pid = None
            self._outgoing, self._incoming = self._socket.makefile("wb"), self._socket.makefile("rb")
            hello = {"modules": modules, "env": env, "log": str(log_path), "cwd": os.getcwd()}
            self._outgoing.write((json.dumps(hello) + "\n").encode())
            self._outgoing.flush()
        self.log_path = log_path
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._ready: bool | str | None = None
        self._replies: list[dict] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._incoming:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                elif "ready" in message:
                    self._pid = message.get("pid", self._pid)
                    self._ready = True
                elif "refused" in message:
                    self._ready = message["refused"]
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            # Once the server has ended, `_ready` says why it can fork no more.
            if not isinstance(self._ready, str):
                ended = f"it exited with code {self._process.wait()}" if self._process else "it closed the connection"
                self._ready = f"{ended}; see {self.log_path}"
            self._changed.notify_all()

    @property
    def pid(self) -> int | None:
        """The server process's (one forked by a warm server: known once it is ready)."""
        return self._pid

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready is not None, timeout):
                raise ForkServerError(f"the fork server did not import its modules within {timeout:.0f} s")
            if self._ready is not True:
                raise ForkServerError(f"the fork server cannot fork services: {self._ready}")

    def _request(self, request: dict) -> dict:
        with self._lock:
            self.wait_ready()
            self._outgoing.write((json.dumps(request) + "\n").encode())
            self._outgoing.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._replies or self._ready is not True, REPLY_TIMEOUT_SECONDS):
                    raise ForkServerError("the fork server did not answer")
                if not self._replies:
                    raise ForkServerError(f"the fork server stopped: {self._ready}")
                return self._replies.pop(0)

    def spawn(
        self, module: str, args: list[str], env: dict[str, str], log_path: Path, netns: str | None = None
    ) -> ForkedProcess:
        """Forks `python -m module args...` with `env` as its environment and its output in `log_path`,
        in the network namespace `netns` when given."""
        reply = self._request(
            {"op": "spawn", "module": module, "args": args, "env": env, "log": str(log_path), "netns": netns}
        )
        return ForkedProcess(self, reply["pid"])

    def exit_code(self, pid: int, timeout: float | None = 0) -> int | None:
        """The service's exit code once it has exited. After the server itself ended (the kernel
        then sent its services SIGTERM), a service found gone reads as ended by SIGTERM."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._ready not in (None, True), timeout)
            if pid in self._exits or self._ready is True:
                return self._exits.get(pid)
        deadline = None if timeout is None else time.monotonic() + timeout
        while process_alive(pid):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        return -signal.SIGTERM

    def signal(self, pid: int, sig: int) -> None:
        with self._changed:
            server_ended = self._ready not in (None, True)
        if server_ended:
            if process_alive(pid):
                os.kill(pid, sig)
            return
        self._request({"op": "signal", "pid": pid, "signal": int(sig)})

    def close(self) -> None:
        """Ends the server once its services have been stopped (any left get SIGTERM from the kernel)."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.stdin.close()
                try:
                    self._process.wait(10)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._reader.join(10)
            return
        # The end of the requests ends the server; its end of the connection closing ends the reader.
        try:
            self._outgoing.close()
            self._socket.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._reader.join(10)
        if self._reader.is_alive() and self._pid is not None and process_alive(self._pid):
            os.kill(self._pid, signal.SIGKILL)
            self._reader.join(10)
        self._socket.close()


class ForkedProcess:
    """A service forked by the server, behind subprocess.Popen's interface (`processes.Process`)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._server.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1:])
