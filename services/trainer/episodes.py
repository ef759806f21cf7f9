"""The episode driver: runs a batch's multi-turn episodes beside reward scoring, each one session at the
manager: the environment's reset, then turn after turn (the model's, then the environment's step)
until the environment is done or a limit or deadline ends it. An environment that raises, hangs or
returns garbage ends its episode as an error, which is counted and masked, never scored."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from rlmesh.chat_turns import ENVIRONMENT, ChatTurns, Piece, RenderError
from rlmesh.environments.base import Action, EnvironmentFailure, StepResult, as_messages, as_step_result
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.build import TaskMixture
from rlmesh.tasks.config import EnvironmentConfig
from rlmesh.tool_calls import parse_tool_calls
from services.trainer.mesh import MeshClient

log = structlog.get_logger()

OPEN = manager_pb2.SESSION_STATUS_OPEN
DONE = manager_pb2.SESSION_STATUS_DONE
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
FAILED = frozenset({DEADLINE, ENVIRONMENT_ERROR})
"""Episodes that end this way are masked out of their group and count towards the error rate."""
_SOURCES = {ENVIRONMENT: manager_pb2.SEGMENT_SOURCE_ENVIRONMENT}


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
                f"task {self.task!r}: {sum(self.outcomes)} of the last {len(self.outcomes)} episodes failed (environment error or "
                f"deadline), above environment.max_error_rate ({self.max_rate:g}); the last: {self.last_reason}")


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """How a task's episodes run: a new environment per episode, rendered with the model's chat template."""

    task: str
    config: EnvironmentConfig
    make_environment: Callable[[], Any]
    turns: ChatTurns
    tokenizer: Any
    stop_ids: list[int]
    context_length: int
    """The model's positions (0: not known): the default bound on an episode's tokens."""

    def limits(self) -> manager_pb2.SessionLimits:
        config = self.config
        total = config.max_total_tokens or self.context_length
        if config.max_total_tokens and self.context_length:
            total = min(config.max_total_tokens, self.context_length)
        return manager_pb2.SessionLimits(max_turns=config.max_turns, max_total_tokens=total,
                                         turn_deadline_seconds=config.turn_deadline_seconds,
                                         session_deadline_seconds=config.episode_deadline_seconds,
                                         # The manager's bound on the environment's step leaves the driver time to close first.
                                         step_deadline_seconds=2 * config.step_deadline_seconds)


def episode_specs(mixture: TaskMixture, tokenizer: Any, stop_ids: list[int], context_length: int) -> dict[str, EpisodeSpec]:
    """The multi-turn tasks of a job, by name."""
    specs = {}
    for task in mixture.tasks:
        if task.environment is None or task.config.environment is None:
            continue
        try:
            turns = ChatTurns(tokenizer)
        except RenderError as exc:
            raise ValueError(f"task {task.name!r}: {exc}") from exc
        specs[task.name] = EpisodeSpec(task.name, task.config.environment, task.environment, turns, tokenizer, stop_ids,
                                       context_length)
    return specs


def row_of(prompt: TaskPrompt) -> dict[str, Any]:
    """What `reset` receives: the prompt (text or messages), its uid and its metadata fields."""
    return {**prompt.metadata, "prompt": prompt.text if prompt.text is not None else list(prompt.messages or []), "uid": prompt.uid}


def segments_of(pieces: list[Piece]) -> list[manager_pb2.Segment]:
    return [manager_pb2.Segment(source=_SOURCES.get(p.source, manager_pb2.SEGMENT_SOURCE_TEMPLATE), token_ids=p.token_ids)
            for p in pieces]


class EpisodeDriver:
    """Runs episodes for the trainer (rank 0's event loop). Episodes wait on the manager's turns
    almost all their time, so hundreds run at once as asyncio tasks; the user's sync environment
    code runs in a thread pool of its own, async code on the loop under a deadline."""

    def __init__(self, mesh: MeshClient, threads: int, on_failure: Callable[[BaseException], Awaitable[None]]) -> None:
        self.mesh = mesh
        self.on_failure = on_failure
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="environment")
        self.errors: dict[str, EpisodeErrors] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        """Set when the job must stop (too many failed episodes, a manager that cannot be reached)."""

    def start(self, spec: EpisodeSpec, handles: list[manager_pb2.SessionHandle], prompts: Mapping[str, TaskPrompt],
              counted: bool = True) -> None:
        """Runs the episodes of a batch's sessions in the background. `counted`: their failures count
        towards the task's error rate (training episodes; held-out ones are only reported)."""
        for handle in handles:
            task = asyncio.create_task(self._guarded(spec, handle, prompts[handle.prompt_id], counted),
                                       name=f"episode {handle.session_id}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _guarded(self, spec: EpisodeSpec, handle: manager_pb2.SessionHandle, prompt: TaskPrompt, counted: bool) -> None:
        try:
            status, reason = await self.run_episode(spec, handle.session_id, prompt)
            if not counted or status == manager_pb2.SESSION_STATUS_UNSPECIFIED:
                return
            errors = self.errors.setdefault(spec.task, EpisodeErrors(spec.task, spec.config.max_error_rate, spec.config.error_window))
            errors.record(status in FAILED, reason)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop, which stops the job
            if self.failure is None:
                self.failure = exc
                await self.on_failure(exc)

    async def _call(self, method: Callable[..., Any], argument: Any, deadline: float) -> Any:
        """The environment's method under its deadline: sync in the pool, async on the loop."""
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(argument), deadline)
        future = asyncio.get_running_loop().run_in_executor(self.executor, method, argument)
        result = await asyncio.wait_for(future, deadline)
        return await result if inspect.isawaitable(result) else result

    async def run_episode(self, spec: EpisodeSpec, session_id: str, prompt: TaskPrompt) -> tuple[int, str]:
        """One episode to its end; returns the status its session was closed with and why."""
        config = spec.config
        mesh = self.mesh
        try:
            environment = spec.make_environment()
            history = as_messages(await self._call(environment.reset, row_of(prompt), config.step_deadline_seconds), "reset")
            pieces = spec.turns.first(history)
            turn = 0
            while True:
                reply = await mesh.run_turn(manager_pb2.RunTurnRequest(session_id=session_id, turn=turn, append=segments_of(pieces)),
                                            config.turn_deadline_seconds + config.step_deadline_seconds)
                if reply.status != OPEN:
                    return reply.status, ""
                action = self._action(spec, reply.generated)
                history.append({"role": "assistant", "content": action.text})
                result: StepResult = as_step_result(await self._call(environment.step, action, config.step_deadline_seconds))
                # The trajectory's reward is the sum of its turns' (trajectory_reward).
                if result.reward is not None:
                    await mesh.set_session_reward(session_id, result.reward, turn)
                if result.done:
                    return await mesh.close_session(session_id, DONE), ""
                stop_text = "" if action.truncated else spec.tokenizer.decode(reply.generated.token_ids[-1:])
                pieces = spec.turns.after_model(history, stop_text, result.messages)
                history += result.messages
                turn += 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # Its batch was cancelled (a validation given up, a run stopping): nobody reads it.
                return manager_pb2.SESSION_STATUS_UNSPECIFIED, ""
            raise
        except TimeoutError:
            reason = f"the environment took longer than step_deadline_seconds ({config.step_deadline_seconds:g})"
            return await mesh.close_session(session_id, DEADLINE, reason), reason
        except (EnvironmentFailure, RenderError) as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - the user's environment may raise anything
            if isinstance(exc, asyncio.CancelledError):
                raise
            reason = f"the environment raised {type(exc).__name__}: {exc}"
        log.warning("episode failed", session_id=session_id, reason=reason)
        return await mesh.close_session(session_id, ENVIRONMENT_ERROR, reason[:2000]), reason

    @staticmethod
    def _action(spec: EpisodeSpec, generated: manager_pb2.Segment) -> Action:
        ids = list(generated.token_ids)
        truncated = generated.finish_reason == common_pb2.FINISH_REASON_LENGTH
        text_ids = ids[:-1] if ids and ids[-1] in spec.stop_ids else ids
        text = spec.tokenizer.decode(text_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text)
        return Action(text, parsed.tool_calls, parsed.content, ids, truncated)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)
