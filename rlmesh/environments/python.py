"""An environment written as a Python class in the user's own file (`file.py:Class` or `module:Class`),
or one shipped with rlmesh: a new instance for every episode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlmesh.rewards.python import RewardLoadError, load_callable


class EnvironmentLoadError(ValueError):
    """The environment named in a job cannot be loaded; the message says why."""


def environment_factory(python: str | None, builtin: str | None, search_path: Sequence[str] = ()) -> Callable[[], Any]:
    """What makes one episode's environment: the user's class (called with no arguments) or a built-in."""
    if builtin == "calculator":
        from rlmesh.environments.calculator import CalculatorEnvironment

        return CalculatorEnvironment
    if builtin == "feedback":
        from rlmesh.environments.feedback import FeedbackEnvironment

        return FeedbackEnvironment
    if python is None:
        raise EnvironmentLoadError("an environment needs `python` or `builtin`")
    try:
        factory = load_callable(python, search_path)
    except RewardLoadError as exc:
        raise EnvironmentLoadError(str(exc).replace("reward function", "environment")) from exc
    return factory


def check_environment(factory: Callable[[], Any], name: str) -> None:
    """Makes one instance and checks it has reset and step, so a wrong class stops the job at start."""
    try:
        environment = factory()
    except Exception as exc:
        raise EnvironmentLoadError(f"environment {name!r}: making an instance failed: {type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("reset", "step") if not callable(getattr(environment, m, None))]
    if missing:
        raise EnvironmentLoadError(f"environment {name!r}: {type(environment).__name__} has no {' or '.join(missing)} method")
