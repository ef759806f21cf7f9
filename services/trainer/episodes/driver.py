"""The episode driver: runs a batch's multi-turn episodes (in the episode process, or in rank 0), each
one session at the manager: the environment's reset, then turn after turn (the model's, then the
environment's step) until the environment is done or a limit or deadline ends it; or an agent
command, or a verifiers environment, against the session's gateway URL. At most a task's
`max_concurrent` episodes run at once; a session's deadlines start with its episode. An environment
that raises, hangs or returns garbage, or a call of the episode's that fails, ends its episode as
an error, which is counted and masked, never scored."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import structlog

from rlmesh.chat.turns import RenderError
from rlmesh.common.v1 import common_pb2
from rlmesh.environments.base import EnvironmentFailure
from rlmesh.environments.verifiers_adapter import VerifiersEpisodes, load_verifiers
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from services.trainer.episodes.agents import run_agent
from services.trainer.episodes.environment_threads import EnvironmentThreads
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.episodes.steps import run_steps
from services.trainer.episodes.verifiers_environment import run_verifiers
from services.trainer.mesh import MeshClient

log = structlog.get_logger()

OPEN = manager_pb2.SESSION_STATUS_OPEN
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
FAILED = frozenset({DEADLINE, ENVIRONMENT_ERROR})
"""Episodes that end this way are masked out of their group and count towards the error rate."""


class TooManyEpisodeErrors(RuntimeError):
    """More episodes failed than the task's environment allows: the job stops."""


class EpisodeErrors:
    """The outcome of a task's last `window` episodes: the job stops once the share that failed
    (environment error or deadline) passes `max_rate`, with the last failure's reason."""

    def __init__(self, task: str, max_rate: float, window: int) -> None:
        self.task, self.max_rate = task, max_rate
        self.outcomes: deque[bool] = deque(maxlen=window)
        self.last_reason = ""

    def record(self, failed: bool, reason: str = "") -> None:
        self.outcomes.append(failed)
        if failed:
            self.last_reason = reason
        if len(self.outcomes) == self.outcomes.maxlen and sum(self.outcomes) / len(self.outcomes) > self.max_rate:
            raise TooManyEpisodeErrors(
                f"task {self.task!r}: {sum(self.outcomes)} of the last {len(self.outcomes)} episodes failed "
                f"(environment error or deadline), above environment.max_error_rate ({self.max_rate:g}); the last: "
                f"{self.last_reason}"
            )


async def open_sessions(
    mesh: MeshClient,
    spec: EpisodeSpec,
    batch_id: str,
    version: int,
    prompts: list[tuple[str, list[int], common_pb2.SamplingParams]],
    n: int,
) -> list[manager_pb2.SessionHandle]:
    """`n` sessions per prompt at the manager, as one batch; each starts empty (its environment's
    reset gives its first messages)."""
    return await mesh.open_sessions(
        batch_id,
        version,
        [(pid, [], sampling) for pid, _, sampling in prompts],
        n,
        prompts[0][2],
        spec.limits(),
        spec.task,
    )


class EpisodeDriver:
    """Runs episodes in this process's event loop. Episodes wait on the manager's turns
    almost all their time, so hundreds run at once as asyncio tasks (a task's `max_concurrent` at
    most; the others wait for a place); the user's sync environment code runs on threads of its own
    (EnvironmentThreads), async code on the loop under a deadline."""

    def __init__(
        self,
        mesh: MeshClient,
        threads: int,
        on_failure: Callable[[BaseException], Awaitable[None]],
        gateway_address: str = "",
    ) -> None:
        self.mesh = mesh
        self.gateway_address = gateway_address
        """The manager's OpenAI gateway, where agent commands are pointed."""
        self.on_failure = on_failure
        self.threads = EnvironmentThreads(threads)
        self.places: dict[str, asyncio.Semaphore] = {}
        """By task: its places for episodes running at once (environment.max_concurrent)."""
        self.errors: dict[str, EpisodeErrors] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        """Set when the job must stop (too many failed episodes, a manager that cannot be reached)."""
        self.verifiers: dict[str, VerifiersEpisodes] = {}
        """By task: its verifiers environment, serving from its first episode on."""

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
        """Opens `n` sessions per prompt and runs their episodes."""
        self.start(spec, await open_sessions(self.mesh, spec, batch_id, version, prompts, n), task_prompts, counted)

    def start(
        self,
        spec: EpisodeSpec,
        handles: list[manager_pb2.SessionHandle],
        prompts: Mapping[str, TaskPrompt],
        counted: bool = True,
    ) -> None:
        """Runs the episodes of a batch's sessions in the background. `counted`: their failures count
        towards the task's error rate (training episodes; held-out ones are only reported)."""
        for handle in handles:
            task = asyncio.create_task(
                self._guarded(spec, handle, prompts[handle.prompt_id], counted), name=f"episode {handle.session_id}"
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _guarded(
        self, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt, counted: bool
    ) -> None:
        try:
            status, reason = await self.run_episode(spec, handle, prompt)
            if not counted or status == manager_pb2.SESSION_STATUS_UNSPECIFIED:
                return
            errors = self.errors.setdefault(
                spec.task, EpisodeErrors(spec.task, spec.config.max_error_rate, spec.config.error_window)
            )
            errors.record(status in FAILED, reason)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop, which stops the job
            if self.failure is None:
                self.failure = exc
                await self.on_failure(exc)

    async def call(self, method: Callable[..., Any], argument: Any, deadline: float) -> Any:
        """The environment's method under its deadline: sync on a thread, async on the loop."""
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(argument), deadline)
        result = await self.threads.call(method, argument, deadline=deadline)
        return await result if inspect.isawaitable(result) else result

    async def run_episode(
        self, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt
    ) -> tuple[int, str]:
        """One episode to its end, once the task has a place for it; returns the status its session
        was closed with and why."""
        places = self.places.setdefault(spec.task, asyncio.Semaphore(spec.config.concurrency))
        async with places:
            return await self._run_started(spec, handle, prompt)

    async def _run_started(
        self, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt
    ) -> tuple[int, str]:
        config = spec.config
        session_id = handle.session_id
        environment = None
        try:
            status = await self.mesh.start_session(session_id)
            if status != OPEN:
                return status, "the session ended before its episode started"
            if config.command:
                return await run_agent(self.mesh, spec, handle, prompt, self.gateway_address)
            if config.verifiers:
                return await run_verifiers(
                    self.mesh, spec, handle, prompt, self.gateway_address, self._verifiers_of(spec)
                )
            environment = spec.make_environment(session_id)
            return await run_steps(self.mesh, spec, session_id, prompt, environment, self.call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # Its batch was cancelled (a validation given up, a run stopping): nobody reads it.
                return manager_pb2.SESSION_STATUS_UNSPECIFIED, ""
            # One session's call failing (a manager too busy to answer in time, a refusal) ends its
            # episode, not the job.
            reason = f"a call to the manager failed: {exc.code().name}: {exc.details()}"
            log.warning("episode failed", session_id=session_id, reason=reason)
            return await self._end(
                session_id, DEADLINE if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else ENVIRONMENT_ERROR, reason
            ), reason
        except TimeoutError:
            reason = f"the environment took longer than step_deadline_seconds ({config.step_deadline_seconds:g})"
            return await self._end(session_id, DEADLINE, reason), reason
        except (EnvironmentFailure, RenderError) as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - the user's environment may raise anything
            reason = f"the environment raised {type(exc).__name__}: {exc}"
        finally:
            if environment is not None:
                await self._close(environment, spec, session_id)
        log.warning("episode failed", session_id=session_id, reason=reason)
        return await self._end(session_id, ENVIRONMENT_ERROR, reason), reason

    async def _end(self, session_id: str, status: int, reason: str) -> int:
        """Closes a failed episode's session; returns the status it ended with. A close that fails
        too leaves the session to the manager's reaper, and the episode counts as `status`."""
        try:
            return await self.mesh.close_session(session_id, status, reason[:2000])
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "closing a failed episode's session failed: the manager reaps it at its deadline",
                session_id=session_id,
                error=f"{exc.code().name}: {exc.details()}",
            )
            return status

    def _verifiers_of(self, spec: EpisodeSpec) -> VerifiersEpisodes:
        if spec.task not in self.verifiers:
            config = spec.config
            assert config.verifiers is not None
            search_path = [spec.working_dir] if spec.working_dir else []
            self.verifiers[spec.task] = VerifiersEpisodes(
                load_verifiers(config.verifiers, config.verifiers_args, search_path)
            )
        return self.verifiers[spec.task]

    async def _close(self, environment: Any, spec: EpisodeSpec, session_id: str) -> None:
        """The environment's `close`, if it has one: a failure there is logged, the episode stands."""
        close = getattr(environment, "close", None)
        if not callable(close):
            return
        try:
            if inspect.iscoroutinefunction(close):
                await asyncio.wait_for(close(), spec.config.step_deadline_seconds)
            else:
                await self.threads.call(close, deadline=spec.config.step_deadline_seconds)
        except Exception as exc:  # noqa: BLE001 - the user's environment may raise anything
            log.warning(
                "closing an episode's environment failed", session_id=session_id, error=f"{type(exc).__name__}: {exc}"
            )

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for episodes in self.verifiers.values():
            await episodes.close()
