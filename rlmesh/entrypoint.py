"""The common start of every service process: parse `--config`, load and validate the typed
config, set up logging, then run the service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from pydantic import BaseModel

from rlmesh.config import ConfigError, load_config
from rlmesh.lifecycle import name_process
from rlmesh.logging import configure_logging
from rlmesh.rpc.channels import use_server_identity
from rlmesh.rpc.servers import stop_event_on_signals

ConfigT = TypeVar("ConfigT", bound=BaseModel)


def config_file_variable(name: str) -> str:
    """The environment variable naming a service's config file when `--config` is not given: how
    `rlmesh up` hands each service the settings its job sets."""
    return f"RLMESH_CONFIG_FILE_{name.upper()}"


def service_process_name(name: str) -> str:
    """What /proc/<pid>/comm says of a service's process: how the launcher's tools find it."""
    return f"rlmesh-{name}"


class Running(Protocol):
    async def stop(self) -> None: ...


def until_signal(start: Callable[[ConfigT], Awaitable[Running]]) -> Callable[[ConfigT], Awaitable[None]]:
    """A `serve` that starts the service, then stops it gracefully on SIGTERM or SIGINT."""

    async def serve(config: ConfigT) -> None:
        stop = stop_event_on_signals()
        running = await start(config)
        # A service may also ask to stop by itself (a rollout instance told it is being preempted).
        asked = getattr(running, "stop_requested", None)
        waits = [asyncio.ensure_future(stop.wait())] + ([asyncio.ensure_future(asked.wait())] if asked else [])
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
            await running.stop()

    return serve


def run_service(
    name: str,
    config_model: type[ConfigT],
    serve: Callable[[ConfigT], Awaitable[None]],
    argv: list[str] | None = None,
) -> int:
    name_process(service_process_name(name))
    env_prefix = f"RLMESH_{name.upper()}_"
    parser = argparse.ArgumentParser(
        prog=f"rlmesh {name}",
        description=f"Run the rlmesh {name} service. Settings come from --config (TOML), then "
        f"{env_prefix}SECTION__FIELD environment variables.",
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(config_file_variable(name)),
        help=f"TOML file with this service's settings (default: ${config_file_variable(name)})",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(config_model, args.config, env_prefix=env_prefix)
        # Every call this process makes carries the service's own certificate and bearer secret.
        use_server_identity(config.server)  # type: ignore[attr-defined]
    except ConfigError as exc:
        print(f"rlmesh {name}: {exc}", file=sys.stderr)
        return 2
    configure_logging(getattr(getattr(config, "server", None), "log_level", "info"), service=name)
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:
        print(f"rlmesh {name}: {exc}", file=sys.stderr)
        return 2
    except (TimeoutError, OSError, FileNotFoundError) as exc:
        print(f"rlmesh {name}: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
