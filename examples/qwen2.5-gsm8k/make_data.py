"""Writes this example's GSM8K-style data: grade-school word problems in GSM8K's own JSONL form
({"question", "answer"}, the answer a worked solution with <<calculator>> notes ending "#### N"),
64 training rows and 16 held-out rows, in printable ASCII. Run it again to regenerate the files."""

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = [
    "Ava",
    "Ben",
    "Carla",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kira",
    "Luis",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
]
Problem = tuple[str, list[str], int]
"""The question, the solution's lines and the final answer."""


def shopping(rng: random.Random) -> Problem:
    name, packs, price = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, 12)
    cost = packs * price
    bill = next(b for b in (20, 50, 100, 200) if b > cost)
    return (
        f"{name} buys {packs} packs of markers for ${price} each and pays with a ${bill} bill. "
        f"How much change does {name} get, in dollars?",
        [
            f"The markers cost {packs}*{price} = <<{packs}*{price}={cost}>>{cost} dollars.",
            f"The change is {bill}-{cost} = <<{bill}-{cost}={bill - cost}>>{bill - cost} dollars.",
        ],
        bill - cost,
    )


def sharing(rng: random.Random) -> Problem:
    name, friends, each, given = rng.choice(NAMES), rng.randint(2, 6), rng.randint(3, 12), rng.randint(2, 15)
    total = friends * each + given
    return (
        f"{name} has {total} stickers. {name} gives {given} stickers to a classmate and shares the rest equally "
        f"among {friends} friends. How many stickers does each friend get?",
        [
            f"{name} keeps {total}-{given} = <<{total}-{given}={total - given}>>{total - given} stickers.",
            f"Each friend gets {total - given}/{friends} = <<{total - given}/{friends}={each}>>{each} stickers.",
        ],
        each,
    )


def travel(rng: random.Random) -> Problem:
    first, hours, second, more = rng.randint(30, 65), rng.randint(2, 5), rng.randint(20, 55), rng.randint(1, 3)
    a, b = first * hours, second * more
    return (
        f"A bus drives at {first} miles per hour for {hours} hours, then at {second} miles per hour for {more} "
        f"more hours. How many miles does it drive in all?",
        [
            f"First it drives {first}*{hours} = <<{first}*{hours}={a}>>{a} miles.",
            f"Then it drives {second}*{more} = <<{second}*{more}={b}>>{b} miles.",
            f"In all it drives {a}+{b} = <<{a}+{b}={a + b}>>{a + b} miles.",
        ],
        a + b,
    )


def savings(rng: random.Random) -> Problem:
    name, weekly, weeks = rng.choice(NAMES), rng.randint(5, 25), rng.randint(3, 10)
    saved = weekly * weeks
    spent = rng.randint(1, saved - 1)
    return (
        f"{name} saves ${weekly} every week. After {weeks} weeks, {name} spends ${spent} on a bike helmet. "
        f"How many dollars does {name} have left?",
        [
            f"{name} saves {weekly}*{weeks} = <<{weekly}*{weeks}={saved}>>{saved} dollars.",
            f"{name} has {saved}-{spent} = <<{saved}-{spent}={saved - spent}>>{saved - spent} dollars left.",
        ],
        saved - spent,
    )


def garden(rng: random.Random) -> Problem:
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    planted = rows * per_row
    died = rng.randint(1, planted // 3)
    return (
        f"A farmer plants {rows} rows of tomato plants with {per_row} plants in each row. {died} of the plants "
        f"die in a storm. How many tomato plants are left?",
        [
            f"The farmer plants {rows}*{per_row} = <<{rows}*{per_row}={planted}>>{planted} plants.",
            f"{planted}-{died} = <<{planted}-{died}={planted - died}>>{planted - died} plants are left.",
        ],
        planted - died,
    )


def reading(rng: random.Random) -> Problem:
    name, monday = rng.choice(NAMES), rng.randint(8, 30)
    tuesday = 2 * monday
    read = monday + tuesday
    total = read + rng.randint(10, 120)
    return (
        f"{name} reads {monday} pages of a book on Monday and twice as many pages on Tuesday. The book has "
        f"{total} pages. How many pages are left to read?",
        [
            f"On Tuesday {name} reads 2*{monday} = <<2*{monday}={tuesday}>>{tuesday} pages.",
            f"So far {name} has read {monday}+{tuesday} = <<{monday}+{tuesday}={read}>>{read} pages.",
            f"There are {total}-{read} = <<{total}-{read}={total - read}>>{total - read} pages left.",
        ],
        total - read,
    )


def lunch(rng: random.Random) -> Problem:
    half = rng.randint(8, 20)
    students, buying = 2 * half, rng.randint(1, half - 1)
    return (
        f"A class has {students} students. Half of them bring lunch from home, and {buying} of the others buy "
        f"lunch at school. How many students do neither?",
        [
            f"{students}/2 = <<{students}/2={half}>>{half} students bring lunch from home.",
            f"{students}-{half} = <<{students}-{half}={half}>>{half} students do not bring lunch.",
            f"{half}-{buying} = <<{half}-{buying}={half - buying}>>{half - buying} students do neither.",
        ],
        half - buying,
    )


def baking(rng: random.Random) -> Problem:
    name, trays, bag, bags_per_tray = rng.choice(NAMES), rng.randint(2, 6), rng.choice([2, 3, 4, 6]), rng.randint(2, 5)
    per_tray = bag * bags_per_tray
    cookies = trays * per_tray
    return (
        f"{name} bakes {trays} trays of cookies with {per_tray} cookies on each tray and packs them in bags of "
        f"{bag}. How many bags does {name} fill?",
        [
            f"{name} bakes {trays}*{per_tray} = <<{trays}*{per_tray}={cookies}>>{cookies} cookies.",
            f"{name} fills {cookies}/{bag} = <<{cookies}/{bag}={cookies // bag}>>{cookies // bag} bags.",
        ],
        cookies // bag,
    )


def ages(rng: random.Random) -> Problem:
    name, age, times, years = rng.choice(NAMES), rng.randint(4, 12), rng.randint(3, 5), rng.randint(2, 10)
    mother = age * times
    return (
        f"{name} is {age} years old. {name}'s mother is {times} times as old as {name}. How old will the mother "
        f"be in {years} years?",
        [
            f"The mother is {age}*{times} = <<{age}*{times}={mother}>>{mother} years old.",
            f"In {years} years she will be {mother}+{years} = <<{mother}+{years}={mother + years}>>{mother + years}.",
        ],
        mother + years,
    )


def wages(rng: random.Random) -> Problem:
    name, rate, hours, days = rng.choice(NAMES), rng.randint(9, 25), rng.randint(3, 8), rng.randint(2, 6)
    daily = rate * hours
    return (
        f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. How many dollars does "
        f"{name} earn in all?",
        [
            f"Each day {name} earns {rate}*{hours} = <<{rate}*{hours}={daily}>>{daily} dollars.",
            f"In {days} days {name} earns {daily}*{days} = <<{daily}*{days}={daily * days}>>{daily * days} dollars.",
        ],
        daily * days,
    )


KINDS: list[Callable[[random.Random], Problem]] = [
    shopping,
    sharing,
    travel,
    savings,
    garden,
    reading,
    lunch,
    baking,
    ages,
    wages,
]


def rows(rng: random.Random, count: int, seen: set[str]) -> list[dict]:
    out = []
    while len(out) < count:
        question, lines, answer = KINDS[len(out) % len(KINDS)](rng)
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": "\n".join(lines) + f"\n#### {answer}"})
    return out


if __name__ == "__main__":
    here = Path(__file__).parent
    rng = random.Random(2027)
    seen: set[str] = set()
    for name, count in (("train.jsonl", 64), ("test.jsonl", 16)):
        (here / name).write_text("".join(json.dumps(row) + "\n" for row in rows(rng, count, seen)))
