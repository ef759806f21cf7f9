"""Writes this example's dataset: numbers and their nines' complement (each digit d becomes 9 - d),
2,000 training rows and 128 held-out rows, as JSONL. Run it again to regenerate the files."""

import json
import random
from pathlib import Path


def rows(rng: random.Random, count: int, exclude: set[str]) -> list[dict]:
    out = []
    while len(out) < count:
        number = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 8)))
        if number not in exclude:
            exclude.add(number)
            out.append({"number": number, "complement": "".join(str(9 - int(d)) for d in number)})
    return out


if __name__ == "__main__":
    here = Path(__file__).parent
    rng = random.Random(2026)
    seen: set[str] = set()
    for name, count in (("train.jsonl", 2000), ("held_out.jsonl", 128)):
        (here / name).write_text("".join(json.dumps(row) + "\n" for row in rows(rng, count, seen)))
