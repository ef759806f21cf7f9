"""A job's tasks built from their config: prompt source, renderer and guarded reward, and the
weighted mixture that draws each step's prompts from them reproducibly."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlmesh.rewards.base import RewardFunction
from rlmesh.rewards.guard import GuardedReward
from rlmesh.tasks.base import PromptSource, TaskPrompt
from rlmesh.tasks.config import TaskConfig


class TaskError(ValueError):
    """A task that cannot run with this model or config; the message names the task."""


class PromptRenderer:
    """Turns a task's prompt into the text and token ids the policy sees: the tokenizer's chat
    template for chat tasks, a format string (or the prompt as it is) for plain ones."""

    def __init__(self, task: str, tokenizer: Any, template: str | None, chat: bool, system: str | None) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.template = template
        self.chat = chat
        self.system = system
        if chat and not getattr(tokenizer, "chat_template", None):
            raise TaskError(f"task {task!r}: prompt.chat is set but the model's tokenizer has no chat template")

    def _fill(self, prompt: TaskPrompt, text: str | None) -> str:
        if self.template is None:
            if text is None:
                raise TaskError(f"task {self.task!r}: prompt {prompt.uid} is chat messages; set prompt.chat = true")
            return text
        try:
            return self.template.format(prompt=text, **prompt.metadata)
        except (KeyError, IndexError) as exc:
            raise TaskError(
                f"task {self.task!r}: prompt.template names {exc} which prompt {prompt.uid} does not have "
                f"(fields: prompt, {', '.join(sorted(prompt.metadata))})"
            ) from exc

    def text(self, prompt: TaskPrompt) -> str:
        if not self.chat:
            return self._fill(prompt, prompt.text)
        messages = (
            list(prompt.messages)
            if prompt.messages is not None
            else [{"role": "user", "content": self._fill(prompt, prompt.text)}]
        )
        if self.system and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _round_trips(self, text: str, ids: list[int]) -> bool:
        """Whether decoding gives the text back, up to whitespace and special tokens: a tokenizer
        without an unknown token silently drops what it cannot encode."""
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False)
        for special in getattr(self.tokenizer, "all_special_tokens", []):
            text, decoded = text.replace(special, ""), decoded.replace(special, "")
        return "".join(text.split()) == "".join(decoded.split())

    def token_ids(self, prompt: TaskPrompt) -> list[int]:
        return self.render(prompt)[1]

    def render(self, prompt: TaskPrompt) -> tuple[str, list[int]]:
        """The prompt's text and token ids, the template applied once."""
        text = self.text(prompt)
        # A chat template writes its own special tokens (BOS included) as text.
        ids = list(self.tokenizer.encode(text, add_special_tokens=not self.chat))
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        if (unknown is not None and unknown in ids) or not self._round_trips(text, ids):
            raise TaskError(
                f"task {self.task!r}: the model's tokenizer cannot encode prompt {prompt.uid} "
                f"({text[:60]!r}): it has characters outside its vocabulary"
            )
        if not ids:
            raise TaskError(f"task {self.task!r}: prompt {prompt.uid} renders to no tokens")
        return text, ids


@dataclass(slots=True)
class Task:
    config: TaskConfig
    source: PromptSource
    renderer: PromptRenderer
    reward: GuardedReward | None
    """None for a multi-turn task whose environment gives the rewards."""
    environment: Callable[[str], Any] | None = None
    """Multi-turn: makes one episode's environment (from its id); None too for an agent command."""

    @property
    def name(self) -> str:
        return self.config.name


def _source(config: TaskConfig, seed: int, search_path: Sequence[str]) -> PromptSource:
    if config.kind == "verifiers":
        from rlmesh.environments.verifiers_adapter import VerifiersSource, load_verifiers

        assert config.environment is not None and config.environment.verifiers is not None
        environment = load_verifiers(config.environment.verifiers, config.environment.verifiers_args, search_path)
        return VerifiersSource(environment, config.eval.holdout, seed)
    if config.kind == "increment":
        from rlmesh.tasks.increment import IncrementSource

        return IncrementSource(seed)
    if config.kind == "word_problems":
        from rlmesh.tasks.word_problems import WordProblemSource

        return WordProblemSource(seed)
    from rlmesh.tasks.datasets import DatasetSource

    assert config.dataset is not None
    return DatasetSource(config.dataset, config.eval, seed)


def _reward(config: TaskConfig, search_path: Sequence[str]) -> RewardFunction:
    reward = config.reward
    builtin = reward.builtin or (
        "increment" if config.kind == "increment" else "math" if config.kind == "word_problems" else None
    )
    if reward.function:
        from rlmesh.rewards.python import PythonReward, load_callable

        return PythonReward(load_callable(reward.function, search_path), reward.batched, reward.function)
    if reward.remote:
        from rlmesh.rewards.remote import RemoteReward
        from rlmesh.rpc.credentials import user_service_token

        # The guard's deadline covers every attempt of the call.
        return RemoteReward(
            reward.remote,
            config.name,
            timeout_seconds=reward.timeout_seconds / reward.attempts,
            attempts=reward.attempts,
            backoff_seconds=0.2,
            bearer_token=user_service_token(reward.remote_credential, "reward.remote_credential"),
        )
    if builtin == "increment":
        from rlmesh.rewards.builtin import IncrementReward

        return IncrementReward()
    if builtin == "math":
        from rlmesh.rewards.math import MathReward

        return MathReward()
    raise TaskError(f"task {config.name!r} has no reward")


def build_task(config: TaskConfig, tokenizer: Any, job_seed: int = 0, search_path: Sequence[str] = ()) -> Task:
    """Builds and checks a task: the dataset is read, the reward loaded and a few prompts rendered
    with the model's tokenizer, so a bad task stops the job at start with its name in the message."""
    from rlmesh.config import ConfigError
    from rlmesh.environments.factory import EnvironmentLoadError, environment_factory
    from rlmesh.environments.verifiers_adapter import VerifiersError
    from rlmesh.rewards.python import RewardLoadError
    from rlmesh.tasks.datasets import DatasetError

    environment = config.environment
    chat = config.prompt.chat or config.kind == "word_problems"
    try:
        source = _source(config, job_seed * 1_000_003 + config.seed, search_path)
        renderer = PromptRenderer(config.name, tokenizer, config.prompt.template, chat, config.prompt.system)
        # A multi-turn task's environment gives its rewards, unless the task names a reward of its own.
        inner = _reward(config, search_path) if environment is None or config.reward.given else None
        factory = environment_factory(environment, config.name, search_path) if environment is not None else None
    except (DatasetError, RewardLoadError, EnvironmentLoadError, VerifiersError, ConfigError) as exc:
        raise TaskError(f"task {config.name!r}: {exc}") from exc
    for prompt in [source.prompt_at(0), *source.held_out(1)]:
        renderer.token_ids(prompt)
    if not source.held_out(1):
        raise TaskError(f"task {config.name!r} has no held-out prompts: set eval.path, eval.split or eval.holdout")
    reward = config.reward
    guarded = (
        None
        if inner is None
        else GuardedReward(
            config.name,
            inner,
            reward.timeout_seconds,
            reward.failure_reward,
            reward.max_error_rate,
            reward.error_window,
        )
    )
    return Task(config, source, renderer, guarded, factory)


class TaskMixture:
    """Draws each step's prompts from the tasks by weight. The split of a step between tasks is a
    function of (seed, step), and each task's prompts come from its cursor: the cursors are all a
    checkpoint needs to resume the exact sequence of prompts."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise TaskError("a job needs at least one task")
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise TaskError(f"task names must be unique, got {names}")
        self.tasks = list(tasks)
        self.by_name = {t.name: t for t in tasks}
        self.seed = seed

    def draw(self, step: int, count: int) -> list[tuple[Task, TaskPrompt]]:
        if len(self.tasks) == 1:
            chosen = self.tasks * count
        else:
            chosen = random.Random(self.seed * 7_919 + step).choices(
                self.tasks, [t.config.weight for t in self.tasks], k=count
            )
        taken = {t.name: iter(t.source.take(sum(c is t for c in chosen))) for t in self.tasks}
        return [(task, next(taken[task.name])) for task in chosen]

    def cursors(self) -> dict[str, int]:
        return {t.name: t.source.cursor for t in self.tasks}

    def restore(self, cursors: Mapping[str, int]) -> None:
        unknown = set(cursors) - self.by_name.keys()
        if unknown:
            raise TaskError(f"the checkpoint has cursors of tasks this job does not have: {sorted(unknown)}")
        for name, cursor in cursors.items():
            self.by_name[name].source.cursor = cursor

    async def close(self) -> None:
        for task in self.tasks:
            if task.reward is not None:
                await task.reward.close()
