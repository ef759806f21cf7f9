"""Rewards that never kill a run: a call that raises, hangs past its deadline or returns a
non-finite number gives its samples the task's failure reward and is counted; past the
configured error rate the job stops with a message that says why."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from rlmesh.rewards.base import RewardFunction, RewardItem, RewardResult

log = structlog.get_logger()

PER_SAMPLE_CONCURRENCY = 8
"""Samples a per-sample function scores at once (each in its own deadline)."""


class RewardErrorRateExceeded(RuntimeError):
    """Too many samples of a task failed to score: the job stops."""


@dataclass(slots=True)
class RewardCounters:
    scored: int = 0
    failed: int = 0
    timed_out: int = 0
    last_error: str = ""


class GuardedReward:
    """Wraps any reward function. Per-sample functions (`per_sample` true, with `score_one`) get
    a deadline per sample, so one hung sample fails alone; batched ones a deadline per call."""

    def __init__(
        self,
        task: str,
        inner: RewardFunction,
        timeout_seconds: float,
        failure_reward: float,
        max_error_rate: float,
        error_window: int,
    ) -> None:
        self.task = task
        self.inner = inner
        self.timeout = timeout_seconds
        self.failure_reward = failure_reward
        self.max_error_rate = max_error_rate
        self.window: deque[bool] = deque(maxlen=error_window)
        self.counters = RewardCounters()

    def _failure(self, error: str) -> RewardResult:
        return RewardResult(self.failure_reward, {}, None, error)

    async def _one(self, item: RewardItem, limit: asyncio.Semaphore) -> RewardResult:
        async with limit:
            try:
                return await asyncio.wait_for(self.inner.score_one(item), self.timeout)  # type: ignore[attr-defined]
            except TimeoutError:
                return self._failure(f"timed out after {self.timeout:g} s")
            except Exception as exc:  # noqa: BLE001 - any failure of user code is the sample's, not the run's
                return self._failure(f"{type(exc).__name__}: {exc}")

    async def _batch(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        try:
            results = await asyncio.wait_for(self.inner.score(items), self.timeout)
        except TimeoutError:
            return [self._failure(f"timed out after {self.timeout:g} s")] * len(items)
        except Exception as exc:  # noqa: BLE001
            return [self._failure(f"{type(exc).__name__}: {exc}")] * len(items)
        if len(results) != len(items):
            return [self._failure(f"{len(results)} results for {len(items)} samples")] * len(items)
        return results

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """One result per item; raises RewardErrorRateExceeded when the recent failure rate is too high."""
        if not items:
            return []
        if getattr(self.inner, "per_sample", False):
            limit = asyncio.Semaphore(PER_SAMPLE_CONCURRENCY)
            results = list(await asyncio.gather(*(self._one(item, limit) for item in items)))
        else:
            results = await self._batch(items)
        checked = []
        for item, result in zip(items, results):
            if not result.failed and not math.isfinite(result.reward):
                result = self._failure(f"reward is {result.reward}")
            if (
                not result.failed
                and result.token_rewards is not None
                and len(result.token_rewards) != len(item.completion_token_ids)
            ):
                result = self._failure(
                    f"{len(result.token_rewards)} token rewards for {len(item.completion_token_ids)} tokens"
                )
            elif result.failed and result.reward != self.failure_reward:
                result = self._failure(result.error)
            checked.append(result)
            self.window.append(result.failed)
            self.counters.scored += 1
            if result.failed:
                self.counters.failed += 1
                self.counters.timed_out += result.error.startswith("timed out")
                self.counters.last_error = result.error
        failures = [r for r in checked if r.failed]
        if failures:
            log.warning(
                "rewards failed", task=self.task, failed=len(failures), of=len(checked), error=failures[-1].error
            )
        self._check_rate()
        return checked

    def _check_rate(self) -> None:
        if len(self.window) < self.window.maxlen:  # type: ignore[operator]
            # Too few samples yet to judge a rate; a handful of early failures must not stop a job.
            if sum(self.window) <= self.max_error_rate * (self.window.maxlen or 1):
                return
        rate = sum(self.window) / len(self.window)
        if rate > self.max_error_rate:
            raise RewardErrorRateExceeded(
                f"task {self.task!r}: {sum(self.window)} of the last {len(self.window)} samples failed to score "
                f"({rate:.0%}, limit reward.max_error_rate = {self.max_error_rate:.0%}); last error: "
                f"{self.counters.last_error}"
            )

    async def close(self) -> None:
        await self.inner.close()
