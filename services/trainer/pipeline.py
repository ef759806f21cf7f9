"""The trainer's rollout pipeline as plain data: per step, the prompts submitted for it, the groups
accepted for it (scored, not yet trained) and the order they are trained in. A checkpoint saves it
whole, so a resumed trainer trains every accepted prompt exactly once."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rlmesh.micro_batch import group_tokens, pack
from rlmesh.rewards.base import RewardResult
from rlmesh.sampling import MAX_SEED
from rlmesh.tasks.base import TaskPrompt
from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.checkpoint import PIPELINE_FILE
from services.trainer.trajectories import EpisodeFigures


def prompt_seed(job_seed: int, step: int, prompt_id: str) -> int:
    """The sampling seed of a step's prompt: reruns and resubmissions draw the same responses."""
    digest = hashlib.blake2b(f"{job_seed}:{step}:{prompt_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") % MAX_SEED) or 1


@dataclass(slots=True)
class PromptRecord:
    """A prompt submitted for a step: enough to submit it again, identically."""

    step: int
    prompt_id: str
    index: int
    """Its place in the step: groups are trained in this order when the order must not depend on timing."""
    task: str
    prompt: TaskPrompt
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class ScoredGroup:
    """A finished group, scored: what a training step consumes."""

    record: PromptRecord
    batch_id: str
    samples: list[TrainingSample]
    results: list[RewardResult]
    weight_versions: list[list[int]]
    """Per sample, the version that generated each of its (trained) tokens."""
    trajectories: list[int] | None = None
    """Multi-turn: per sample, the index in `results` of the trajectory it is a part of (a trajectory
    whose history was edited trains as several samples). None: one sample per result."""
    episodes: list[EpisodeFigures] = field(default_factory=list)
    """Multi-turn: every episode of the group, the masked ones too."""
    turn_rewards: list[dict[int, float]] | None = None
    """Multi-turn with per-turn credit: per result (trajectory), its turns' rewards."""

    @property
    def rewards(self) -> list[float]:
        """One per trajectory (result)."""
        return [r.reward for r in self.results]

    def ledger_entry(self, step: int) -> dict:
        """What the rollout ledger records of the group when it is accepted or dropped."""
        record = self.record
        entry = {
            "batch_id": self.batch_id,
            "step": step,
            "prompt_id": record.prompt_id,
            "task": record.task,
            "uid": record.prompt.uid,
            "samples": len(self.samples),
            "rewards": self.rewards,
            "min_version": self.min_version if self.samples else None,
            "max_version": max(max(v) for v in self.weight_versions) if self.samples else None,
        }
        if self.episodes:
            entry["episodes"] = [e.status for e in self.episodes]
        return entry

    def owners(self) -> list[int]:
        """Per sample, the index of its result."""
        return self.trajectories if self.trajectories is not None else list(range(len(self.samples)))

    @property
    def min_version(self) -> int:
        return min(min(v) for v in self.weight_versions)

    @property
    def tokens(self) -> int:
        """What the group weighs against a micro-batch's budget: every sample as trained, its own
        context and response (a broken trajectory's parts differ in context)."""
        return sum(group_tokens(len(s.prompt_ids), [len(s.response_ids)]) for s in self.samples)


@dataclass(slots=True)
class StepPlan:
    """One training step's rollouts: `expected` groups must be accepted; a dropped group (dynamic
    sampling: all rewards equal) is replaced by a refill prompt for the same step."""

    step: int
    expected: int
    outstanding: dict[str, PromptRecord] = field(default_factory=dict)
    """Submitted, not yet back: by prompt id."""
    accepted: list[ScoredGroup] = field(default_factory=list)
    """Every group accepted, in arrival order."""
    waiting: list[ScoredGroup] = field(default_factory=list)
    """Accepted, not yet handed to training, in arrival order."""
    trained: int = 0
    dropped: list[int] = field(default_factory=list)
    """Indexes of dropped groups."""
    next_index: int = 0
    refills: int = 0
    batches: list[str] = field(default_factory=list)

    def add(self, record: PromptRecord) -> None:
        self.outstanding[record.prompt_id] = record
        self.next_index = max(self.next_index, record.index + 1)

    def accept(self, group: ScoredGroup) -> None:
        del self.outstanding[group.record.prompt_id]
        self.accepted.append(group)
        self.waiting.append(group)

    def drop(self, record: PromptRecord) -> None:
        del self.outstanding[record.prompt_id]
        self.dropped.append(record.index)

    @property
    def missing(self) -> int:
        """Groups still to be accepted that no outstanding prompt will bring: refills to submit."""
        return self.expected - len(self.accepted) - len(self.outstanding)

    @property
    def complete(self) -> bool:
        return len(self.accepted) >= self.expected

    def can_take(self, ordered: bool, most_groups: int, fewest_groups: int) -> bool:
        """Whether a micro-batch can be taken now. Ordered micro-batches are always full (but the
        step's last), so that what they hold never depends on when groups finished."""
        fewest = most_groups if ordered else fewest_groups
        return len(self.ready(ordered)) >= min(max(fewest, 1), self.expected - self.trained)

    def ready(self, ordered: bool) -> list[ScoredGroup]:
        """The waiting groups that may be trained now, in training order. `ordered`: by index, and a
        group only once every lower index is accepted or dropped, so micro-batches are the same
        whatever order groups finish in. Otherwise in arrival order."""
        if not ordered:
            return list(self.waiting)
        first_pending = min((r.index for r in self.outstanding.values()), default=None)
        return sorted(
            (g for g in self.waiting if first_pending is None or g.record.index < first_pending),
            key=lambda g: g.record.index,
        )

    def take_micro_batch(
        self, ordered: bool, most_groups: int, fewest_groups: int, max_tokens: int
    ) -> list[ScoredGroup]:
        """The next micro-batch, or [] while it must wait for more groups. At most `most_groups`
        within `max_tokens` (packed by rlmesh.micro_batch's rule, as the manager packs); at least
        `fewest_groups` (ordered: `most_groups`) unless it is the step's last."""
        if not self.can_take(ordered, most_groups, fewest_groups):
            return []
        taken = pack(self.ready(ordered), most_groups, max_tokens, lambda group: group.tokens)
        self.trained += len(taken)
        chosen = {id(g) for g in taken}
        self.waiting = [g for g in self.waiting if id(g) not in chosen]
        return taken


def untrained_plans(plans: dict[int, StepPlan], first_step: int) -> list[StepPlan]:
    """What a checkpoint saves of the pipeline when `first_step` is the next step to train: every
    later step with its accepted-but-untrained groups and its prompts still in flight (submitted
    again on resume)."""
    return [
        StepPlan(
            p.step,
            p.expected - p.trained,
            dict(p.outstanding),
            list(p.waiting),
            list(p.waiting),
            0,
            list(p.dropped),
            p.next_index,
            p.refills,
            [],
        )
        for step, p in sorted(plans.items())
        if step >= first_step
    ]


def submitted_batches(ledger_path: Path, first_step: int) -> list[str]:
    """The batches the rollout ledger says were submitted for `first_step` or later (a line cut short
    by a killed trainer is skipped)."""
    batch_ids = []
    for line in ledger_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "submitted" and record["step"] >= first_step:
            batch_ids.append(record["batch_id"])
    return batch_ids


def dump_pipeline(plans: list[StepPlan]) -> bytes:
    return pickle.dumps(plans)


def load_pipeline(checkpoint: Path, tasks: Mapping[str, object]) -> list[StepPlan]:
    """The steps a checkpoint saved ahead of it; [] for a checkpoint without them. The checkpoint is
    this run's own output (it is unpickled)."""
    path = checkpoint / PIPELINE_FILE
    if not path.is_file():
        return []
    plans: list[StepPlan] = pickle.loads(path.read_bytes())
    unknown = {r.task for p in plans for r in p.outstanding.values()} | {
        g.record.task for p in plans for g in p.accepted
    }
    unknown -= set(tasks)
    if unknown:
        raise ValueError(
            f"checkpoint {checkpoint}: its prompts in flight come from tasks this job does not have: {sorted(unknown)}"
        )
    return plans
