"""The training loop over the mesh, run by rank 0, whatever the algorithm (GRPO, RLOO, REINFORCE++,
PPO with a critic): draw each step's prompts from the job's tasks and submit them ahead within the
capacity rule, read and score every batch's groups as they finish, train on each step's accepted
groups in micro-batches, step the optimizer per mini-batch, publish every version. The policy is
sharded over the trainer's ranks; every torch operation on it is a command all ranks run together
(`ranks/commands.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import structlog

from rlmesh.common.v1 import common_pb2
from rlmesh.tasks.base import SourceExhausted, TaskPrompt
from rlmesh.tasks.build import Task, TaskMixture, build_task
from rlmesh.trainer.v1 import trainer_pb2
from services.trainer.algorithms.group_advantages import with_advantages
from services.trainer.config import TrainerConfig
from services.trainer.episodes.driver import EpisodeDriver
from services.trainer.episodes.process import EpisodeProcess, start_episodes
from services.trainer.episodes.spec import episode_specs
from services.trainer.mesh import MeshClient
from services.trainer.pipeline import (
    PromptRecord,
    StepPlan,
    dump_pipeline,
    load_pipeline,
    prompt_seed,
    submitted_batches,
    untrained_plans,
)
from services.trainer.publishing import VersionPublisher, publish_figures
from services.trainer.ranks.checkpoint import TrainerState, latest_checkpoint
from services.trainer.ranks.commands import BeginStep, Checkpoint, OptimizerStep, RankGroup, Resume, Train
from services.trainer.ranks.reference import ReferenceWorker
from services.trainer.scoring import GroupScorer
from services.trainer.step_totals import StepTotals, balance_metrics
from services.trainer.tracking.metrics import MetricsWriter
from services.trainer.tracking.runs import run_config, start_trackers
from services.trainer.validation import BackgroundValidation, evaluate_inline

log = structlog.get_logger()


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


EQUAL_REWARDS = 1e-9
"""A group whose rewards all lie within this of each other teaches nothing (dynamic sampling drops it)."""


class TrainingLoop:
    def __init__(self, config: TrainerConfig, mesh: MeshClient, status: TrainingStatus, group: RankGroup) -> None:
        self.config = config
        self.mesh = mesh
        self.status = status
        self.group = group
        self.output = Path(config.output_dir)
        self.output.mkdir(parents=True, exist_ok=True)
        self.tokenizer = group.policy.tokenizer
        self.stop_ids = group.policy.stop_ids
        self.mixture = TaskMixture(
            [build_task(t, self.tokenizer, config.seed, config.python_path) for t in config.tasks], config.seed
        )
        self.metrics = MetricsWriter(self.output)
        self.checkpoints = group.checkpoints
        self.ledger_path = self.output / "rollouts.jsonl"
        self._ledger_file = self.ledger_path.open("a", buffering=1)
        if self._ledger_file.tell() and not self.ledger_path.read_bytes().endswith(b"\n"):
            # A trainer killed mid-line: that record is lost, the next ones are not.
            self._ledger_file.write("\n")
        self.plans: dict[int, StepPlan] = {}
        """Every step submitted and not yet trained."""
        self.collectors: dict[str, asyncio.Task] = {}
        """A task per batch reading its groups as they finish, scoring them and accepting them into its step's plan."""
        self._arrived = asyncio.Condition()
        self._collector_error: Exception | None = None
        self.run_tag = uuid.uuid4().hex[:8]
        self.mini_batch_groups = config.prompts_per_step // config.mini_batches_per_step
        self.total_steps = config.steps
        self.version_offset = 0
        self.max_staleness = 0
        self.publisher = VersionPublisher(group, mesh, self._file_metrics)
        self.scorer = GroupScorer(config, self.mixture, self.tokenizer, self.stop_ids)
        self.validation = (
            BackgroundValidation(
                self.mixture,
                mesh,
                self.scorer.completion,
                self.stop_ids,
                config.seed,
                self.run_tag,
                config.rollout_timeout_seconds,
                self._file_metrics,
                low_priority=config.validation_priority == "low",
                report_samples=self.metrics.write_samples,
            )
            if config.validation == "background"
            else None
        )
        self.evaluations: dict[int, dict[str, float]] = {}
        """Inline evaluations by step (background ones are kept by `validation`)."""
        self.episode_specs = episode_specs(
            self.mixture,
            self.tokenizer,
            self.stop_ids,
            group.policy.context_length,
            config.python_path[0] if config.python_path else "",
        )
        self.episodes: EpisodeDriver | EpisodeProcess | None = None
        """Runs the multi-turn tasks' episodes (started with the run)."""
        if self.validation is not None:
            self.validation.episode_specs = self.episode_specs
        elif self.episode_specs:
            raise ValueError(
                "a multi-turn task (one with an environment) is evaluated by running its episodes on the rollout "
                'instances: set validation = "background"'
            )

    @property
    def ordered(self) -> bool:
        """Groups are trained in prompt order, whatever order they finish in: at max_staleness 0 a
        run is then exactly the synchronous loop's."""
        return self.config.schedule == "sync" or self.max_staleness == 0

    def _sampling(self, task: Task, step: int, prompt_id: str) -> common_pb2.SamplingParams:
        sampling = task.config.sampling
        return common_pb2.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=task.config.max_tokens,
            stop_token_ids=self.stop_ids,
            seed=prompt_seed(self.config.seed, step, prompt_id),
        )

    def _ledger(self, record: dict) -> None:
        self._ledger_file.write(json.dumps(record) + "\n")

    def _batch_id(self, step: int, part: str = "") -> str:
        return f"{self.run_tag}-step{step:06d}{part}"

    async def run(self) -> dict:
        """Trains the job's steps and returns the summary (also written to summary.json). The
        experiment trackers' runs start first and are closed with it, marked failed when training
        fails or is stopped."""
        config = run_config(self.output, self.config.model_dump(mode="json"))
        # Off the event loop: a tracker's start (MLflow creating its store, W&B its run) takes seconds.
        self.metrics.trackers = await asyncio.to_thread(start_trackers, self.config.tracking, self.output, config)
        try:
            return await self._train()
        except BaseException:
            self.metrics.close(failed=True)
            raise

    async def _train(self) -> dict:
        started = time.perf_counter()
        if self.config.reference_apart:
            self.scorer.reference = await ReferenceWorker.start(
                self.config.model_dir,
                self.group.policy.pad_id,
                self.config.threads,
                self.config.startup_timeout_seconds,
            )
        if self.episode_specs:
            assert self.validation is not None, "a multi-turn job validates in the background (checked in __init__)"
            self.episodes = self.validation.episodes = await start_episodes(
                self.config, self.mesh, self.episode_specs, self.group.policy.context_length, self._collector_failed
            )
        state = TrainerState(step=0, version=0)
        checkpoint = latest_checkpoint(self.checkpoints) if self.config.resume else None
        restored: list[StepPlan] = []
        if checkpoint is not None:
            state = await self.group.lead(Resume(str(checkpoint)))
            self.mixture.restore(state.task_cursors)
            restored = load_pipeline(checkpoint, self.mixture.by_name)
            log.info(
                "resumed",
                checkpoint=str(checkpoint),
                step=state.step,
                task_cursors=state.task_cursors,
                accepted_groups=sum(len(p.waiting) for p in restored),
                prompts_in_flight=sum(len(p.outstanding) for p in restored),
            )
        manager = await self.mesh.manager_status()
        self.max_staleness = manager.max_staleness
        stored = await self.mesh.stored_version()
        # Versions only grow: a policy restarted on a mesh that already holds versions is published above them.
        if stored >= state.version or manager.published_version > state.version:
            state.version = max(stored, manager.published_version) + 1
        self.version_offset = state.version - state.step
        first_step = state.step
        await self._validate(state.step, state.version)
        await self.publisher.publish(state.version)
        await self._cancel_batches_of_earlier_runs(state.step)
        # What this run trains from `step` on replaces what an earlier run of this folder trained.
        self._ledger(
            {
                "event": "started",
                "step": state.step,
                "checkpoint": checkpoint.name if checkpoint else None,
                "accepted_groups": sum(len(p.waiting) for p in restored),
                "prompts_in_flight": sum(len(p.outstanding) for p in restored),
            }
        )
        for plan in restored:
            # Groups a run with the reference in the ranks accepted carry no reference log-probabilities.
            await self.scorer.attach_reference(plan.waiting)
            self.plans[plan.step] = plan
            if plan.outstanding:
                await self._submit(plan, list(plan.outstanding.values()), "-resumed")
        self.status.phase = trainer_pb2.PHASE_TRAINING
        self.status.step, self.status.version = state.step, state.version
        try:
            while state.step < self.total_steps:
                await self._plan_ahead(state.step)
                if state.step >= self.total_steps:
                    break
                await self._step(state)
                last_step = state.step == self.total_steps
                if state.step % self.config.checkpoint_every == 0 or last_step:
                    # The last one also holds the whole policy as an HF folder.
                    checkpointing = time.perf_counter()
                    pipeline = untrained_plans(self.plans, state.step)
                    await self.group.lead(
                        Checkpoint(
                            TrainerState(state.step, state.version, self.mixture.cursors(), dump_pipeline(pipeline)),
                            export_hf=last_step,
                        )
                    )
                    # What training waited for: the copy to memory; the write goes on in the background.
                    self.metrics.write(state.step, {"checkpoint_seconds": time.perf_counter() - checkpointing})
            await self.publisher.published()
            evaluations = await self.validation.finish() if self.validation else self.evaluations
        finally:
            self.publisher.cancel()
            if self.validation:
                await self.validation.cancel()
            await self._stop_collectors()
            if self.episodes is not None:
                await self.episodes.close()
            if self.scorer.reference is not None:
                await self.scorer.reference.close()
            await self.mixture.close()
            self._ledger_file.close()
        first_eval = evaluations.get(first_step, {})
        last_eval = evaluations[max(evaluations)] if evaluations else {}
        plot = self.metrics.plot()
        tracked = {tracker.name: tracker.where for tracker in self.metrics.trackers}
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
            "validations_skipped": self.validation.skipped if self.validation else [],
            "tracking": tracked,
        }
        (self.output / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    async def _plan_ahead(self, step: int) -> None:
        """Submits the prompts of every step the capacity rule lets generate now: up to
        max_staleness steps ahead of the one to train (the manager holds back what it must);
        the synchronous schedule submits only the step to train."""
        horizon = step if self.config.schedule == "sync" else step + self.max_staleness
        for ahead in range(step, min(self.total_steps, horizon + 1)):
            if ahead not in self.plans and not await self._draw(ahead):
                break

    async def _step(self, state: TrainerState) -> None:
        """One training step on the groups accepted for it, then publish the new version."""
        step_started = time.perf_counter()
        totals = await self._train_step(state.step)
        state.step += 1
        state.version = state.step + self.version_offset
        retry = self.validation is not None and self.validation.retry_due
        if state.step % self.config.eval_every == 0 or state.step == self.total_steps or retry:
            await self._validate(state.step, state.version)
        # Ordered runs wait for the version: the next step's rollouts must come from it. Others go
        # on training while it is uploaded; its figures are filed under this step once it is served.
        # A retried validation waits too: pushes carry the newest version, so on a host where they
        # take longer than a step the next version would supersede this one as well, every time.
        published = await self.publisher.publish(state.version, wait=self.ordered or retry, step=state.step)
        step_seconds = time.perf_counter() - step_started
        balance = await self._report_step(self._batch_id(state.step - 1), step_seconds, totals.wait_seconds)
        values = {
            **totals.metrics(self.max_staleness, step_seconds),
            **(publish_figures(published) if published is not None else {}),
            "weight_version": float(state.version),
            **balance,
        }
        self.metrics.write(state.step, values)
        self.status.step, self.status.version = state.step, state.version
        self.status.metrics.update(values)
        if not totals.trained_groups:
            log.warning(
                "the step had no group to train on (every one dropped, no prompt left to draw): "
                "the policy did not change",
                step=state.step,
                dropped_groups=totals.dropped_groups,
            )
            return
        log.info(
            "step",
            step=state.step,
            reward=round(values["reward"], 4),
            loss=round(values["loss"], 4),
            step_s=round(step_seconds, 3),
            staleness=values["staleness_mean"],
        )

    async def _report_step(self, batch_id: str, step_seconds: float, wait_seconds: float) -> dict[str, float]:
        """Tells the manager how training and rollout compared; returns its balance estimate as metrics."""
        try:
            balance = await self.mesh.report_step(batch_id, step_seconds, min(wait_seconds, step_seconds))
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "could not report the step's timing", batch_id=batch_id, code=exc.code().name, error=exc.details()
            )
            return {}
        return balance_metrics(balance)

    async def _stop_collectors(self) -> None:
        """Stops reading every batch this run will not train on and frees the rollout capacity it holds."""
        for task in self.collectors.values():
            task.cancel()
        await asyncio.gather(*self.collectors.values(), return_exceptions=True)
        for batch_id in sorted(b for b, task in self.collectors.items() if task.cancelled()):
            try:
                await self.mesh.cancel(batch_id)
            except grpc.aio.AioRpcError as exc:
                log.warning("could not cancel a batch", batch_id=batch_id, code=exc.code().name)
        self.collectors.clear()

    async def _cancel_batches_of_earlier_runs(self, first_step: int) -> None:
        """The batches an earlier run of this output folder submitted for the steps this one trains
        again: its rollouts are not this run's (its policy is gone); the prompts they hold come
        again, from the checkpoint or drawn anew from the same cursors."""
        batch_ids = submitted_batches(self.ledger_path, first_step)
        if not batch_ids:
            return
        for batch_id in batch_ids:
            await self.mesh.cancel(batch_id, missing_ok=True)
        log.info("cancelled the batches of an earlier run", batches=len(batch_ids), from_step=first_step)

    async def _draw(self, step: int) -> bool:
        """Draws and submits a step's prompts; False (and the run ends before that step) when a
        task's dataset ran out of epochs."""
        try:
            drawn = self.mixture.draw(step, self.config.prompts_per_step)
        except SourceExhausted as exc:
            log.warning("a task ran out of prompts: training ends here", step=step, reason=str(exc))
            self.total_steps = step
            return False
        plan = StepPlan(step, expected=len(drawn))
        self.plans[step] = plan
        await self._submit(plan, self._records(step, drawn, "p", 0))
        return True

    def _records(
        self, step: int, drawn: list[tuple[Task, TaskPrompt]], prefix: str, first_index: int
    ) -> list[PromptRecord]:
        records = []
        for offset, (task, prompt) in enumerate(drawn):
            text, token_ids = task.renderer.render(prompt)
            records.append(
                PromptRecord(step, f"{prefix}{offset}", first_index + offset, task.name, prompt, text, token_ids)
            )
        return records

    async def _refill(self, plan: StepPlan) -> None:
        """Dynamic sampling: prompts for the groups a step dropped, within the same step (and so
        within the capacity rule)."""
        missing = plan.missing
        if missing <= 0:
            return
        try:
            drawn = self.mixture.draw(plan.step, missing)
        except SourceExhausted as exc:
            log.warning("a task ran out of prompts: the step trains on fewer groups", step=plan.step, reason=str(exc))
            plan.expected -= missing
            return
        plan.refills += 1
        records = self._records(plan.step, drawn, f"r{plan.refills}-", plan.next_index)
        await self._submit(plan, records, f"-refill{plan.refills}")

    async def _submit(self, plan: StepPlan, records: list[PromptRecord], part: str = "") -> None:
        """Submits a step's prompts and starts reading their groups: single-turn prompts as one batch,
        each multi-turn task's as a batch of sessions whose episodes the driver runs. The first
        batch takes the step's batch id."""
        for record in records:
            plan.add(record)
        tasks = self.mixture.by_name
        by_batch: dict[str, list[PromptRecord]] = {}
        for record in records:
            by_batch.setdefault("" if tasks[record.task].config.environment is None else record.task, []).append(record)
        for index, (episodes_of, batch_records) in enumerate(sorted(by_batch.items())):
            batch_id = self._batch_id(plan.step, part) + ("" if index == 0 else f"-{episodes_of}")
            prompts = [
                (r.prompt_id, r.token_ids, self._sampling(tasks[r.task], r.step, r.prompt_id)) for r in batch_records
            ]
            version = plan.step + self.version_offset
            if not episodes_of:
                await self.mesh.submit(batch_id, version, prompts, self.config.group_size, prompts[0][2])
            else:
                assert self.episodes is not None
                await self.episodes.open(
                    self.episode_specs[episodes_of],
                    batch_id,
                    version,
                    prompts,
                    self.config.group_size,
                    {r.prompt_id: r.prompt for r in batch_records},
                )
            plan.batches.append(batch_id)
            self.collectors[batch_id] = asyncio.create_task(self._collect(batch_id, plan), name=f"collect {batch_id}")
            self._ledger(
                {
                    "event": "submitted",
                    "batch_id": batch_id,
                    "step": plan.step,
                    "policy_version": version,
                    "prompts": {r.prompt_id: [r.task, r.prompt.uid] for r in batch_records},
                    "group_size": self.config.group_size,
                }
            )

    async def _collect(self, batch_id: str, plan: StepPlan) -> None:
        """Reads a batch's groups as they finish and scores each reply at once, on its own (rewards
        overlap training, and a slow reward holds no later reply back): its groups are accepted into
        the step, or dropped (dynamic sampling) and refilled."""
        config = self.config
        scoring: set[asyncio.Task[None]] = set()
        try:
            async for groups in self.mesh.rollouts(
                batch_id, config.micro_batch_groups, 1, 0, config.rollout_timeout_seconds
            ):
                task = asyncio.create_task(self._score_and_accept(batch_id, plan, groups))
                scoring.add(task)
                task.add_done_callback(scoring.discard)
            await asyncio.gather(*scoring)
        except Exception as exc:  # noqa: BLE001 - handed to the training loop, which raises it
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                exc = RolloutsUnavailable(f"step {plan.step}: the manager cannot deliver rollouts: {exc.details()}")
            await self._collector_failed(exc)
        finally:
            for task in scoring:
                task.cancel()

    async def _score_and_accept(self, batch_id: str, plan: StepPlan, groups: list) -> None:
        try:
            for scored in await self.scorer.score(batch_id, plan, groups):
                rewards = scored.rewards
                record = scored.record
                entry = scored.ledger_entry(plan.step)
                if not scored.samples:
                    # Every episode of the group failed: nothing of it is the policy's to learn from.
                    plan.drop(record)
                    self._ledger({"event": "dropped", **entry})
                    await self._refill(plan)
                elif self.config.dynamic_sampling and max(rewards) - min(rewards) <= EQUAL_REWARDS:
                    plan.drop(record)
                    self._ledger({"event": "dropped", **entry})
                    await self._refill(plan)
                else:
                    plan.accept(scored)
                    self._ledger({"event": "accepted", **entry})
        except Exception as exc:  # noqa: BLE001 - handed to the training loop, which raises it
            await self._collector_failed(exc)
            return
        async with self._arrived:
            self._arrived.notify_all()

    async def _collector_failed(self, exc: BaseException) -> None:
        """Rollouts cannot come (a collector failed, or the episode driver cannot go on): the step stops with it."""
        self._collector_error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
        async with self._arrived:
            self._arrived.notify_all()

    async def _train_step(self, step: int) -> StepTotals:
        totals = StepTotals()
        done_waiting = asyncio.Event()
        watcher = asyncio.create_task(self.publisher.watch_weights(done_waiting))
        try:
            await self._train_plan(self.plans[step], totals)
        finally:
            done_waiting.set()
            await watcher
        plan = self.plans.pop(step)
        for batch_id in plan.batches:
            self.collectors.pop(batch_id, None)
        totals.dropped_groups = len(plan.dropped)
        self._ledger(
            {
                "event": "trained",
                "step": step,
                "prompts": [
                    [g.batch_id, g.record.prompt_id, g.record.task, g.record.prompt.uid] for g in plan.accepted
                ],
            }
        )
        return totals

    async def _wait_for_groups(self, plan: StepPlan, ready: Callable[[], bool], deadline: float) -> None:
        """Until `ready()` (the step has a micro-batch to train on) or a collector failed."""
        async with self._arrived:
            try:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: self._collector_error is not None or ready()),
                    max(0.0, deadline - time.monotonic()),
                )
            except TimeoutError:
                raise TimeoutError(
                    f"step {plan.step}: {plan.expected - len(plan.accepted)} of {plan.expected} groups did not "
                    f"arrive within rollout_timeout_seconds ({self.config.rollout_timeout_seconds:g})"
                ) from None
        if self._collector_error is not None:
            raise self._collector_error

    async def _train_plan(self, plan: StepPlan, totals: StepTotals) -> None:
        """Trains on the step's groups as they are accepted, in micro-batches; steps the optimizer per mini-batch."""
        config = self.config
        fewest = config.min_micro_batch_groups
        deadline = time.monotonic() + config.rollout_timeout_seconds
        # The proximal policy of the off-policy losses is the policy as this step starts.
        await self.group.lead(BeginStep(plan.step))
        groups_in_mini_batch = 0
        # The synchronous schedule trains once every group of the step is in.
        sync = config.schedule == "sync"
        while plan.trained < plan.expected:
            waiting_since = time.perf_counter()
            most = min(config.micro_batch_groups, self.mini_batch_groups - groups_in_mini_batch)
            ready = (lambda: plan.complete) if sync else partial(plan.can_take, self.ordered, most, fewest)
            if not ready():
                await self._wait_for_groups(plan, ready, deadline)
            totals.wait_seconds += time.perf_counter() - waiting_since
            micro_batch = plan.take_micro_batch(self.ordered, most, fewest, config.micro_batch_max_tokens)
            if not micro_batch:
                continue
            for group in micro_batch:
                totals.add(group, plan.step + self.version_offset)
            samples = with_advantages(micro_batch, self.config.advantage_estimator)
            totals.add_micro_batch(await self.group.lead(Train(samples)))
            groups_in_mini_batch += len(micro_batch)
            if groups_in_mini_batch >= self.mini_batch_groups:
                await self._optimizer_step(totals)
                groups_in_mini_batch = 0
        if groups_in_mini_batch:
            await self._optimizer_step(totals)

    async def _optimizer_step(self, totals: StepTotals) -> None:
        self.publisher.stepped_since_publish = True
        totals.grad_norm.append(await self.group.lead(OptimizerStep()))
        totals.end_mini_batch()

    async def _validate(self, step: int, version: int) -> None:
        """Held-out evaluation of the policy after `step` steps, before its version is published: in
        the background on rollout instances, pinned to the version, or (validation = "inline")
        here, on the trainer's policy."""
        if self.validation is not None:
            self.validation.retry_due = False
            await self.validation.start(step, version)
            return
        figures, samples = await evaluate_inline(
            self.group, self.scorer, self.mixture, self.config.seed + step, step, version
        )
        values = {**figures.values(), "eval/weight_version": float(version)}
        self.evaluations[step] = values
        self._file_metrics(step, values)
        self.metrics.write_samples(step, samples)
        log.info(
            "held-out evaluation", step=step, weight_version=version, **{k: round(v, 4) for k, v in values.items()}
        )

    def _file_metrics(self, step: int, values: dict[str, float]) -> None:
        self.metrics.write(step, values)
        self.status.metrics.update(values)
