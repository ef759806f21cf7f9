"""The default task: add 1 to every digit of a 4-8 digit string (9 wraps to 0).

Prompts are generated from a seed, the reward gives credit per correct character, and a fixed
held-out set measures exact-match accuracy."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlmesh.tasks.base import PromptSource, TaskPrompt

HELD_OUT_SEED = 1_000_003
HELD_OUT_COUNT = 256
"""Size of the fixed held-out set; training problems never repeat one of them."""


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str
    answer: str


def answer_for(digits: str) -> str:
    return "".join(str((int(c) + 1) % 10) for c in digits)


def make_problem(rng: random.Random, min_digits: int = 4, max_digits: int = 8) -> Problem:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
    return Problem(prompt=f"{digits}=", answer=answer_for(digits))


def held_out_problems(count: int = 64) -> list[Problem]:
    rng = random.Random(HELD_OUT_SEED)
    return [make_problem(rng) for _ in range(count)]


class IncrementSource(PromptSource):
    """Training problems reproducible from (seed, position), so a resumed run sees the same data,
    and disjoint from the held-out set. The ground truth is in the metadata under `answer`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.excluded = {p.prompt for p in held_out_problems(HELD_OUT_COUNT)}

    def prompt_at(self, position: int) -> TaskPrompt:
        rng = random.Random(self.seed * 1_000_033 + position)
        while True:
            problem = make_problem(rng)
            if problem.prompt not in self.excluded:
                return TaskPrompt(f"gen-{position}", text=problem.prompt, metadata={"answer": problem.answer})

    def held_out(self, count: int) -> list[TaskPrompt]:
        return [
            TaskPrompt(f"eval-{i}", text=p.prompt, metadata={"answer": p.answer})
            for i, p in enumerate(held_out_problems(min(count, HELD_OUT_COUNT)))
        ]


def reward(response: str, answer: str) -> float:
    """Share of positions where the response matches the answer, over the longer of the two:
    partial credit in [0, 1], 1 only for an exact match."""
    length = max(len(response), len(answer))
    if length == 0:
        return 1.0
    correct = sum(1 for got, want in zip(response, answer) if got == want)
    return correct / length


def exact_match(response: str, answer: str) -> bool:
    return response == answer
