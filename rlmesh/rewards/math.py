"""The `math` built-in reward: the completion's final answer checked against `answer` by math-verify
(a maintained verifier that parses \\boxed{}, LaTeX and plain numbers and compares them symbolically);
a GSM8K answer, a worked solution ending in `#### N`, is checked against N."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from functools import lru_cache

from math_verify import parse, verify

from rlmesh.rewards.base import RewardItem, RewardResult

BOXED = re.compile(r"\\boxed\s*\{\s*[^\s}]")
"""A \\boxed{...} with something in it."""
GSM8K_MARK = "####"
"""What precedes the final answer in a GSM8K answer (`...\\n#### 72`)."""


def final_answer(answer: str) -> str:
    """What follows the last `####` of a GSM8K-style answer; any other answer as it is."""
    return answer.rsplit(GSM8K_MARK, 1)[1].strip() if GSM8K_MARK in answer else answer


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # The n samples of a group share one answer. math-verify's signal-based timeouts only work in
    # the main thread, so they are off; the reward guard's per-sample deadline bounds a slow parse.
    gold = parse(answer, parsing_timeout=None)
    if not gold:
        # A bare expression such as `x+1` or `\sqrt{2}` is only recognised as LaTeX between dollars.
        gold = parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the answer {answer!r}")
    return tuple(gold)


def check(completion: str, answer: str) -> RewardResult:
    """1 when math-verify finds the completion's answer equal to `answer` (its final answer, for a
    GSM8K-style one), else 0."""
    gold = _parse_gold(final_answer(answer))
    predicted = parse(completion, parsing_timeout=None)
    correct = bool(predicted) and verify(list(gold), predicted, timeout_seconds=None)
    return RewardResult(float(correct), {"correct": float(correct), "formatted": float(bool(BOXED.search(completion)))})


class MathReward:
    """Per-sample: parsing runs SymPy, so each sample is checked in a worker thread and the event
    loop stays free for the trainer's streams."""

    per_sample = True

    async def score_one(self, item: RewardItem) -> RewardResult:
        if "answer" not in item.metadata:
            raise ValueError(f"the prompt's metadata has no 'answer' to check against (keys: {sorted(item.metadata)})")
        return await asyncio.to_thread(check, item.completion, str(item.metadata["answer"]))

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        return [await self.score_one(item) for item in items]

    async def close(self) -> None:
        return None
