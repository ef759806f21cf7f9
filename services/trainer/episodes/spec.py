"""How a task's episodes run (EpisodeSpec): what the driver and each kind of episode (steps, agent,
verifiers) share, in a module of its own so that none of them imports another for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlmesh.chat.turns import ChatTurns, RenderError
from rlmesh.environments.base import EnvironmentFailure
from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.build import TaskMixture
from rlmesh.tasks.config import EnvironmentConfig


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """How a task's episodes run: a new environment per episode, rendered with the model's chat template."""

    task: str
    config: EnvironmentConfig
    make_environment: Callable[[str], Any] | None
    """Episode id -> its environment; None for an agent command."""
    turns: ChatTurns | None
    """None for a model without a chat template: its environments give raw observations."""
    tokenizer: Any
    stop_ids: list[int]
    context_length: int
    """The model's positions (0: not known): the default bound on an episode's tokens."""
    working_dir: str = ""
    """Where an agent command runs (the job's folder)."""

    def chat_turns(self) -> ChatTurns:
        if self.turns is None:
            raise EnvironmentFailure(
                "the environment gave chat messages but the model's tokenizer has no chat template: "
                "give raw observations (Text, Tokens) instead"
            )
        return self.turns

    def limits(self) -> manager_pb2.SessionLimits:
        config = self.config
        total = config.max_total_tokens or self.context_length
        if config.max_total_tokens and self.context_length:
            total = min(config.max_total_tokens, self.context_length)
        return manager_pb2.SessionLimits(
            max_turns=config.max_turns,
            max_total_tokens=total,
            turn_deadline_seconds=config.turn_deadline_seconds,
            session_deadline_seconds=config.episode_deadline_seconds,
            # The manager's bound on the environment's step leaves the driver time to close first.
            step_deadline_seconds=2 * config.step_deadline_seconds,
            # The driver starts each session when its episode gets a place (max_concurrent).
            wait_for_start=True,
            refuse_agent_rewards=config.agent_rewards is False,
            refuse_breaks=config.on_break == "refuse",
        )


def episode_specs(
    mixture: TaskMixture, tokenizer: Any, stop_ids: list[int], context_length: int, working_dir: str = ""
) -> dict[str, EpisodeSpec]:
    """The multi-turn tasks of a job, by name."""
    specs = {}
    for task in mixture.tasks:
        if task.config.environment is None:
            continue
        try:
            turns: ChatTurns | None = ChatTurns(tokenizer)
        except RenderError:
            turns = None
        specs[task.name] = EpisodeSpec(
            task.name,
            task.config.environment,
            task.environment,
            turns,
            tokenizer,
            stop_ids,
            context_length,
            working_dir,
        )
    return specs
