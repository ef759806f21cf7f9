"""Scoring a batch's finished groups: each task's reward over its samples (all tasks at once), the
registered reward shapers' terms, and the frozen reference's log-probabilities when the reference
runs in a process of its own."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from rlmesh.manager.v1 import manager_pb2
from rlmesh.rewards.base import RewardItem, RewardResult
from rlmesh.tasks.build import TaskMixture
from services.trainer.algorithms.shaping import ShapingInput, shape
from services.trainer.config import TrainerConfig
from services.trainer.pipeline import PromptRecord, ScoredGroup, StepPlan
from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.reference import ReferenceWorker
from services.trainer.trajectories import MASKED_STATUSES, figures_of, parts_of, trajectory_reward, transcript_ids


class GroupScorer:
    def __init__(self, config: TrainerConfig, mixture: TaskMixture, tokenizer, stop_ids: list[int]) -> None:
        self.config = config
        self.mixture = mixture
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.reference: ReferenceWorker | None = None
        """The frozen reference's own process (placement: ref_logp apart), started by the trainer's run."""

    def completion(self, token_ids) -> str:
        """A response's text: its tokens without the final stop token, special tokens removed."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _score_groups(self, keyed: list[tuple[PromptRecord, list[RewardItem]]]) -> list[list[RewardResult]]:
        """Each task scores its own items, all tasks at once; results come back per group."""
        by_task: dict[str, list[RewardItem]] = {}
        for record, items in keyed:
            by_task.setdefault(record.task, []).extend(items)
        names = list(by_task)
        scored = await asyncio.gather(*(self.mixture.by_name[n].reward.score(by_task[n]) for n in names))
        results = {n: iter(r) for n, r in zip(names, scored)}
        return [[next(results[record.task]) for _ in items] for record, items in keyed]

    async def score(self, batch_id: str, plan: StepPlan, groups: list[manager_pb2.Group]) -> list[ScoredGroup]:
        episodes = [g for g in groups if g.samples and g.samples[0].HasField("session")]
        groups = [g for g in groups if not (g.samples and g.samples[0].HasField("session"))]
        accepted = [await self._score_episodes(batch_id, plan.outstanding[g.prompt_id], g) for g in episodes]
        keyed = []
        for group in groups:
            record = plan.outstanding[group.prompt_id]
            items = [
                RewardItem(
                    f"{batch_id}/{group.prompt_id}/{index}",
                    record.text,
                    self.completion(sample.token_ids),
                    record.prompt.metadata,
                    list(sample.token_ids),
                )
                for index, sample in enumerate(group.samples)
            ]
            keyed.append((record, items))
        scored = await self._score_groups(keyed) if keyed else []
        for group, (record, items), results in zip(groups, keyed, scored):
            results = self._shape_rewards(record, group, results)
            temperature = self.mixture.by_name[record.task].config.sampling.temperature
            # The advantage is the estimator's, over the groups the sample is trained with (`group_advantages.py`).
            samples = [
                TrainingSample(
                    list(group.prompt_token_ids),
                    list(sample.token_ids),
                    list(sample.logprobs),
                    0.0,
                    temperature,
                    list(result.token_rewards) if result.token_rewards is not None else None,
                    reward=result.reward,
                    sample_id=item.sample_id,
                )
                for sample, result, item in zip(group.samples, results, items)
            ]
            accepted.append(
                ScoredGroup(record, batch_id, samples, results, [list(s.weight_versions) for s in group.samples])
            )
        await self.attach_reference(accepted)
        return accepted

    async def _score_episodes(self, batch_id: str, record: PromptRecord, group: manager_pb2.Group) -> ScoredGroup:
        """A group of multi-turn episodes: the failed ones masked out, each other trajectory's parts
        trained on its model tokens with the trajectory's reward (the environment's, or the task's
        reward over its whole transcript, every part of a broken history included)."""
        task = self.mixture.by_name[record.task]
        kept = [s.session for s in group.samples if s.session.status not in MASKED_STATUSES]
        if task.reward is not None:
            items = [
                RewardItem(
                    f"{batch_id}/{group.prompt_id}/{index}",
                    record.text,
                    self.transcript(trajectory),
                    record.prompt.metadata,
                    transcript_ids(trajectory),
                )
                for index, trajectory in enumerate(kept)
            ]
            results = await task.reward.score(items) if items else []
        else:
            results = [RewardResult(trajectory_reward(trajectory)) for trajectory in kept]
        temperature = task.config.sampling.temperature
        samples, owners, versions = [], [], []
        for owner, (trajectory, result) in enumerate(zip(kept, results)):
            parts = parts_of(trajectory)
            for number, part in enumerate(parts, 1):
                name = trajectory.session_id if len(parts) == 1 else f"{trajectory.session_id} part {number}"
                samples.append(
                    TrainingSample(
                        part.prompt_ids,
                        part.response_ids,
                        part.logprobs,
                        0.0,
                        temperature,
                        reward=result.reward,
                        response_mask=part.mask,
                        token_turns=part.turns,
                        sample_id=name,
                    )
                )
                owners.append(owner)
                versions.append(part.weight_versions)
        turn_rewards = [dict(t.turn_rewards) for t in kept] if task.config.environment.credit == "turn" else None
        scored = ScoredGroup(
            record,
            batch_id,
            samples,
            list(results),
            versions,
            owners,
            [figures_of(s.session) for s in group.samples],
            turn_rewards,
        )
        await self.attach_reference([scored])
        return scored

    def transcript(self, trajectory: manager_pb2.SessionTrajectory) -> str:
        """The trajectory's model output (`transcript_ids`: every part's, in order) as text, as a
        response's (held-out evaluation decodes its episodes the same way)."""
        return self.completion(transcript_ids(trajectory))

    async def attach_reference(self, groups: list[ScoredGroup]) -> None:
        """The reference worker's log-probabilities for the groups' samples that have none (placement:
        ref_logp apart), computed while the ranks train on other groups."""
        if self.reference is None:
            return
        samples = [s for g in groups for s in g.samples if s.reference_logprobs is None]
        for sample, logprobs in zip(samples, await self.reference.logprobs(samples)):
            sample.reference_logprobs = logprobs

    def _shape_rewards(
        self, record: PromptRecord, group: manager_pb2.Group, results: list[RewardResult]
    ) -> list[RewardResult]:
        """Every registered reward shaper's term added to each sample's reward (a component of its own)."""
        max_tokens = self.mixture.by_name[record.task].config.max_tokens
        shaped = []
        for sample, result in zip(group.samples, results):
            terms = shape(ShapingInput(len(sample.token_ids), max_tokens), self.config)
            if terms:
                result = replace(
                    result, reward=result.reward + sum(terms.values()), components={**result.components, **terms}
                )
            shaped.append(result)
        return shaped
