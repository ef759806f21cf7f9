"""What makes one episode's environment for a task: the user's Python class (`file.py:Class` or
`module:Class`), one shipped with rlmesh, or a client of a remote environment service."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlmesh.rewards.python import RewardLoadError, load_callable
from rlmesh.tasks.config import EnvironmentConfig

EnvironmentFactory = Callable[[str], Any]
"""Episode id -> a new environment for that episode."""


class EnvironmentLoadError(ValueError):
    """The environment named in a job cannot be loaded; the message says why."""


def environment_factory(
    config: EnvironmentConfig, task: str, search_path: Sequence[str] = ()
) -> EnvironmentFactory | None:
    """None for an agent command or a verifiers environment (they drive their episodes through the gateway)."""
    if config.command or config.verifiers:
        return None
    if config.remote:
        from rlmesh.config import ConfigError
        from rlmesh.environments.remote import EnvironmentChannel
        from rlmesh.rpc.credentials import user_service_token

        try:
            token = user_service_token(config.remote_credential, "environment.remote_credential")
        except ConfigError as exc:
            raise EnvironmentLoadError(str(exc)) from exc
        channel = EnvironmentChannel(config.remote, task, config.step_deadline_seconds, token)
        return channel.episode
    if config.builtin:
        from rlmesh.environments.calculator import CalculatorEnvironment
        from rlmesh.environments.feedback import FeedbackEnvironment

        builtin = {"calculator": CalculatorEnvironment, "feedback": FeedbackEnvironment}[config.builtin]
        return lambda episode_id: builtin(tools=config.tools)
    assert config.python is not None
    try:
        factory = load_callable(config.python, search_path)
    except RewardLoadError as exc:
        raise EnvironmentLoadError(str(exc).replace("reward function", "environment")) from exc
    check_environment(factory, config.python)
    return lambda episode_id: factory()


def check_environment(factory: Callable[[], Any], name: str) -> None:
    """Makes one instance and checks it has reset and step, so a wrong class stops the job at start."""
    try:
        environment = factory()
    except Exception as exc:
        raise EnvironmentLoadError(
            f"environment {name!r}: making an instance failed: {type(exc).__name__}: {exc}"
        ) from exc
    missing = [m for m in ("reset", "step") if not callable(getattr(environment, m, None))]
    if missing:
        raise EnvironmentLoadError(
            f"environment {name!r}: {type(environment).__name__} has no {' or '.join(missing)} method"
        )
