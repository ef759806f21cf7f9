"""The `feedback` built-in environment, on the increment task's problems: the answer is a hidden code
(each digit the problem's digit kept or plus one, fixed per problem and position), so a first
attempt can only guess, about half its digits right. The environment marks each position right or
wrong (the attempt's digits where right, `=` where wrong) and asks again: a second attempt that uses
the marks can get every digit. Each attempt's reward is its share of right digits. Without tools
(`tools = false`) the environment repeats the problem with no marks: the baseline the marks are
measured against."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from rlmesh.environments.base import Action, EnvironmentFailure, StepResult, Text
from rlmesh.tasks.increment import reward

ATTEMPTS = 2


def hidden_code(digits: str) -> str:
    """The answer to the problem `digits`: each digit kept or plus one (9 wraps to 0), as the bits
    of the problem's SHA-256 say, so no attempt can know it before the marks."""
    bits = hashlib.sha256(digits.encode()).digest()
    return "".join(str((int(digit) + (bits[index] & 1)) % 10) for index, digit in enumerate(digits))


def marks(attempt: str, answer: str) -> str:
    """The attempt's digits where they were right, `=` where they were wrong (or missing), then `=`."""
    return (
        "".join(want if index < len(attempt) and attempt[index] == want else "=" for index, want in enumerate(answer))
        + "="
    )


class FeedbackEnvironment:
    def __init__(self, tools: bool = True) -> None:
        self.marked = tools
        self.problem = self.answer = ""
        self.attempts = 0

    def reset(self, row: Mapping[str, Any]) -> Text:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.endswith("=") or not prompt[:-1].isdigit():
            raise EnvironmentFailure(
                f"feedback: the row's prompt must be digits and '=' (an increment problem), got {prompt!r}"
            )
        self.problem = prompt[:-1]
        self.answer = hidden_code(self.problem)
        return Text(prompt)

    def step(self, action: Action) -> StepResult:
        attempt = action.text.strip()
        self.attempts += 1
        score = reward(attempt, self.answer)
        if self.attempts >= ATTEMPTS:
            return StepResult([], score, True)
        observation = marks(attempt, self.answer) if self.marked else f"{self.problem}="
        return StepResult(Text(observation), score, False)
