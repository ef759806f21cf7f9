"""The `feedback` built-in environment, on the increment task (add 1 to every digit; the tiny default
model): the model answers, the environment marks each position right or wrong and asks again. The
marks are the answer as the model gave it with every wrong digit replaced by `=`, so what was right
stands where it was; the second attempt can keep it and redo the rest. Each attempt's reward is its
share of right digits. Without tools (`tools = false`) the environment repeats the problem with no
marks: the baseline the marks are measured against."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlmesh.environments.base import Action, EnvironmentFailure, StepResult, Text
from rlmesh.tasks.increment import reward

ATTEMPTS = 2


def marks(attempt: str, answer: str) -> str:
    """The attempt's digits where they were right, `=` where they were wrong (or missing), then `=`."""
    return "".join(want if index < len(attempt) and attempt[index] == want else "=" for index, want in enumerate(answer)) + "="


class FeedbackEnvironment:
    def __init__(self, tools: bool = True) -> None:
        self.marked = tools
        self.problem = self.answer = ""
        self.attempts = 0

    def reset(self, row: Mapping[str, Any]) -> Text:
        prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not prompt.endswith("=") or not prompt[:-1].isdigit():
            raise EnvironmentFailure(f"feedback: the row's prompt must be digits and '=' (an increment problem), got {prompt!r}")
        if not isinstance(answer, str) or len(answer) != len(prompt) - 1:
            raise EnvironmentFailure(f"feedback: the row's answer must be as many digits as the problem, got {answer!r}")
        self.problem, self.answer = prompt[:-1], answer
        return Text(prompt)

    def step(self, action: Action) -> StepResult:
        attempt = action.text.strip()
        self.attempts += 1
        score = reward(attempt, self.answer)
        if self.attempts >= ATTEMPTS:
            return StepResult([], score, True)
        observation = marks(attempt, self.answer) if self.marked else f"{self.problem}="
        return StepResult(Text(observation), score, False)
