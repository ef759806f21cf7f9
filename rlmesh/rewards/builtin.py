"""Rewards shipped with rlmesh, chosen in a job by `reward.builtin`."""

from __future__ import annotations

from collections.abc import Sequence

from rlmesh.rewards.base import RewardItem, RewardResult
from rlmesh.tasks import increment


class IncrementReward:
    """The default task's reward: the share of correct characters against `answer` (partial
    credit), with `exact` as a component."""

    per_sample = True

    async def score_one(self, item: RewardItem) -> RewardResult:
        answer = str(item.metadata["answer"])
        completion = item.completion.strip()
        return RewardResult(
            increment.reward(completion, answer), {"exact": float(increment.exact_match(completion, answer))}
        )

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        return [await self.score_one(item) for item in items]

    async def close(self) -> None:
        return None
