"""What an environment is to an episode: `reset(row)` gives the first messages, `step(action)` an
observation, a reward and whether the episode is done. Sync or async; whatever it returns is checked,
so garbage ends the episode as an environment error instead of reaching the trainer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlmesh.chat.tool_calls import ToolCall

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
FLOAT32_MAX = 3.4028234663852886e38
"""The largest reward the manager can store: rewards travel as float32."""


class EnvironmentFailure(RuntimeError):
    """The environment raised or returned something that is not an observation: its episode ends
    as `environment_error`, masked out of its group."""


@dataclass(frozen=True, slots=True)
class Action:
    """The model's turn as the environment sees it."""

    text: str
    """The turn's text (its stop token and special tokens removed), tool calls included as written."""
    tool_calls: list[ToolCall]
    """Tool calls parsed from the text (the Hermes / Qwen <tool_call> form)."""
    content: str
    """The text outside the tool calls."""
    token_ids: list[int]
    """The turn's token ids as sampled, its stop token included when it produced one."""
    truncated: bool
    """The turn was cut at max_tokens."""


@dataclass(frozen=True, slots=True)
class Tokens:
    """An observation as token ids, appended to the stream as they are (an environment of a model
    without a chat template, or one that renders its own)."""

    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Text:
    """An observation as raw text, tokenized once as it is (no chat template) and appended: an
    environment of a model without a chat template."""

    text: str


@dataclass(frozen=True, slots=True)
class StepResult:
    """What `step` returns (a tuple or a mapping of the same three is read alike)."""

    messages: list[Message] | Tokens | Text = field(default_factory=list)
    """What the environment says next (user or tool messages, Tokens or Text); empty once done."""
    reward: float | None = None
    """This step's reward; the episode's reward is the sum of its steps' (None counts as 0)."""
    done: bool = False
    """The episode ends here: no more turns."""


class Environment(Protocol):
    """One episode's environment; a new one is made for every episode."""

    def reset(self, row: Mapping[str, Any]) -> Any:
        """The first messages (a list of {"role", "content"}), or a user message's text."""

    def step(self, action: Action) -> Any:
        """A StepResult, a (observation, reward, done) tuple, or a mapping with those keys; the
        observation is a user message's text, a message, or a list of messages."""


def as_observation(value: Any, where: str) -> list[Message] | Tokens | Text:
    """Messages from what an environment returned (text: a user message; one message; a list), or
    its Tokens ({"token_ids": [...]} too) or raw Text ({"text": "..."} too)."""
    if isinstance(value, Mapping) and set(value) == {"token_ids"}:
        value = Tokens(value["token_ids"])
    if isinstance(value, Mapping) and set(value) == {"text"}:
        value = Text(value["text"])
    if isinstance(value, Text):
        if not isinstance(value.text, str) or not value.text:
            raise EnvironmentFailure(f"{where} returned raw text that is not a non-empty string")
        return value
    if isinstance(value, Tokens):
        ids = value.token_ids
        if (
            not isinstance(ids, (list, tuple))
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise EnvironmentFailure(f"{where} returned token_ids that are not a non-empty list of token ids")
        return Tokens(list(ids))
    return as_messages(value, where)


def as_messages(value: Any, where: str) -> list[Message]:
    """Messages from what an environment returned: text (a user message), one message, or a list."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise EnvironmentFailure(f"{where} returned {type(value).__name__}, not messages or text")
    messages = []
    for message in value:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise EnvironmentFailure(
                f"{where} returned a message that is not a mapping with a role in {ROLES}: {str(message)[:80]}"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise EnvironmentFailure(
                f"{where} returned a {message['role']} message whose content is {type(content).__name__}"
            )
        messages.append(dict(message))
    return messages


def checked_reward(reward: Any, where: str) -> float:
    """A reward as the manager stores it (float32); EnvironmentFailure naming `where` for anything
    else (NaN, an infinity, a number beyond float32's range, a bool, text)."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise EnvironmentFailure(f"{where} gave reward={reward!r}, not a finite number")
    try:
        value = float(reward)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise EnvironmentFailure(
            f"{where} gave reward={reward!r}, not a finite number within float32's range "
            f"(magnitude at most {FLOAT32_MAX:.7g})"
        )
    return value


def as_step_result(value: Any) -> StepResult:
    """A StepResult from what `step` returned; EnvironmentFailure for anything else."""
    if isinstance(value, StepResult):
        observation, reward, done = value.messages, value.reward, value.done
    elif isinstance(value, tuple) and len(value) == 3:
        observation, reward, done = value
    elif isinstance(value, Mapping) and not ({"observation", "reward", "done"} >= set(value) and value):
        raise EnvironmentFailure(
            f"step returned a mapping with keys {sorted(value)}: give observation, reward and done"
        )
    elif isinstance(value, Mapping):
        observation, reward, done = value.get("observation"), value.get("reward"), value.get("done", False)
    else:
        raise EnvironmentFailure(f"step returned {type(value).__name__}: give (observation, reward, done)")
    if not isinstance(done, bool):
        raise EnvironmentFailure(f"step returned done={done!r}, not a bool")
    if reward is not None:
        reward = checked_reward(reward, "step")
    messages = [] if observation is None or (done and not observation) else as_observation(observation, "step")
    if not done and not messages:
        raise EnvironmentFailure("step returned no observation for an episode that is not done")
    return StepResult(messages, reward, done)
