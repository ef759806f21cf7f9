"""The default task: add 1 to every digit of a 4-8 digit string (9 wraps to 0).

Prompts are generated from a seed, the reward gives credit per correct character, and a fixed
held-out set measures exact-match accuracy."""

from __future__ import annotations

import random
from dataclasses import dataclass

HELD_OUT_SEED = 1_000_003


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


class ProblemStream:
    """Training problems for step `step`, reproducible from (seed, step) so a resumed run sees
    the same data, and disjoint from the held-out set."""

    def __init__(self, seed: int, held_out: list[Problem]) -> None:
        self.seed = seed
        self.excluded = {p.prompt for p in held_out}

    def problems_for_step(self, step: int, count: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_033 + step)
        problems: list[Problem] = []
        while len(problems) < count:
            problem = make_problem(rng)
            if problem.prompt not in self.excluded:
                problems.append(problem)
        return problems


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
