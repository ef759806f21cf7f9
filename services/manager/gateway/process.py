"""Runs the manager's OpenAI gateway in a process of its own: binds its port here (so a port in use
fails the manager's start and port 0 gets a free one), hands the socket to the process (forked by
the warm fork server where one serves this process, else exec'd), starts it again when it dies, and
stops it with the manager."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
import subprocess
import sys

import structlog

from rlmesh.forking.helpers import WarmHelper, start_helper
from services.manager.config import ManagerConfig

log = structlog.get_logger()

MODULE = "services.manager.gateway.main"
CONFIG_VARIABLE = "RLMESH_MANAGER_GATEWAY_CONFIG"
"""The manager's config as JSON, handed to the gateway process."""
LISTEN_FD = 3
"""The listening socket's descriptor in a forked gateway process."""
BIND_SECONDS = 10.0
READY_SECONDS = 120.0
"""How long a starting gateway process has to answer its health check (it loads the tokenizer)."""
RESTART_SECONDS = (1.0, 30.0)
"""The wait before starting a dead gateway again: the first, doubled after each quick death, up to the second."""


async def bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket. The port may still be held for a moment by the gateway of a
    manager that was killed (its keeper ends it, and it closes its socket as it stops)."""
    deadline = asyncio.get_running_loop().time() + BIND_SECONDS
    while True:
        listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listening.bind((host, port))
        except OSError as exc:
            listening.close()
            if exc.errno != errno.EADDRINUSE or asyncio.get_running_loop().time() > deadline:
                raise OSError(exc.errno, f"the OpenAI gateway cannot listen on {host}:{port}: {exc.strerror}") from exc
            await asyncio.sleep(0.1)
            continue
        listening.listen(2048)
        return listening


def tls_client_context(ca_file: str) -> ssl.SSLContext:
    # The gateway's own process, reached at the address it was handed: its certificate must be the
    # mesh CA's, whatever host name it was issued for.
    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = False
    return context


class GatewayProcess:
    """The gateway's process, its listening socket and the task that starts it again."""

    def __init__(self, config: ManagerConfig, manager_address: str, listening: socket.socket) -> None:
        self.config = config
        self.manager_address = manager_address
        self.listening = listening
        host, port = listening.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._client_tls = tls_client_context(config.server.tls.ca_file) if config.server.tls else None
        """How the health check reaches a gateway serving HTTPS (the mesh's TLS): its CA's certificates only."""
        self.scheme = "https" if self._client_tls else "http"
        self.process: asyncio.subprocess.Process | WarmHelper | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    async def start(cls, config: ManagerConfig, manager_address: str, listening: socket.socket) -> GatewayProcess:
        """The gateway's process serving on `listening` (from `bind`, taken before the manager serves,
        so that a port in use stops the manager before anything reaches it)."""
        if not config.model_dir:
            listening.close()
            raise ValueError(
                "gateway_port is set but model_dir is not: the gateway renders messages with the model's tokenizer"
            )
        gateway = cls(config, manager_address, listening)
        try:
            await gateway._spawn()
        except BaseException:
            await gateway.stop()
            raise
        gateway._watch = asyncio.create_task(gateway._keep_running(), name="gateway-process")
        log.info(
            "gateway listening",
            address=gateway.address,
            pid=gateway.process.pid,
            base_url=f"{gateway.scheme}://{gateway.address}/sessions/<session id>/v1",
        )
        return gateway

    async def _spawn(self) -> None:
        """Starts the process and waits until it answers its health check."""
        fd = self.listening.fileno()
        env = {**os.environ, CONFIG_VARIABLE: self.config.model_dump_json()}

        def args(listen_fd: int) -> list[str]:
            return [
                "--listen-fd",
                str(listen_fd),
                "--manager-address",
                self.manager_address,
                "--parent-pid",
                str(os.getpid()),
            ]

        # A forked one skips the imports (uvicorn, transformers, torch) that cost an exec'd one 4 to 5 CPU-seconds.
        self.process = await asyncio.to_thread(
            start_helper, MODULE, args(LISTEN_FD), env, {LISTEN_FD: fd}
        ) or await asyncio.create_subprocess_exec(sys.executable, "-m", MODULE, *args(fd), pass_fds=(fd,), env=env)
        deadline = asyncio.get_running_loop().time() + READY_SECONDS
        while not await self.healthy():
            if self.process.returncode is not None:
                raise RuntimeError(
                    f"the gateway process exited with {self.process.returncode} before serving (its log says why)"
                )
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the gateway process did not answer on {self.address} within {READY_SECONDS:.0f} s")
            await asyncio.sleep(0.1)

    async def healthy(self) -> bool:
        host, port = self.address.rsplit(":", 1)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=self._client_tls), 1.0)
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(f"GET /healthz HTTP/1.1\r\nHost: {self.address}\r\nConnection: close\r\n\r\n".encode())
            status = await asyncio.wait_for(reader.readline(), 1.0)
            return status.split(b" ")[1:2] == [b"200"]
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    async def _keep_running(self) -> None:
        wait = RESTART_SECONDS[0]
        while True:
            started = asyncio.get_running_loop().time()
            code = await self._exited()
            if self._stopping:
                return
            log.error("the gateway process died; starting it again", returncode=code, after_seconds=wait)
            if asyncio.get_running_loop().time() - started > 60:
                wait = RESTART_SECONDS[0]
            await asyncio.sleep(wait)
            wait = min(2 * wait, RESTART_SECONDS[1])
            try:
                await self._spawn()
                log.info("gateway process started again", pid=self.process.pid)
            except RuntimeError as exc:
                log.error("the gateway process did not start", error=str(exc))

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await self._exited(10.0)
            except TimeoutError:
                self.process.kill()
                await self._exited()
        self.listening.close()

    async def _exited(self, timeout: float | None = None) -> int:
        """The process's exit code once it ends; TimeoutError past `timeout`."""
        if isinstance(self.process, WarmHelper):
            try:
                return await asyncio.to_thread(self.process.wait, timeout)
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError from exc
        return await asyncio.wait_for(self.process.wait(), timeout)
