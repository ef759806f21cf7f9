"""Serves the gateway's app with uvicorn inside the manager's event loop, beside its gRPC server, so a
turn goes from HTTP to the session's state without another hop."""

from __future__ import annotations

import asyncio
import socket

import structlog
import uvicorn

from rlmesh.models.tokenizer import load_hf_tokenizer
from services.manager.config import ManagerConfig
from services.manager.gateway import Gateway, create_app
from services.manager.turns import TurnRunner

log = structlog.get_logger()


class GatewayServer:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], address: str) -> None:
        self.server, self.task, self.address = server, task, address

    @classmethod
    async def start(cls, config: ManagerConfig, runner: TurnRunner) -> GatewayServer:
        if not config.model_dir:
            raise ValueError("gateway_port is set but model_dir is not: the gateway renders messages with the model's tokenizer")
        tokenizer = load_hf_tokenizer(config.model_dir)
        app = create_app(Gateway(runner, tokenizer, model_name=config.model_dir.rstrip("/").rsplit("/", 1)[-1]))
        host = config.server.host
        # Bound here, so a port in use fails the start with its error and port 0 gets a free one.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, config.gateway_port))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        task = asyncio.create_task(server.serve(sockets=[sock]), name="gateway")
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
        address = f"{host}:{sock.getsockname()[1]}"
        log.info("gateway listening", address=address, base_url=f"http://{address}/sessions/<session id>/v1")
        return cls(server, task, address)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task
