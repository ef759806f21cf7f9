"""The second built-in task: arithmetic word problems in English (shopping, sharing, ages, rates and
two-step problems) generated from a seed, with small integers and even divisions, so every answer
is an integer that math-verify can check in the model's \\boxed{} answer."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from rlmesh.tasks.base import Message, PromptSource, TaskPrompt

HELD_OUT_SEED = 2_000_003
HELD_OUT_COUNT = 256
"""Size of the fixed held-out set; training problems never repeat one of them."""
INSTRUCTION = "Put the final answer in \\boxed{}."

NAMES = (
    "Ana",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kim",
    "Leo",
    "Mia",
    "Noor",
    "Omar",
    "Pia",
)
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")
CONTAINERS = (("bag", "bags"), ("box", "boxes"), ("pack", "packs"), ("jar", "jars"))

Step = tuple[int, str, int]


@dataclass(frozen=True, slots=True)
class WordProblem:
    kind: str
    text: str
    steps: tuple[Step, ...]
    """The arithmetic in order, each (left, operator, right) with operator one of + - * /; from the
    second step on, one operand is the previous step's result and the other is given in the text."""
    answer: int


def step_result(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if op == "/":
        quotient, remainder = divmod(left, right)
        if remainder:
            raise ValueError(f"{left}/{right} is not a whole number")
        return quotient
    raise ValueError(f"unknown operator {op!r}")


def _shopping(rng: random.Random) -> WordProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    if rng.random() < 0.5:
        one, many = rng.choice(CONTAINERS)
        text = f"{name} buys {a} {many} of {item}. Each {one} holds {b} {item}. How many {item} does {name} buy?"
    else:
        text = f"{name} buys {a} {item} for {b} dollars each. How many dollars does {name} spend?"
    return WordProblem("shopping", text, ((a, "*", b),), a * b)


def _sharing(rng: random.Random) -> WordProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    text = (
        f"{name} has {total} {item} and shares them equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return WordProblem("sharing", text, ((total, "/", friends),), each)


def _ages(rng: random.Random) -> WordProblem:
    name, other = rng.sample(NAMES, 2)
    age, gap = rng.randint(10, 40), rng.randint(2, 9)
    if rng.random() < 0.5:
        text = f"{name} is {age} years old. {other} is {gap} years older than {name}. How old is {other}?"
        return WordProblem("ages", text, ((age, "+", gap),), age + gap)
    text = f"{name} is {age} years old. {other} is {gap} years younger than {name}. How old is {other}?"
    return WordProblem("ages", text, ((age, "-", gap),), age - gap)


def _rates(rng: random.Random) -> WordProblem:
    rate, time = rng.randint(2, 12), rng.randint(2, 9)
    if rng.random() < 0.5:
        text = f"A bike goes {rate} miles each hour. How many miles does it go in {time} hours?"
        return WordProblem("rates", text, ((rate, "*", time),), rate * time)
    pages = rate * time
    text = f"A printer prints {rate} pages each minute. How many minutes does it take to print {pages} pages?"
    return WordProblem("rates", text, ((pages, "/", rate),), time)


def _two_steps(rng: random.Random) -> WordProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    variant = rng.randrange(4)
    if variant == 0:
        count, price, change = rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 20)
        cost = count * price
        paid = cost + change
        text = (
            f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
            f"How much change does {name} get?"
        )
        return WordProblem("two_steps", text, ((count, "*", price), (paid, "-", cost)), change)
    if variant == 1:
        one, many = rng.choice(CONTAINERS)
        boxes, per_box = rng.randint(2, 6), rng.randint(2, 9)
        total = boxes * per_box
        given = rng.randint(1, total - 1)
        text = (
            f"{name} has {boxes} {many} with {per_box} {item} in each {one} and gives away {given} {item}. "
            f"How many {item} are left?"
        )
        return WordProblem("two_steps", text, ((boxes, "*", per_box), (total, "-", given)), total - given)
    if variant == 2:
        friends, each = rng.randint(2, 6), rng.randint(2, 9)
        total = friends * each
        had = rng.randint(1, total - 1)
        bought = total - had
        text = (
            f"{name} has {had} {item} and buys {bought} more, then shares them equally among {friends} friends. "
            f"How many {item} does each friend get?"
        )
        return WordProblem("two_steps", text, ((had, "+", bought), (total, "/", friends)), each)
    other = rng.choice([n for n in NAMES if n != name])
    age, gap, years = rng.randint(5, 30), rng.randint(2, 9), rng.randint(2, 9)
    text = (
        f"{name} is {age} years old. {other} is {gap} years older than {name}. "
        f"How old will {other} be in {years} years?"
    )
    return WordProblem("two_steps", text, ((age, "+", gap), (age + gap, "+", years)), age + gap + years)


KINDS: dict[str, Callable[[random.Random], WordProblem]] = {
    "shopping": _shopping,
    "sharing": _sharing,
    "ages": _ages,
    "rates": _rates,
    "two_steps": _two_steps,
}


def make_problem(rng: random.Random) -> WordProblem:
    return KINDS[rng.choice(tuple(KINDS))](rng)


def held_out_problems(count: int = 64) -> list[WordProblem]:
    rng = random.Random(HELD_OUT_SEED)
    return [make_problem(rng) for _ in range(count)]


def messages_for(problem: WordProblem) -> tuple[Message, ...]:
    return ({"role": "user", "content": f"{problem.text} {INSTRUCTION}"},)


def solution_text(problem: WordProblem) -> str:
    """A short worked solution ending in the boxed answer, e.g. `3*4=12, 20-12=8. \\boxed{8}`:
    a supervised warm-up target short enough for the task's response budget."""
    steps = ", ".join(f"{left}{op}{right}={step_result(left, op, right)}" for left, op, right in problem.steps)
    return f"{steps}. \\boxed{{{problem.answer}}}"


def expression_of(problem: WordProblem) -> str:
    """The problem's arithmetic as one expression, each later step wrapping the one before:
    `(3*4)-5`: what a calculator is asked."""
    left, op, right = problem.steps[0]
    expression = f"{left}{op}{right}"
    previous = step_result(left, op, right)
    for left, op, right in problem.steps[1:]:
        expression = f"({expression}){op}{right}" if left == previous else f"{left}{op}({expression})"
        previous = step_result(left, op, right)
    return expression


def _prompt(uid: str, problem: WordProblem) -> TaskPrompt:
    return TaskPrompt(uid, messages=messages_for(problem), metadata={"answer": str(problem.answer)})


class WordProblemSource(PromptSource):
    """Training problems reproducible from (seed, position), so a resumed run sees the same data,
    and disjoint from the held-out set. The ground truth is in the metadata under `answer`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.excluded = {p.text for p in held_out_problems(HELD_OUT_COUNT)}

    def problem_at(self, position: int) -> WordProblem:
        # A string seed is hashed with SHA-512: distinct (seed, position) pairs never share a stream.
        rng = random.Random(f"word-problems:{self.seed}:{position}")
        while True:
            problem = make_problem(rng)
            if problem.text not in self.excluded:
                return problem

    def prompt_at(self, position: int) -> TaskPrompt:
        return _prompt(f"gen-{position}", self.problem_at(position))

    def held_out(self, count: int) -> list[TaskPrompt]:
        return [_prompt(f"eval-{i}", p) for i, p in enumerate(held_out_problems(min(count, HELD_OUT_COUNT)))]
