"""The GRPO training loop over the mesh, run by rank 0: draw each step's prompts from the job's
tasks and submit them ahead within the staleness bound, score and train on micro-batches as they
stream in, step the optimizer per mini-batch, publish every version. The policy is sharded over
the trainer's ranks; every torch operation on it is a command all ranks run together (`ranks.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import structlog
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.rewards.base import RewardItem, RewardResult
from rlmesh.tasks.base import SourceExhausted, TaskPrompt
from rlmesh.tasks.build import Task, TaskMixture, build_task
from rlmesh.trainer.v1 import trainer_pb2
from services.trainer.batching import TrainingSample
from services.trainer.checkpoint import TrainerState, latest_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import EvalRequest, EvalResponses
from services.trainer.grpo import group_advantages
from services.trainer.mesh import MeshClient
from services.trainer.metrics import MetricsWriter
from services.trainer.policy import MicroBatchStats
from services.trainer.ranks import (Checkpoint, CollectiveFailure, Evaluate, OptimizerStep, Publish, PublishResult, RankGroup,
                                    Resume, Train)

log = structlog.get_logger()

PUBLISH_RETRY_FIRST_SECONDS = 0.5
PUBLISH_RETRY_MAX_SECONDS = 8.0
WEIGHTS_CHECK_SECONDS = 2.0
"""While waiting for rollouts, how often the weights service is asked whether it still holds the
latest version (a restarted one holds none, and no instance could then catch up)."""


class RolloutsUnavailable(RuntimeError):
    """The manager says a step's rollouts cannot come (no rollout instance left for too long)."""


@dataclass(slots=True)
class TrainingStatus:
    """What GetTrainingStatus reports; updated by the loop."""

    total_steps: int
    output_dir: str
    phase: int = trainer_pb2.PHASE_STARTING
    step: int = 0
    version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass(slots=True)
class Submitted:
    """A prompt in flight: which task it came from, and what the policy saw."""

    task: Task
    prompt: TaskPrompt
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class TaskTotals:
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0

    def add(self, result: RewardResult) -> None:
        self.rewards.append(result.reward)
        self.failures += result.failed
        for name, value in result.components.items():
            self.components.setdefault(name, []).append(value)

    def metrics(self, prefix: str) -> dict[str, float]:
        values = {f"{prefix}reward": sum(self.rewards) / len(self.rewards), f"{prefix}reward_failures": float(self.failures)}
        values.update({f"{prefix}{name}": sum(v) / len(v) for name, v in self.components.items()})
        return values


SOLVED = 1.0 - 1e-9
"""A sample with at least this reward earned the full reward (for the 0..1 rewards of the built-in tasks: exact)."""


@dataclass(slots=True)
class StepTotals:
    rewards: list[float] = field(default_factory=list)
    per_task: dict[str, TaskTotals] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    response_tokens: int = 0
    wait_seconds: float = 0.0
    """Time spent waiting for the next micro-batch of rollouts."""
    loss: float = 0.0
    kl: list[float] = field(default_factory=list)
    clip_fraction: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)


class GrpoTrainer:
    def __init__(self, config: TrainerConfig, mesh: MeshClient, status: TrainingStatus, group: RankGroup) -> None:
        self.config = config
        self.mesh = mesh
        self.status = status
        self.group = group
        self.output = Path(config.output_dir)
        self.output.mkdir(parents=True, exist_ok=True)
        self.tokenizer = group.policy.tokenizer
        self.stop_ids = group.policy.stop_ids
        self.mixture = TaskMixture([build_task(t, self.tokenizer, config.seed, config.python_path) for t in config.tasks], config.seed)
        self.metrics = MetricsWriter(self.output)
        self.checkpoints = group.checkpoints
        self.ledger_path = self.output / "rollouts.jsonl"
        self._ledger_file = self.ledger_path.open("a", buffering=1)
        self.in_flight: dict[tuple[str, str], Submitted] = {}
        self.cursors_before: dict[int, dict[str, int]] = {}
        """Every task's cursor before a step's prompts were drawn: what a checkpoint of that step saves."""
        self.run_tag = uuid.uuid4().hex[:8]
        self.mini_batch_groups = config.prompts_per_step // config.mini_batches_per_step
        self.unread_batches: set[str] = set()
        self.total_steps = config.steps
        self.published_version = -1
        self.stepped_since_publish = False
        """The optimizer stepped after the last publish: the policy is no longer that version."""

    def _sampling(self, task: Task) -> common_pb2.SamplingParams:
        sampling = task.config.sampling
        return common_pb2.SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                         max_tokens=task.config.max_tokens, stop_token_ids=self.stop_ids)

    def _ledger(self, record: dict) -> None:
        self._ledger_file.write(json.dumps(record) + "\n")

    def _batch_id(self, step: int) -> str:
        return f"{self.run_tag}-step{step:06d}"

    async def run(self) -> dict:
        started = time.perf_counter()
        state = TrainerState(step=0, version=0)
        checkpoint = latest_checkpoint(self.checkpoints) if self.config.resume else None
        if checkpoint is not None:
            state = await self.group.lead(Resume(str(checkpoint)))
            self.mixture.restore(state.task_cursors)
            log.info("resumed", checkpoint=str(checkpoint), step=state.step, task_cursors=state.task_cursors)
        manager = await self.mesh.manager_status()
        stored = await self.mesh.stored_version()
        # Versions only grow: a policy restarted on a mesh that already holds versions is published above them.
        if stored >= state.version or manager.published_version > state.version:
            state.version = max(stored, manager.published_version) + 1
        version_offset = state.version - state.step
        await self._publish(state.version)
        self.status.phase = trainer_pb2.PHASE_TRAINING
        self.status.step, self.status.version = state.step, state.version
        first_eval = last_eval = await self._evaluate(state.step)
        try:
            while state.step < self.total_steps:
                for ahead in range(state.step, min(self.total_steps, state.step + manager.max_staleness + 1)):
                    if self._batch_id(ahead) not in self.unread_batches and not await self._submit(ahead, ahead + version_offset):
                        break
                if state.step >= self.total_steps:
                    break
                await self._step(state, version_offset)
                last_step = state.step == self.total_steps
                if state.step % self.config.eval_every == 0 or last_step:
                    last_eval = await self._evaluate(state.step)
                if state.step % self.config.checkpoint_every == 0 or last_step:
                    # The last one also holds the whole policy as an HF folder.
                    cursors = self.cursors_before.get(state.step, self.mixture.cursors())
                    await self.group.lead(Checkpoint(TrainerState(state.step, state.version, cursors), export_hf=last_step))
                self.cursors_before = {s: c for s, c in self.cursors_before.items() if s >= state.step}
        finally:
            await self._cancel_unread_batches()
            await self.mixture.close()
            self._ledger_file.close()
        plot = self.metrics.plot()
        self.metrics.close()
        summary = {
            "steps": state.step,
            "weight_version": state.version,
            "wall_seconds": time.perf_counter() - started,
            "start": first_eval,
            "end": last_eval,
            "metrics": str(self.metrics.jsonl_path),
            "tensorboard": str(self.metrics.tensorboard_dir),
            "plot": str(plot),
            "ledger": str(self.ledger_path),
            "checkpoint": str(latest_checkpoint(self.checkpoints)),
        }
        (self.output / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    async def _step(self, state: TrainerState, version_offset: int) -> None:
        """One training step on the batch submitted for it, then publish the new version."""
        step_started = time.perf_counter()
        totals = await self._train_step(state.step, state.step + version_offset)
        state.step += 1
        state.version = state.step + version_offset
        published = await self._publish(state.version)
        step_seconds = time.perf_counter() - step_started
        balance = await self._report_step(self._batch_id(state.step - 1), step_seconds, totals.wait_seconds)
        values = {
            "reward": sum(totals.rewards) / len(totals.rewards),
            "exact_match": sum(r >= SOLVED for r in totals.rewards) / len(totals.rewards),
            "reward_failures": float(sum(t.failures for t in totals.per_task.values())),
            "loss": totals.loss,
            "kl": sum(totals.kl) / len(totals.kl),
            "clip_fraction": sum(totals.clip_fraction) / len(totals.clip_fraction),
            "staleness_mean": sum(totals.staleness) / len(totals.staleness),
            "staleness_max": float(max(totals.staleness)),
            "step_seconds": step_seconds,
            "generated_tokens_per_second": totals.response_tokens / step_seconds,
            "response_length": totals.response_tokens / len(totals.rewards),
            "publish_seconds": published.seconds,
            "publish_upload_seconds": published.upload_seconds,
            "publish_rank_bytes": float(max(published.rank_bytes)),
            "grad_norm": sum(totals.grad_norm) / len(totals.grad_norm),
            "rollout_wait_seconds": totals.wait_seconds,
            "weight_version": float(state.version),
            **balance,
        }
        for name, task_totals in totals.per_task.items():
            values.update(task_totals.metrics(f"task/{name}/"))
        self.metrics.write(state.step, values)
        self.status.step, self.status.version = state.step, state.version
        self.status.metrics.update(values)
        log.info("step", step=state.step, reward=round(values["reward"], 4), loss=round(values["loss"], 4),
                 step_s=round(step_seconds, 3), publish_s=round(published.seconds, 4), staleness=values["staleness_mean"])

    async def _publish(self, version: int) -> PublishResult:
        """Every rank hands its shards to the weights service; then the manager learns the version.
        While the weights service is unreachable (restarting) the same version is handed over again,
        with backoff, for up to publish_timeout_seconds; ranks whose upload it already took are
        answered as before."""
        deadline = time.monotonic() + self.config.publish_timeout_seconds
        delay = PUBLISH_RETRY_FIRST_SECONDS
        while True:
            try:
                published: PublishResult = await self.group.lead(Publish(version))
                break
            except CollectiveFailure as exc:
                if not exc.retryable or time.monotonic() + delay > deadline:
                    raise
                log.warning("the weights service is unreachable; publishing the version again", weight_version=version,
                            retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(2 * delay, PUBLISH_RETRY_MAX_SECONDS)
        self.published_version, self.stepped_since_publish = version, False
        started = time.perf_counter()
        await self.mesh.announce(version)
        return replace(published, seconds=published.seconds + time.perf_counter() - started)

    async def _report_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> dict[str, float]:
        """Tells the manager how training and rollout compared; returns its balance estimate as metrics."""
        try:
            balance = await self.mesh.report_step(batch_id, step_seconds, min(wait_seconds, step_seconds))
        except grpc.aio.AioRpcError as exc:
            log.warning("could not report the step's timing", batch_id=batch_id, code=exc.code().name, error=exc.details())
            return {}
        return {
            "balance/recommended_rollout_instances": float(balance.recommended_rollout_instances),
            "balance/offload_fraction": balance.offload_fraction,
            "balance/local_window_seconds": balance.local_window_seconds,
            "balance/rollout_seconds": balance.rollout_seconds,
            "balance/train_seconds": balance.train_seconds,
        }

    async def _cancel_unread_batches(self) -> None:
        """Batches submitted ahead that this run will not read: free the rollout capacity they hold."""
        for batch_id in sorted(self.unread_batches):
            try:
                await self.mesh.cancel(batch_id)
            except grpc.aio.AioRpcError as exc:
                log.warning("could not cancel a batch", batch_id=batch_id, code=exc.code().name)
        self.unread_batches.clear()

    async def _submit(self, step: int, policy_version: int) -> bool:
        """Draws and submits a step's prompts; False (and the run ends before that step) when a
        task's dataset ran out of epochs."""
        batch_id = self._batch_id(step)
        cursors = self.mixture.cursors()
        try:
            drawn = self.mixture.draw(step, self.config.prompts_per_step)
        except SourceExhausted as exc:
            log.warning("a task ran out of prompts: training ends here", step=step, reason=str(exc))
            self.total_steps = step
            return False
        self.cursors_before[step] = cursors
        prompts = []
        for index, (task, prompt) in enumerate(drawn):
            prompt_id = f"p{index}"
            submitted = Submitted(task, prompt, *task.renderer.render(prompt))
            self.in_flight[(batch_id, prompt_id)] = submitted
            prompts.append((prompt_id, submitted.token_ids, self._sampling(task)))
        await self.mesh.submit(batch_id, policy_version, prompts, self.config.group_size, prompts[0][2])
        self.unread_batches.add(batch_id)
        self._ledger({"event": "submitted", "batch_id": batch_id, "step": step, "policy_version": policy_version,
                      "prompts": {pid: [task.name, prompt.uid] for pid, (task, prompt) in zip((p for p, _, _ in prompts), drawn)},
                      "group_size": self.config.group_size})
        return True

    async def _train_step(self, step: int, policy_version: int) -> StepTotals:
        batch_id = self._batch_id(step)
        totals = StepTotals()
        done_waiting = asyncio.Event()
        watcher = asyncio.create_task(self._watch_weights(done_waiting))
        try:
            await self._stream_step(batch_id, step, policy_version, totals)
        finally:
            done_waiting.set()
            await watcher
        return totals

    async def _watch_weights(self, done: asyncio.Event) -> None:
        """Hands the latest version over again if the weights service lost it (it was restarted)
        while the policy is still that version; otherwise no instance could reach the version
        the staleness gate asks for, and the step's rollouts would never come."""
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), WEIGHTS_CHECK_SECONDS)
                return
            except TimeoutError:
                pass
            if self.stepped_since_publish or self.published_version < 0:
                continue
            try:
                stored = await self.mesh.stored_version()
            except grpc.aio.AioRpcError:
                continue
            if stored < self.published_version:
                log.warning("the weights service lost the latest version (restarted?); handing it over again",
                            weight_version=self.published_version, stored_version=stored)
                try:
                    await self._publish(self.published_version)
                except (CollectiveFailure, grpc.aio.AioRpcError) as exc:
                    log.warning("could not hand the latest version over again", weight_version=self.published_version, error=str(exc))

    async def _stream_step(self, batch_id: str, step: int, policy_version: int, totals: StepTotals) -> None:
        """Trains on the step's micro-batches as they stream in; steps the optimizer per mini-batch."""
        config = self.config
        groups_in_mini_batch = 0
        async with asyncio.timeout(config.rollout_timeout_seconds):
            try:
                waiting_since = time.perf_counter()
                async for groups in self.mesh.rollouts(
                    batch_id, config.micro_batch_groups, config.min_micro_batch_groups, config.micro_batch_max_tokens,
                    config.rollout_timeout_seconds,
                ):
                    totals.wait_seconds += time.perf_counter() - waiting_since
                    samples = await self._score(batch_id, groups, policy_version, totals)
                    stats: MicroBatchStats = await self.group.lead(Train(samples))
                    totals.loss += stats.loss
                    totals.kl.append(stats.kl)
                    totals.clip_fraction.append(stats.clip_fraction)
                    groups_in_mini_batch += len(groups)
                    if groups_in_mini_batch >= self.mini_batch_groups:
                        totals.grad_norm.append(await self._optimizer_step())
                        groups_in_mini_batch = 0
                    waiting_since = time.perf_counter()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise RolloutsUnavailable(f"step {step}: the manager cannot deliver rollouts: {exc.details()}") from exc
                raise
        self.unread_batches.discard(batch_id)
        if groups_in_mini_batch:
            totals.grad_norm.append(await self._optimizer_step())

    async def _optimizer_step(self) -> float:
        self.stepped_since_publish = True
        return await self.group.lead(OptimizerStep())

    def _completion(self, token_ids) -> str:
        """A response's text: its tokens without the final stop token, special tokens removed."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _score_groups(self, keyed: list[tuple[Submitted, list[RewardItem]]]) -> list[list[RewardResult]]:
        """Each task scores its own items, all tasks at once; results come back per group."""
        by_task: dict[str, list[RewardItem]] = {}
        for submitted, items in keyed:
            by_task.setdefault(submitted.task.name, []).extend(items)
        names = list(by_task)
        scored = await asyncio.gather(*(self.mixture.by_name[n].reward.score(by_task[n]) for n in names))
        results = {n: iter(r) for n, r in zip(names, scored)}
        return [[next(results[s.task.name]) for _ in items] for s, items in keyed]

    async def _score(self, batch_id: str, groups: list[manager_pb2.Group], policy_version: int, totals: StepTotals) -> list[TrainingSample]:
        keyed = []
        for group in groups:
            submitted = self.in_flight[(batch_id, group.prompt_id)]
            items = []
            for index, sample in enumerate(group.samples):
                items.append(RewardItem(f"{batch_id}/{group.prompt_id}/{index}", submitted.text, self._completion(sample.token_ids),
                                        submitted.prompt.metadata, list(sample.token_ids)))
            keyed.append((submitted, items))
        scored = await self._score_groups(keyed)
        samples: list[TrainingSample] = []
        for group, (submitted, _), results in zip(groups, keyed, scored):
            del self.in_flight[(batch_id, group.prompt_id)]
            task_totals = totals.per_task.setdefault(submitted.task.name, TaskTotals())
            rewards = [r.reward for r in results]
            for sample, result in zip(group.samples, results):
                task_totals.add(result)
                totals.staleness.append(policy_version - min(sample.weight_versions))
                totals.response_tokens += len(sample.token_ids)
            totals.rewards += rewards
            advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64)[None])[0].tolist()
            temperature = submitted.task.config.sampling.temperature
            for sample, advantage, result in zip(group.samples, advantages, results):
                samples.append(TrainingSample(list(group.prompt_token_ids), list(sample.token_ids), list(sample.logprobs), advantage,
                                              temperature, list(result.token_rewards) if result.token_rewards is not None else None))
            self._ledger({"event": "received", "batch_id": batch_id, "prompt_id": group.prompt_id, "task": submitted.task.name,
                          "uid": submitted.prompt.uid, "samples": len(group.samples), "rewards": rewards,
                          "min_version": min(min(s.weight_versions) for s in group.samples),
                          "max_version": max(max(s.weight_versions) for s in group.samples)})
        return samples

    async def _evaluate(self, step: int) -> dict[str, float]:
        """Every task's held-out prompts: sampled reward, greedy reward, and the share solved greedily."""
        values: dict[str, float] = {}
        pooled: dict[str, list[float]] = {"sampled": [], "greedy": []}
        for task in self.mixture.tasks:
            held_out = task.source.held_out(task.config.eval.prompts)
            texts, ids = zip(*(task.renderer.render(p) for p in held_out))
            sampling = task.config.sampling
            request = EvalRequest(list(ids), task.config.max_tokens,
                                  task.config.eval.samples, sampling.temperature, sampling.top_p, self.config.seed + step)
            responses: EvalResponses = await self.group.lead(Evaluate(request))
            prompts = held_out * task.config.eval.samples + held_out
            rendered = texts * task.config.eval.samples + texts
            items = []
            for index, (prompt, text, ids) in enumerate(zip(prompts, rendered, responses.sampled + responses.greedy)):
                items.append(RewardItem(f"eval-{step}-{index}", text, self._completion(ids), prompt.metadata, ids))
            results = [r.reward for r in await task.reward.score(items)]
            sampled, greedy = results[: len(responses.sampled)], results[len(responses.sampled):]
            pooled["sampled"] += sampled
            pooled["greedy"] += greedy
            values.update({
                f"eval/{task.name}/sampled_reward": sum(sampled) / len(sampled),
                f"eval/{task.name}/greedy_reward": sum(greedy) / len(greedy),
                f"eval/{task.name}/exact_match": sum(r >= SOLVED for r in greedy) / len(greedy),
            })
        values.update({
            "eval/sampled_reward": sum(pooled["sampled"]) / len(pooled["sampled"]),
            "eval/greedy_reward": sum(pooled["greedy"]) / len(pooled["greedy"]),
            "eval/exact_match": sum(r >= SOLVED for r in pooled["greedy"]) / len(pooled["greedy"]),
        })
        self.metrics.write(step, values)
        self.status.metrics.update(values)
        log.info("held-out evaluation", step=step, **{k: round(v, 4) for k, v in values.items()})
        return values
