"""The word problems' reward with partial credit: math-verify's verdict (1 for a right answer), plus
0.1 for a boxed answer and up to 0.3 for a boxed number close to the answer. The tiny chat model
almost never answers right, so correctness alone gave RL nearly no signal: its format decayed
(from 0.99 to 0.06 boxed) and nothing was learned; these terms keep a signal in every group."""

import math
import re

from rlmesh.rewards.base import RewardResult
from rlmesh.rewards.math import check

BOXED_NUMBER = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)")


def score(completion: str, answer: str) -> RewardResult:
    verdict = check(completion, str(answer))
    target = float(answer)
    numbers = BOXED_NUMBER.findall(completion)
    close = math.exp(-abs(float(numbers[-1]) - target) / max(1.0, abs(target))) if numbers else 0.0
    formatted = verdict.components["formatted"]
    return RewardResult(
        verdict.reward + 0.1 * formatted + 0.3 * close,
        {"correct": verdict.reward, "formatted": formatted, "close": close},
    )
