"""How the trainer's ranks move together. Rank 0 drives the mesh (manager, rollouts, metrics) and
broadcasts each command with `broadcast_object_list` (small: samples are token lists); every
other rank receives it and runs the same command, so their FSDP collectives match. Commands:
begin a training step, train on these samples, optimizer step, evaluate, publish version v,
checkpoint, resume, stop. A publish may go on in the background once the shards are packed: the
upload, and the ranks' agreement on its outcome, overlap the commands that follow.

A failure every rank sees alike (a rank could not upload its shards) is raised on every rank as
`CollectiveFailure`: the ranks stay in step and rank 0 decides (it stops them). Any other
failure ends the rank's process; torchrun then stops the others."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.checkpoint import BackgroundCheckpoints, TrainerState
from services.trainer.ranks.distributed import RankInfo, TorchThread
from services.trainer.ranks.evaluation import EvalRequest, EvalResponses
from services.trainer.ranks.handoff import PackedShards, PublishError, ShardHandoff
from services.trainer.ranks.optimizing import NonFiniteUpdate
from services.trainer.ranks.policy import MicroBatchStats, ShardedPolicy

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class BeginStep:
    """A training step starts: the policy as it is now is the proximal policy of the step's
    micro-batches (the decoupled and tis losses need it). Sent before the step's first Train."""

    step: int = 0
    """The training step (the critic's warm-up counts them)."""


@dataclass(frozen=True, slots=True)
class Train:
    """Forward and backward of a micro-batch (each rank takes its share); gradients accumulate."""

    samples: list[TrainingSample]


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    pass


@dataclass(frozen=True, slots=True)
class Evaluate:
    """Held-out responses to one task's prompts."""

    request: EvalRequest


@dataclass(frozen=True, slots=True)
class Publish:
    """Every rank hands its shards of `version` to the weights service."""

    version: int
    wait: bool = True
    """False: the command ends once the shards are packed (on CUDA: once their copy to pinned host
    memory is enqueued) and returns the delivery, a task that lands, uploads and agrees with the
    other ranks while the next commands run (the next step's forwards and backwards)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Starts a checkpoint, written in the background (`BackgroundCheckpoints`)."""

    state: TrainerState
    export_hf: bool
    """Also write the whole policy as an HF folder (the final checkpoint), at once."""


@dataclass(frozen=True, slots=True)
class Resume:
    path: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = BeginStep | Train | OptimizerStep | Evaluate | Publish | Checkpoint | Resume | Stop


class CollectiveFailure(RuntimeError):
    """A command failed in a way every rank knows of; the ranks are still in step. `retryable`:
    the same command may succeed later (the weights service was unreachable)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    seconds: float
    """Broadcast, pack, upload and the wait for every rank."""
    pack_seconds: float
    """Copying the shards into the hand-off's memory (on CUDA: from the device, through pinned memory)."""
    upload_seconds: float
    rank_bytes: list[int]
    """Payload bytes each rank handed over."""


PUBLISH_RETRY_FIRST_SECONDS = 0.5
PUBLISH_RETRY_MAX_SECONDS = 8.0


def retry_delays(timeout: float) -> list[float]:
    """The waits between upload attempts while the weights service is unreachable, doubling, whose
    sum stays within `timeout`: the same on every rank, so all give up after the same attempt."""
    delays, delay = [], PUBLISH_RETRY_FIRST_SECONDS
    while sum(delays) + delay <= timeout:
        delays.append(delay)
        delay = min(2 * delay, PUBLISH_RETRY_MAX_SECONDS)
    return delays


class RankGroup:
    def __init__(
        self,
        rank: RankInfo,
        policy: ShardedPolicy,
        handoff: ShardHandoff,
        thread: TorchThread,
        checkpoints: Path,
        publish_timeout: float = 300.0,
    ) -> None:
        """`publish_timeout`: how long a version's upload is tried again while the weights service
        is unreachable (restarting) before the publish fails."""
        self.rank = rank
        self.policy = policy
        self.handoff = handoff
        self.thread = thread
        self.checkpoints = checkpoints
        self.publish_timeout = publish_timeout
        self.delivery: asyncio.Task[PublishResult] | None = None
        """The last publish's upload and agreement (it may still run in the background)."""
        self.background = BackgroundCheckpoints(checkpoints, rank.checkpointing)
        self.in_step = True
        """False while a command runs on this rank: a stop then could not be broadcast safely."""
        self._leading = asyncio.Lock()
        """One command at a time: the training loop and the weights watcher both lead."""

    def _broadcast(self, command: Command | None) -> Command:
        objects: list[Any] = [command]
        dist.broadcast_object_list(objects, src=0, group=self.rank.control)
        return objects[0]

    async def lead(self, command: Command) -> Any:
        """Rank 0: sends the command to every rank and runs it here too; returns this rank's result."""
        if not self.rank.is_leader:
            raise RuntimeError("only rank 0 leads")
        async with self._leading:
            self.in_step = False
            await self.thread.run(self._broadcast, command)
            try:
                result = await self.execute(command)
            except CollectiveFailure:
                self.in_step = True
                raise
            self.in_step = True
            return result

    async def follow(self) -> None:
        """Ranks other than 0: run rank 0's commands until it says stop."""
        while True:
            command = await self.thread.run(self._broadcast, None)
            if isinstance(command, Stop):
                await self.delivered()
            try:
                await self.execute(command)
            except CollectiveFailure as exc:
                log.warning(
                    "command failed on every rank; waiting for rank 0", command=type(command).__name__, error=str(exc)
                )
            if isinstance(command, Stop):
                return

    async def stop(self) -> bool:
        """Rank 0: tells the other ranks to exit, if they are in step to hear it; True if told."""
        if self.rank.world_size == 1:
            return True
        if not self.in_step:
            return False
        await self.lead(Stop())
        return True

    async def execute(self, command: Command) -> Any:
        policy, thread = self.policy, self.thread
        match command:
            case BeginStep(step):
                return await thread.run(policy.begin_step, step)
            case Train(samples):
                stats: MicroBatchStats = await self._refusable(policy.backward, samples)
                return stats
            case OptimizerStep():
                return await self._refusable(policy.optimizer_step)
            case Evaluate(request):
                responses: EvalResponses = await thread.run(policy.evaluate, request)
                return responses
            case Publish(version, wait):
                return await self._publish(version, wait)
            case Checkpoint(state, export_hf):
                return await thread.run(self._checkpoint, state, export_hf)
            case Resume(path):
                return await thread.run(policy.load, Path(path))
            case Stop():
                return None
        raise TypeError(f"unknown command {command!r}")

    async def _refusable(self, train, *args) -> Any:
        """Runs a training command; a step refused for a non-finite loss or gradient (which every
        rank decides alike) is a CollectiveFailure: the job ends, naming the step and its samples."""
        try:
            return await self.thread.run(train, *args)
        except NonFiniteUpdate as exc:
            raise CollectiveFailure(str(exc)) from exc

    def _checkpoint(self, state: TrainerState, export_hf: bool) -> Path:
        """In the background; the one holding the HF export (the run's last) is written at once."""
        if export_hf:
            self.background.wait()
            return self.policy.save(self.checkpoints, state, export_hf=True)
        return self.background.save(
            self.policy.model, self.policy.optimizer, state, self.rank.control, critic=self.policy.trained_critic
        )

    def _pack(self, version: int) -> PackedShards:
        packed = self.handoff.pack(version, self.policy.local_shards())
        self.policy.guard_writes(packed.copied)
        return packed

    async def delivered(self) -> PublishResult | None:
        """Waits for the last publish's delivery; its outcome (None if there was none, or if it failed:
        whoever waited for it learned why)."""
        delivery = self.delivery
        if delivery is None:
            return None
        try:
            return await asyncio.shield(delivery)
        except CollectiveFailure as exc:
            log.warning("a publish failed on every rank", error=str(exc))
            return None

    async def _publish(self, version: int, wait: bool) -> PublishResult | asyncio.Task[PublishResult]:
        # One delivery at a time, so every rank agrees on the outcomes in the same order.
        await self.delivered()
        started = time.perf_counter()
        packed = await self.thread.run(self._pack, version)
        self.delivery = asyncio.create_task(self._deliver(packed, started))
        return await self.delivery if wait else self.delivery

    async def _deliver(self, packed: PackedShards, started: float) -> PublishResult:
        """Lands the packed shards (on CUDA: waits for their copy off the torch thread), uploads
        them, and agrees with the other ranks on the outcome; while the weights service is
        unreachable, uploads the same bytes again with backoff (the policy may have moved on)."""
        version = packed.header.version
        for delay in [*retry_delays(self.publish_timeout), None]:
            uploading = time.perf_counter()
            error, retryable, complete = "", False, False
            try:
                reply = await self.handoff.upload(packed)
                complete = reply.complete
            except PublishError as exc:
                error, retryable = str(exc), exc.retryable
            upload_seconds = time.perf_counter() - uploading
            outcomes = await asyncio.to_thread(self._agree, (error, retryable, complete, packed.header.total_bytes))
            failed = [(e, r) for e, r, _, _ in outcomes if e]
            if not failed:
                break
            failure = CollectiveFailure(
                f"publishing version {version}: " + "; ".join(e for e, _ in failed), retryable=all(r for _, r in failed)
            )
            if not failure.retryable or delay is None:
                raise failure
            log.warning(
                "the weights service is unreachable; uploading the version again",
                weight_version=version,
                retry_in_s=delay,
                error=str(failure),
            )
            await asyncio.sleep(delay)
        if not any(c for _, _, c, _ in outcomes):
            raise CollectiveFailure(
                f"publishing version {version}: every rank uploaded its shards but the weights "
                "service never reported the version complete"
            )
        return PublishResult(
            version=version,
            seconds=time.perf_counter() - started,
            pack_seconds=packed.pack_seconds,
            upload_seconds=upload_seconds,
            rank_bytes=[b for _, _, _, b in outcomes],
        )

    def _agree(self, outcome: Any) -> list[Any]:
        """Every rank's upload outcome, on the publishing group (any thread but the torch thread)."""
        if self.rank.world_size == 1:
            return [outcome]
        gathered: list[Any] = [None] * self.rank.world_size
        dist.all_gather_object(gathered, outcome, group=self.rank.publishing)
        return gathered
