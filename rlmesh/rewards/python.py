"""A reward written as a Python function in the user's own file: loaded by `module:function` or
`file.py:function`, sync or async, called per sample or once per batch."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlmesh.rewards.base import RewardItem, RewardResult, as_result

STANDARD_ARGUMENTS = ("prompt", "completion", "metadata", "completion_token_ids")


class RewardLoadError(ValueError):
    """The reward function named in a job cannot be loaded or called; the message says why."""


def load_callable(spec: str, search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """`module:function` (imported with `search_path` first on sys.path) or `path/file.py:function`."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise RewardLoadError(f"reward function {spec!r}: write it module:function or file.py:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise RewardLoadError(f"reward function {spec!r}: file {path} does not exist")
        module_name = f"rlmesh_user_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise RewardLoadError(
                f"reward function {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        for folder in reversed(search_path):
            if folder not in sys.path:
                sys.path.insert(0, folder)
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise RewardLoadError(
                f"reward function {spec!r}: cannot import module {target!r}: {type(exc).__name__}: {exc}"
            ) from exc
    function = getattr(module, name, None)
    if function is None:
        raise RewardLoadError(f"reward function {spec!r}: {target} has no attribute {name!r}")
    if not callable(function):
        raise RewardLoadError(f"reward function {spec!r}: {name} is not callable")
    return function


class PythonReward:
    """Calls the user's function with the arguments it declares: `prompt`, `completion`, `metadata`,
    `completion_token_ids`, or any metadata field by name (`answer`). A function with **kwargs gets
    them all. Sync functions run in a worker thread so a slow one never blocks the trainer's loop."""

    def __init__(self, function: Callable[..., Any], batched: bool, spec: str) -> None:
        self.function = function
        self.batched = batched
        self.spec = spec
        signature = inspect.signature(function)
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        named = [
            p
            for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        self.names = [p.name for p in named]
        self.required = {p.name for p in named if p.default is inspect.Parameter.empty}
        self.is_async = inspect.iscoroutinefunction(function)

    def _arguments(self, item: RewardItem) -> dict[str, Any]:
        available = {
            "prompt": item.prompt,
            "completion": item.completion,
            "metadata": dict(item.metadata),
            "completion_token_ids": list(item.completion_token_ids),
        }
        for key, value in item.metadata.items():
            available.setdefault(key, value)
        if self.takes_all:
            return available
        missing = [n for n in self.names if n in self.required and n not in available]
        if missing:
            raise RewardLoadError(
                f"reward function {self.spec}: no value for parameter {missing[0]!r} "
                f"(available: {', '.join(sorted(available))})"
            )
        return {n: available[n] for n in self.names if n in available}

    async def _call(self, **kwargs: Any) -> Any:
        if self.is_async:
            return await self.function(**kwargs)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

        def run() -> None:
            try:
                outcome = (self.function(**kwargs), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which decides
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:
                pass  # the loop closed while this call ran past its deadline: nobody waits for it

        # A daemon thread of its own: a function that never returns is abandoned at its deadline
        # and cannot hold up the trainer's exit, as a pool's worker would.
        threading.Thread(target=run, name="reward-function", daemon=True).start()
        return await done

    async def score_one(self, item: RewardItem) -> RewardResult:
        return as_result(await self._call(**self._arguments(item)))

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        if not self.batched:
            return [await self.score_one(item) for item in items]
        per_item = [self._arguments(item) for item in items]
        columns = {name: [args[name] for args in per_item] for name in per_item[0]} if per_item else {}
        values = await self._call(**columns)
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != len(items):
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ValueError(f"batched reward function returned {got} results for {len(items)} samples")
        return [as_result(v) for v in values]

    @property
    def per_sample(self) -> bool:
        return not self.batched

    async def close(self) -> None:
        return None
