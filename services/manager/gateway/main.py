"""The manager's OpenAI gateway as a process of its own, started and watched by the manager: serves
the HTTP app on the socket the manager bound and runs turns through the manager's session contract,
so HTTP parsing and chat rendering never hold up the manager's event loop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys

# Imported with the module, not at the tokenizer's load: a warm fork server pays for it once.
import transformers.models.auto.tokenization_auto  # noqa: F401
import uvicorn
import uvloop

from rlmesh.lifecycle import die_with_parent, name_process, parent_lives
from rlmesh.logging import configure_logging
from rlmesh.manager.v1 import manager_pb2_grpc
from rlmesh.models.tokenizer import load_hf_tokenizer
from rlmesh.rpc.channels import open_channel, use_server_identity
from services.manager.config import ManagerConfig
from services.manager.gateway.app import Gateway, create_app
from services.manager.gateway.process import CONFIG_VARIABLE
from services.manager.gateway.sessions import GatewaySessions

PROCESS_NAME = "rlmesh-gateway"
SHUTDOWN_SECONDS = 5.0
"""How long a stopping gateway lets its open requests finish."""


async def serve(config: ManagerConfig, listening: socket.socket, manager_address: str) -> None:
    channel = open_channel(manager_address)
    await asyncio.wait_for(channel.channel_ready(), config.rpc_timeout_seconds)
    tokenizer = load_hf_tokenizer(config.model_dir)
    sessions = GatewaySessions(
        manager_pb2_grpc.ManagerServiceStub(channel),
        tokenizer,
        config.gateway_turn_timeout_seconds,
        config.rpc_timeout_seconds,
    )
    app = create_app(Gateway(sessions, tokenizer, model_name=config.model_dir.rstrip("/").rsplit("/", 1)[-1]))
    # With the mesh's TLS on, HTTPS with the manager's certificate; harnesses hold no client
    # certificate (their session's key is their credential), so none is asked for.
    tls = config.server.tls
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http="httptools",
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_SECONDS,
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
        )
    )
    # What was made up to here (the imports of transformers and torch: 240,000 objects) lives as long
    # as the process: left to the collector, each full collection scans it all again, 90 ms during
    # which no request moves.
    gc.freeze()
    following = asyncio.create_task(sessions.follow(), name="follow-sessions")
    try:
        await server.serve(sockets=[listening])
    finally:
        following.cancel()
        await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="The manager's OpenAI gateway (started by the manager).")
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket the manager bound")
    parser.add_argument("--manager-address", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    name_process(PROCESS_NAME)
    # Killed outright with the manager: it holds nothing worth a graceful end, and a manager started
    # again binds the same port at once.
    die_with_parent(signal.SIGKILL)
    if not parent_lives(args.parent_pid):  # the manager died before the kernel's watch took effect
        sys.exit(0)
    config = ManagerConfig.model_validate_json(os.environ[CONFIG_VARIABLE])
    configure_logging(config.server.log_level, service="manager-gateway")
    # Its calls carry the manager's own certificate and bearer secret: it is part of the manager service.
    use_server_identity(config.server)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(config, socket.socket(fileno=args.listen_fd), args.manager_address))


if __name__ == "__main__":
    main()
