"""The warm fork server (`rlmesh fork-server`): one long-lived process that has imported what the
services import and, for each `rlmesh up` that connects to its Unix socket, forks that run's own
fork server, already warm, so a run starts its services without the 7 to 9 CPU-seconds of imports;
for each helper a process asks for (`rlmesh.forking.helpers`), a keeper that forks the helper."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

from rlmesh.forking.forkserver import FORK_SERVER_NAME, ServerSide, import_modules, read_line, run_as_main
from rlmesh.launch.processes import MESH_ID_ENV
from rlmesh.lifecycle import die_with_parent, kept_by, name_process

MARKER_ROOM = 4096
"""Bytes held for a run's MESH_ID_ENV in the warm server's environment block (below)."""
KEEPER_NAME = "rlmesh-keeper"
"""The /proc/<pid>/comm of the process that forks and watches one helper."""
MAX_HELPER_FDS = 16


def warm_environment(env: dict[str, str]) -> dict[str, str]:
    """The warm server's environment: as a run's fork server gets it (one OpenMP thread, unbuffered
    output), and MESH_ID_ENV holding room for the run's value."""
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", MESH_ID_ENV: "." * MARKER_ROOM}


def _show_in_proc_environ(name: str, value: str) -> str | None:
    """Rewrites `name`'s entry in the environment block /proc/<pid>/environ shows, which a fork
    inherits and `mesh_processes` reads to find a run's processes: the kernel shows the block this
    process was exec'd with, never os.environ. Says why not, if it cannot."""
    block = Path("/proc/self/environ").read_bytes()
    key = f"{name}=".encode()
    if block.startswith(key):
        offset = 0
    elif (found := block.find(b"\0" + key)) >= 0:
        offset = found + 1
    else:
        return f"its environment holds no room for {name} (start it with `rlmesh fork-server`)"
    room = block.index(b"\0", offset) - offset
    entry = key + value.encode()
    if len(entry) > room:
        return f"{name} ({len(value)} bytes) does not fit the {room - len(key)} bytes held for it"
    # Fields 50 and 51 of /proc/self/stat: where that block lies in this process's memory.
    env_start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[47])
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(env_start + offset)
        memory.write(entry.ljust(room, b"\0"))
    return None


def _read_hello(connection: socket.socket) -> tuple[dict, bytes, list[int]]:
    """The connection's first line, what came after it, and the descriptors sent with it."""
    data, fds, flags, _ = socket.recv_fds(connection, 65536, MAX_HELPER_FDS)
    if flags & socket.MSG_CTRUNC:
        raise ValueError(f"more than {MAX_HELPER_FDS} descriptors came with the request")
    line, rest = read_line(connection, data)
    return json.loads(line), rest, fds


def _adopt_environment(hello: dict) -> str | None:
    """The requester's working directory, environment and import path, as a process it started
    would have; says why not, if the run's marker does not fit."""
    os.chdir(hello["cwd"])
    env = hello["env"]
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = hello["cwd"]
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    if MESH_ID_ENV in env:
        return _show_in_proc_environ(MESH_ID_ENV, env[MESH_ID_ENV])
    return None


def _adopt(hello: dict) -> str | None:
    """In a run's server: the launcher's log, working directory, environment and import path, as a
    server it started would have; says why this server cannot serve the run, if it cannot."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(hello["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return _adopt_environment(hello)


def _serve_run(fd: int, hello: dict, pending: bytes, imported: set[str]) -> None:
    """Becomes the run's fork server on its connection; returns when the launcher closes it (or
    dies), its services getting SIGTERM as from a server it started."""
    os.setsid()
    refusal = _adopt(hello) or import_modules(hello["modules"], imported)
    if refusal:
        os.write(fd, (json.dumps({"refused": refusal}) + "\n").encode())
        return
    server = ServerSide(fd, fd)
    server.send({"ready": True, "pid": os.getpid()})
    server.serve(pending)


def _helper_refusal(hello: dict, fds: list[int]) -> str | None:
    """Why this server cannot fork the helper as the requester would start it, if it cannot."""
    if hello["executable"] != sys.executable:
        return f"the requester runs {hello['executable']}, this server {sys.executable}"
    if hello["netns"] != os.stat("/proc/self/ns/net").st_ino:
        return "the requester is in another network namespace"
    if len(fds) != len(hello["fds"]):
        return f"{len(fds)} descriptors came for {len(hello['fds'])}"
    return _adopt_environment(hello)


def _keep_helper(fd: int, hello: dict, fds: list[int], pending: bytes) -> None:
    """Forks the helper, says its pid, and relays the requester's signals to it until it exits (its
    exit code follows, as subprocess.Popen's returncode) or the requester's end closes (it gets SIGTERM)."""
    name_process(KEEPER_NAME)
    # Its own process group: a Ctrl-C meant for the warm server leaves the helpers to their requesters.
    os.setpgid(0, 0)
    if refusal := _helper_refusal(hello, fds):
        os.write(fd, (json.dumps({"refused": refusal}) + "\n").encode())
        return
    keeper = os.getpid()
    helper = os.fork()
    if helper == 0:
        run_as_main(lambda: _become_helper(hello, dict(zip(hello["fds"], fds)), keeper), hello["helper"], hello["args"])
    for received in fds:
        os.close(received)
    os.write(fd, (json.dumps({"pid": helper}) + "\n").encode())
    exited = os.pidfd_open(helper)
    while True:
        ready, _, _ = select.select([fd, exited], [], [])
        if exited in ready:
            _, status = os.waitpid(helper, 0)
            os.write(fd, (json.dumps({"exited": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            return
        chunk = os.read(fd, 4096)
        if not chunk:
            os.kill(helper, signal.SIGTERM)
            os.waitpid(helper, 0)
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            # Not reaped yet, so the pid is still the helper's.
            os.kill(helper, json.loads(line)["signal"])


def _become_helper(hello: dict, targets: dict[int, int], keeper: int) -> None:
    """In the helper: dies with its keeper, holds only the descriptors sent (at their target
    numbers), and is named after its module."""
    die_with_parent()
    kept_by(keeper)
    # Moved above every target first, so that no dup2 overwrites a descriptor still to be placed.
    above = max(targets, default=2) + 1
    moved = {target: fcntl.fcntl(received, fcntl.F_DUPFD, above) for target, received in targets.items()}
    for received in targets.values():
        os.close(received)
    for target, received in moved.items():
        os.dup2(received, target)
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in targets:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor, closed already
    module = hello["helper"]
    name_process(module.rsplit(".", 1)[-1])
    # Run afresh as __main__, as `python -m` runs it, though this server imported it by its name.
    if not hasattr(sys.modules.get(module), "__path__"):
        sys.modules.pop(module, None)


def _serve_connection(connection: socket.socket, imported: set[str]) -> None:
    """In the child forked for one connection: a helper's keeper, or a run's fork server."""
    code = 0
    try:
        hello, pending, fds = _read_hello(connection)
        fd = connection.detach()
        if "helper" in hello:
            _keep_helper(fd, hello, fds, pending)
        else:
            _serve_run(fd, hello, pending, imported)
    except BaseException as exc:
        print(f"rlmesh fork-server: a connection's process failed: {exc!r}", file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


def _listen(path: Path) -> socket.socket:
    """The socket at `path`, replacing a stale one; SystemExit if a server answers there already, or
    something other than a socket is there."""
    if path.exists() and not path.is_socket():
        raise SystemExit(f"rlmesh fork-server: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        path.unlink(missing_ok=True)
    else:
        raise SystemExit(f"rlmesh fork-server: a fork server already listens on {path}")
    finally:
        probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def serve_warm(path: Path, modules: list[str]) -> None:
    """Listens at `path` at once (a run that connects meanwhile waits), imports `modules`, then forks
    a server for each connection until SIGTERM or SIGINT."""
    name_process(FORK_SERVER_NAME)
    listener = _listen(path)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    try:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        imported: set[str] = set()
        if refusal := import_modules(modules, imported):
            raise SystemExit(f"rlmesh fork-server: {refusal}")
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_write)
        print(
            f"rlmesh fork-server: ready on {path}; point `rlmesh up --fork-server` (or RLMESH_FORK_SERVER) at it",
            file=sys.stderr,
            flush=True,
        )
        while True:
            ready, _, _ = select.select([listener, wake_read], [], [])
            if wake_read in ready:
                os.read(wake_read, 4096)
                _reap_all()
            if listener in ready:
                connection, _ = listener.accept()
                if os.fork() == 0:
                    signal.set_wakeup_fd(-1)
                    for handled in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                        signal.signal(handled, signal.SIG_DFL)
                    listener.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    _serve_connection(connection, set(imported))
                connection.close()
    except KeyboardInterrupt:
        pass
    finally:
        path.unlink(missing_ok=True)


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    from rlmesh.launch.starter import warm_modules

    parser = argparse.ArgumentParser(prog="python -m rlmesh.forking.warm_forkserver")
    parser.add_argument("--socket", required=True, type=Path)
    args = parser.parse_args()
    code = 0
    try:
        serve_warm(args.socket.resolve(), warm_modules())
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr, flush=True)
            code = 1
    # Its runs' servers live on without it; tearing down what it imported would take seconds.
    os._exit(code)


if __name__ == "__main__":
    main()
