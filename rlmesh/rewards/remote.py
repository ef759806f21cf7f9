"""A reward computed by a verifier behind `rlmesh.reward.v1.RewardService`, in any language: every
call has a deadline and carries the task's own credential (never a mesh role's), transient
failures are retried with backoff, big batches are split."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import grpc
import structlog

from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.rewards.base import RewardItem, RewardResult
from rlmesh.rpc.channels import call_options, open_user_channel

log = structlog.get_logger()

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
"""Statuses that say "not now" rather than "never": the verifier is down, slow or overloaded.
Score is a pure function of its request, so sending it again is safe."""


class RemoteRewardError(RuntimeError):
    """The verifier refused a batch, stayed unreachable through every retry, or answered nonsense."""


class RemoteReward:
    """Client of one verifier for one task. `max_batch_size` > 0 splits a batch into calls of at
    most that many items, sent concurrently; `bearer_token` (the task's reward.remote_credential)
    goes with every call when given."""

    def __init__(
        self,
        address: str,
        task: str,
        timeout_seconds: float,
        attempts: int,
        backoff_seconds: float,
        max_batch_size: int = 0,
        bearer_token: str = "",
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        if backoff_seconds < 0 or max_batch_size < 0:
            raise ValueError(
                f"backoff_seconds and max_batch_size must not be negative, got {backoff_seconds}, {max_batch_size}"
            )
        self.address = address
        self.task = task
        self.timeout = timeout_seconds
        self.attempts = attempts
        self.backoff = backoff_seconds
        self.max_batch_size = max_batch_size
        self.bearer_token = bearer_token
        # Opened on first use: a grpc.aio channel belongs to the event loop it was created in.
        self._channel: grpc.aio.Channel | None = None
        self._stub: reward_pb2_grpc.RewardServiceStub | None = None

    def _fail(self, what: str) -> RemoteRewardError:
        return RemoteRewardError(f"reward service at {self.address} (task {self.task!r}): {what}")

    async def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """One result per item, in order; raises RemoteRewardError when the batch cannot be scored."""
        if not items:
            return []
        size = self.max_batch_size or len(items)
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        calls = [asyncio.ensure_future(self._score_chunk(chunk)) for chunk in chunks]
        try:
            scored = await asyncio.gather(*calls)
        except BaseException:
            # The batch has failed as a whole: its other calls are not worth waiting for.
            for call in calls:
                call.cancel()
            raise
        return [result for chunk in scored for result in chunk]

    def _request(self, items: Sequence[RewardItem]) -> reward_pb2.ScoreRequest:
        return reward_pb2.ScoreRequest(
            task=self.task,
            items=[
                reward_pb2.ScoreItem(
                    sample_id=item.sample_id,
                    prompt=item.prompt,
                    completion=item.completion,
                    metadata_json=json.dumps(dict(item.metadata)),
                    completion_token_ids=list(item.completion_token_ids),
                )
                for item in items
            ],
        )

    async def _score_chunk(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        if self._stub is None:
            self._channel = open_user_channel(self.address, self.bearer_token)
            self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        request = self._request(items)
        for attempt in range(1, self.attempts + 1):
            try:
                reply = await self._stub.Score(request, **call_options(self.timeout))
                break
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in RETRYABLE:
                    raise self._fail(f"{code.name}: {exc.details()}") from exc
                if attempt == self.attempts:
                    raise self._fail(
                        f"{code.name} on all {self.attempts} attempts "
                        f"(deadline {self.timeout:g} s each): {exc.details()}"
                    ) from exc
                delay = self.backoff * 2 ** (attempt - 1)
                log.warning(
                    "reward call failed, retrying",
                    address=self.address,
                    task=self.task,
                    code=code.name,
                    attempt=attempt,
                    of=self.attempts,
                    retry_in_seconds=delay,
                )
                await asyncio.sleep(delay)
        return self._results(items, reply)

    def _results(self, items: Sequence[RewardItem], reply: reward_pb2.ScoreResponse) -> list[RewardResult]:
        if len(reply.results) != len(items):
            raise self._fail(f"OK with {len(reply.results)} results for {len(items)} items")
        results = []
        for item, result in zip(items, reply.results):
            if result.sample_id and result.sample_id != item.sample_id:
                raise self._fail(
                    f"OK with results out of order: sample {result.sample_id!r} where {item.sample_id!r} was sent"
                )
            if result.token_rewards and len(result.token_rewards) != len(item.completion_token_ids):
                raise self._fail(
                    f"OK with {len(result.token_rewards)} token rewards for sample {item.sample_id!r} "
                    f"of {len(item.completion_token_ids)} tokens"
                )
            results.append(
                RewardResult(
                    result.reward,
                    dict(result.components),
                    list(result.token_rewards) if result.token_rewards else None,
                    result.error,
                )
            )
        return results

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
