"""The episode driver in a process of its own (`episode_driver = "process"`), started by rank 0: the
episodes' turns, the environments' code and their event loop run under their own interpreter lock,
so the Python of a training step never holds them up. Rank 0 opens each batch's sessions and hands
them over; the process reports what must stop the job, and dies with rank 0."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.config import TrainerConfig
from services.trainer.episodes.driver import EpisodeDriver, TooManyEpisodeErrors, open_sessions
from services.trainer.episodes.spec import EpisodeSpec, episode_specs
from services.trainer.mesh import MeshClient
from services.trainer.ranks.child_process import ChildProcess, end_child, frame, how_it_ended, next_frame, start_child

log = structlog.get_logger()

CLOSE_SECONDS = 15.0
"""How long a closing episode process may take to cancel its episodes and exit before it is killed."""


class EpisodeProcessError(RuntimeError):
    """The episode process did not start, or is gone."""


class EpisodeProcess:
    """Rank 0's handle on the episode process, used as the trainer uses an EpisodeDriver."""

    def __init__(
        self, process: ChildProcess, mesh: MeshClient, on_failure: Callable[[BaseException], Awaitable[None]]
    ) -> None:
        self.process = process
        self.mesh = mesh
        self.on_failure = on_failure
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = False
        self.failure: BaseException | None = None
        self._reader = asyncio.create_task(self._read(), name="episode process reports")

    @classmethod
    async def start(
        cls,
        config: TrainerConfig,
        mesh: MeshClient,
        stop_ids: list[int],
        context_length: int,
        on_failure: Callable[[BaseException], Awaitable[None]],
    ) -> EpisodeProcess:
        """Starts the process and waits until it has built the job's multi-turn tasks."""
        process = await start_child("services.trainer.episodes.process", "--parent-pid", str(os.getpid()))
        episodes = cls(process, mesh, on_failure)
        try:
            episodes._send(("build", config.model_dump_json(), stop_ids, context_length))
            await asyncio.wait_for(asyncio.shield(episodes._ready), config.startup_timeout_seconds)
        except TimeoutError:
            await episodes.close()
            raise EpisodeProcessError(
                f"the episode process (pid {process.pid}) did not build the job's multi-turn tasks within "
                f"startup_timeout_seconds ({config.startup_timeout_seconds:g})"
            ) from None
        except BaseException:
            await episodes.close()
            raise
        log.info("episode process ready", pid=process.pid)
        return episodes

    async def open(
        self,
        spec: EpisodeSpec,
        batch_id: str,
        version: int,
        prompts: list[tuple[str, list[int], common_pb2.SamplingParams]],
        n: int,
        task_prompts: Mapping[str, TaskPrompt],
        counted: bool = True,
    ) -> None:
        """Opens `n` sessions per prompt here and has the process run their episodes."""
        if self.failure is not None:
            raise self.failure
        handles = await open_sessions(self.mesh, spec, batch_id, version, prompts, n)
        ids = {handle.prompt_id for handle in handles}
        self._send(
            (
                "start",
                spec.task,
                [handle.SerializeToString() for handle in handles],
                {pid: prompt for pid, prompt in task_prompts.items() if pid in ids},
                counted,
            )
        )

    def _send(self, message: Any) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        if not stdin.is_closing():
            stdin.write(frame(message))

    async def close(self) -> None:
        """Closes its stdin, which cancels its episodes and ends it; kills it if it does not exit in time."""
        self._closing = True
        await end_child(self.process, CLOSE_SECONDS)
        await self._reader

    async def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        while (message := await next_frame(stdout)) is not None:
            kind, *values = message
            if kind == "ready":
                self._ready.set_result(None)
            elif kind == "failure" and self.failure is None:
                name, reason = values
                self.failure = (
                    TooManyEpisodeErrors(reason)
                    if name == TooManyEpisodeErrors.__name__
                    else EpisodeProcessError(f"the episode process failed: {name}: {reason}")
                )
                await self.on_failure(self.failure)
        code = await self.process.wait()
        if self._closing:
            return
        ending = how_it_ended(code)
        failure = EpisodeProcessError(
            f"the episode process (pid {self.process.pid}) {ending}; its error, if any, is in the trainer's log"
        )
        if not self._ready.done():
            # Starting, not running: `start` raises it.
            self._ready.set_exception(failure)
            return
        if self.failure is None:
            self.failure = failure
            await self.on_failure(failure)


async def start_episodes(
    config: TrainerConfig,
    mesh: MeshClient,
    specs: Mapping[str, EpisodeSpec],
    context_length: int,
    on_failure: Callable[[BaseException], Awaitable[None]],
) -> EpisodeDriver | EpisodeProcess:
    """What runs the episodes of the job's multi-turn tasks, where `episode_driver` says."""
    if config.episode_driver == "process":
        stop_ids = next(iter(specs.values())).stop_ids
        return await EpisodeProcess.start(config, mesh, stop_ids, context_length, on_failure)
    return EpisodeDriver(mesh, max(s.config.threads for s in specs.values()), on_failure, config.gateway_address)


async def serve(requests: asyncio.StreamReader, replies: asyncio.WriteTransport) -> None:
    """The process's loop: builds the job's multi-turn tasks, then runs the episodes of each batch
    rank 0 hands over until its stdin closes."""
    from rlmesh.models.tokenizer import load_hf_tokenizer
    from rlmesh.rpc.channels import use_server_identity
    from rlmesh.tasks.build import TaskMixture, build_task

    _, config_json, stop_ids, context_length = await next_frame(requests)
    config = TrainerConfig.model_validate_json(config_json)
    use_server_identity(config.server)
    tokenizer = load_hf_tokenizer(config.model_dir)
    mixture = TaskMixture(
        [build_task(t, tokenizer, config.seed, config.python_path) for t in config.tasks], config.seed
    )
    specs = episode_specs(
        mixture, tokenizer, stop_ids, context_length, config.python_path[0] if config.python_path else ""
    )

    async def failed(exc: BaseException) -> None:
        replies.write(frame(("failure", type(exc).__name__, str(exc))))

    mesh = MeshClient(
        config.manager_address, config.weights_address, config.rpc_timeout_seconds, config.manager_outage_seconds
    )
    driver = EpisodeDriver(mesh, max(s.config.threads for s in specs.values()), failed, config.gateway_address)
    replies.write(frame(("ready",)))
    try:
        while (message := await next_frame(requests)) is not None:
            _, task, handles, prompts, counted = message
            driver.start(specs[task], [manager_pb2.SessionHandle.FromString(h) for h in handles], prompts, counted)
    finally:
        await driver.close()
        await mixture.close()


async def _main(parent_pid: int) -> None:
    from rlmesh.lifecycle import die_with_parent, parent_lives

    die_with_parent()
    if not parent_lives(parent_pid):  # rank 0 died before the request took effect
        return
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    # Reports travel on the original stdout; what environments print goes to stderr (the trainer's log).
    replies_pipe = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    replies, _ = await loop.connect_write_pipe(asyncio.Protocol, replies_pipe)
    await serve(requests, replies)


def main() -> None:
    parser = argparse.ArgumentParser(description="The trainer's episode driver (started by rank 0).")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    from rlmesh.logging import configure_logging

    configure_logging(service="trainer")
    structlog.contextvars.bind_contextvars(process="episodes")
    # Ctrl-C reaches the whole process group: the trainer decides, and this process ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_main(args.parent_pid))


if __name__ == "__main__":
    main()
