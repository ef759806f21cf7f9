"""Held-out validation of a named policy version on spare rollout capacity, in the background: every
held-out prompt is submitted pinned to that exact version, scored by its task's reward when it
returns, and the figures are filed under the version while training goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.rewards.base import RewardItem
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.build import Task, TaskMixture
from services.trainer.episodes.driver import EpisodeDriver
from services.trainer.episodes.process import EpisodeProcess
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.mesh import MeshClient
from services.trainer.pipeline import prompt_seed
from services.trainer.ranks.commands import Evaluate, RankGroup
from services.trainer.ranks.evaluation import EvalRequest, EvalResponses
from services.trainer.scoring import GroupScorer
from services.trainer.tracking.tracker import HeldOutSample
from services.trainer.trajectories import (
    MASKED_STATUSES,
    EpisodeFigures,
    figures_of,
    trajectory_reward,
    transcript_ids,
    turn_reward_means,
)

log = structlog.get_logger()

SOLVED = 1.0 - 1e-9
"""A response with at least this reward earned the full reward (for the 0..1 rewards of the built-in tasks: exact)."""


@dataclass(slots=True)
class HeldOut:
    """One task's held-out prompts as the policy sees them."""

    task: Task
    prompts: list[TaskPrompt]
    texts: list[str]
    token_ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class PinnedBatch:
    """One task's held-out prompts submitted pinned to a version: sampled, or greedy (one each)."""

    batch_id: str
    held_out: HeldOut
    prompt_ids: list[str]
    samples: int
    greedy: bool
    episodes: list[EpisodeFigures] = field(default_factory=list)
    """Multi-turn: the held-out episodes, as they ended."""
    completions: list[str] = field(default_factory=list)
    """The responses as text, in round order ("" for a failed episode): filled by `score_held_out`."""


@dataclass(slots=True)
class ValidationFigures:
    """What one validation found: held-out sampled and greedy rewards and the greedy exact match,
    per task and pooled."""

    sampled: dict[str, list[float]] = field(default_factory=dict)
    greedy: dict[str, list[float]] = field(default_factory=dict)

    def values(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for name in self.sampled:
            sampled, greedy = self.sampled[name], self.greedy[name]
            values[f"eval/{name}/sampled_reward"] = sum(sampled) / len(sampled)
            values[f"eval/{name}/greedy_reward"] = sum(greedy) / len(greedy)
            values[f"eval/{name}/exact_match"] = sum(r >= SOLVED for r in greedy) / len(greedy)
        pooled_sampled = [r for rewards in self.sampled.values() for r in rewards]
        pooled_greedy = [r for rewards in self.greedy.values() for r in rewards]
        values["eval/sampled_reward"] = sum(pooled_sampled) / len(pooled_sampled)
        values["eval/greedy_reward"] = sum(pooled_greedy) / len(pooled_greedy)
        values["eval/exact_match"] = sum(r >= SOLVED for r in pooled_greedy) / len(pooled_greedy)
        return values


def held_out_rows(
    step: int, version: int, held_out: HeldOut, kind: str, completions: list[str], rewards: list[float]
) -> list[HeldOutSample]:
    """A task's held-out responses of one kind (`sampled`, `greedy`), in round order (response k of
    prompt i at k * prompts + i), as the experiment trackers' samples table shows them."""
    count = len(held_out.texts)
    return [
        HeldOutSample(
            step, version, held_out.task.name, kind, index // count, held_out.texts[index % count], text, reward
        )
        for index, (text, reward) in enumerate(zip(completions, rewards))
    ]


def held_out_sets(mixture: TaskMixture) -> list[HeldOut]:
    sets = []
    for task in mixture.tasks:
        prompts = task.source.held_out(task.config.eval.prompts)
        texts, ids = zip(*(task.renderer.render(p) for p in prompts))
        sets.append(HeldOut(task, list(prompts), list(texts), [list(i) for i in ids]))
    return sets


class BackgroundValidation:
    """Validations in flight, one per version asked for; `finish` waits for them all. A version no
    instance serves any more by the time its prompts are dispatched is reported as skipped."""

    def __init__(
        self,
        mixture: TaskMixture,
        mesh: MeshClient,
        completion: Callable[[list[int]], str],
        stop_ids: list[int],
        seed: int,
        run_tag: str,
        timeout_seconds: float,
        report: Callable[[int, dict[str, float]], None],
        low_priority: bool = True,
        report_samples: Callable[[int, list[HeldOutSample]], None] | None = None,
    ) -> None:
        self.held_out = held_out_sets(mixture)
        self.mesh = mesh
        self.completion = completion
        self.stop_ids = stop_ids
        self.seed = seed
        self.run_tag = run_tag
        self.timeout_seconds = timeout_seconds
        self.report = report
        self.report_samples = report_samples
        """Handed each validation's responses (the experiment trackers' samples table)."""
        self.low_priority = low_priority
        """Submitted as background work: instances decode it only with the CPU training leaves."""
        self.running: dict[int, asyncio.Task] = {}
        self.results: dict[int, dict[str, float]] = {}
        """Figures by the training step whose version was evaluated."""
        self.skipped: list[int] = []
        """Versions no instance served while their prompts waited (a newer push superseded theirs)."""
        self.retry_due = False
        """A validation was skipped: the next version published is validated in its place."""
        self.episodes: EpisodeDriver | EpisodeProcess | None = None
        self.episode_specs: dict[str, EpisodeSpec] = {}
        """Multi-turn tasks: their held-out prompts run as episodes (see `_submit`)."""

    async def start(self, step: int, version: int) -> None:
        """Submits the held-out prompts pinned to `version` (the policy after `step` steps) and reads
        them in the background. Called before the version is published, so that they are queued
        when an instance switches to it: while they run, it holds that version."""
        batches = []
        for index, held_out in enumerate(self.held_out):
            for greedy in (False, True):
                batches.append(await self._submit(held_out, index, step, version, greedy))
        self.running[step] = asyncio.create_task(
            self._validate(step, version, batches), name=f"validate version {version}"
        )

    async def finish(self) -> dict[int, dict[str, float]]:
        """Waits for every validation started; returns the figures by step."""
        await asyncio.gather(*self.running.values())
        self.running.clear()
        return self.results

    async def cancel(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        self.running.clear()

    def _sampling(self, held_out: HeldOut, step: int, prompt_id: str, greedy: bool) -> common_pb2.SamplingParams:
        config = held_out.task.config
        return common_pb2.SamplingParams(
            temperature=0.0 if greedy else config.sampling.temperature,
            top_p=config.sampling.top_p,
            max_tokens=config.max_tokens,
            stop_token_ids=self.stop_ids,
            seed=0 if greedy else prompt_seed(self.seed, step, f"eval-{prompt_id}"),
        )

    async def _submit(self, held_out: HeldOut, index: int, step: int, version: int, greedy: bool) -> PinnedBatch:
        kind = "greedy" if greedy else "sampled"
        batch_id = f"{self.run_tag}-eval-v{version:06d}-t{index}-{kind}"
        prompt_ids = [f"t{index}{kind[0]}{i}" for i in range(len(held_out.prompts))]
        samples = 1 if greedy else held_out.task.config.eval.samples
        prompts = [
            (pid, ids, self._sampling(held_out, step, pid, greedy)) for pid, ids in zip(prompt_ids, held_out.token_ids)
        ]
        spec = self.episode_specs.get(held_out.task.name)
        if spec is not None and self.episodes is not None:
            # Episodes are not pinned to the version (turns alternate with the environment's steps):
            # they run at the version under the staleness bound, on training's terms.
            await self.episodes.open(
                spec, batch_id, version, prompts, samples, dict(zip(prompt_ids, held_out.prompts)), counted=False
            )
        else:
            await self.mesh.submit(
                batch_id, version, prompts, samples, prompts[0][2], exact_version=True, background=self.low_priority
            )
        return PinnedBatch(batch_id, held_out, prompt_ids, samples, greedy)

    async def _validate(self, step: int, version: int, batches: list[PinnedBatch]) -> None:
        started = time.perf_counter()
        reading = [asyncio.create_task(self._read(batch)) for batch in batches]
        try:
            async with asyncio.timeout(self.timeout_seconds):
                rewards = await asyncio.gather(*reading)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            for task in reading:
                task.cancel()
            await asyncio.gather(*reading, return_exceptions=True)
            for batch in batches:
                try:
                    await self.mesh.cancel(batch.batch_id)
                except grpc.aio.AioRpcError:
                    pass  # failed batches are already forgotten by the manager
            reason = (
                exc.details()
                if isinstance(exc, grpc.aio.AioRpcError)
                else f"not done within {self.timeout_seconds:g} s"
            )
            log.warning(
                "validation skipped; the next version is validated instead",
                step=step,
                weight_version=version,
                reason=reason,
            )
            self.skipped.append(version)
            self.retry_due = True
            return
        figures = ValidationFigures()
        for batch, batch_rewards in zip(batches, rewards):
            (figures.greedy if batch.greedy else figures.sampled)[batch.held_out.task.name] = batch_rewards
        values = {
            **figures.values(),
            "eval/weight_version": float(version),
            "eval/seconds": time.perf_counter() - started,
        }
        for batch in batches:
            if batch.episodes:
                kind = "greedy" if batch.greedy else "sampled"
                values |= turn_reward_means(batch.episodes, f"eval/{batch.held_out.task.name}/{kind}_")
        self.results[step] = values
        self.report(step, values)
        if self.report_samples is not None:
            rows = [
                row
                for batch, batch_rewards in zip(batches, rewards)
                for row in held_out_rows(
                    step,
                    version,
                    batch.held_out,
                    "greedy" if batch.greedy else "sampled",
                    batch.completions,
                    batch_rewards,
                )
            ]
            self.report_samples(step, rows)
        log.info(
            "held-out evaluation", step=step, weight_version=version, **{k: round(v, 4) for k, v in values.items()}
        )

    async def _read(self, batch: PinnedBatch) -> list[float]:
        """A batch's responses, scored by its task's reward, in round order (response k of prompt i
        at k * prompts + i)."""
        groups: dict[str, manager_pb2.Group] = {}
        async for replies in self.mesh.rollouts(batch.batch_id, len(batch.prompt_ids), 1, 0, self.timeout_seconds):
            for group in replies:
                groups[group.prompt_id] = group
        return await score_held_out(batch, groups, self.completion)


async def score_held_out(
    batch: PinnedBatch, groups: dict[str, manager_pb2.Group], completion: Callable[[list[int]], str]
) -> list[float]:
    """A batch's groups (by prompt id) scored by its task's reward, in round order (response k of
    prompt i at k * prompts + i); its episodes, if any, filed on the batch. An episode is scored on
    its model output as training scores it (`transcript_ids`); one that failed (deadline,
    environment_error) counts 0, unscored: evaluation counts what the policy achieved."""
    held_out = batch.held_out
    samples = {pid: list(group.samples) for pid, group in groups.items()}
    batch.episodes.extend(figures_of(s.session) for group in samples.values() for s in group if s.HasField("session"))
    order = [
        (pid, k, text, prompt)
        for k in range(batch.samples)
        for pid, text, prompt in zip(batch.prompt_ids, held_out.texts, held_out.prompts)
    ]
    rewards = [0.0] * len(order)
    batch.completions[:] = [""] * len(order)
    scored = []
    for index, (pid, k, text, prompt) in enumerate(order):
        sample = samples[pid][k]
        episode = sample.session if sample.HasField("session") else None
        if episode is not None and episode.status in MASKED_STATUSES:
            continue
        response = transcript_ids(episode) if episode is not None else list(sample.token_ids)
        batch.completions[index] = completion(response)
        if held_out.task.reward is None:
            rewards[index] = trajectory_reward(episode) if episode is not None else 0.0
            continue
        scored.append(
            (
                index,
                RewardItem(f"{batch.batch_id}/{pid}/{k}", text, batch.completions[index], prompt.metadata, response),
            )
        )
    if scored:
        results = await held_out.task.reward.score([item for _, item in scored])
        for (index, _), result in zip(scored, results):
            rewards[index] = result.reward
    return rewards


async def evaluate_inline(
    group: RankGroup, scorer: GroupScorer, mixture: TaskMixture, seed: int, step: int, version: int
) -> tuple[ValidationFigures, list[HeldOutSample]]:
    """Held-out evaluation on the trainer's own policy (validation = "inline"): every rank generates,
    rank 0 scores each task's sampled and greedy responses with the task's reward."""
    figures = ValidationFigures()
    samples: list[HeldOutSample] = []
    for held_out in held_out_sets(mixture):
        task = held_out.task
        sampling = task.config.sampling
        request = EvalRequest(
            held_out.token_ids,
            task.config.max_tokens,
            task.config.eval.samples,
            sampling.temperature,
            sampling.top_p,
            seed,
        )
        responses: EvalResponses = await group.lead(Evaluate(request))
        completions = [scorer.completion(ids) for ids in responses.sampled + responses.greedy]
        results = await task.reward.score(
            [
                RewardItem(f"eval-{step}-{index}", text, completion, prompt.metadata, ids)
                for index, (prompt, text, completion, ids) in enumerate(
                    zip(
                        held_out.prompts * task.config.eval.samples + held_out.prompts,
                        held_out.texts * task.config.eval.samples + held_out.texts,
                        completions,
                        responses.sampled + responses.greedy,
                    )
                )
            ]
        )
        rewards = [r.reward for r in results]
        sampled = len(responses.sampled)
        figures.sampled[task.name] = rewards[:sampled]
        figures.greedy[task.name] = rewards[sampled:]
        samples += held_out_rows(step, version, held_out, "sampled", completions[:sampled], rewards[:sampled])
        samples += held_out_rows(step, version, held_out, "greedy", completions[sampled:], rewards[sampled:])
    return figures, samples
