"""The simulated trainer: it submits each step's prompts up to max_staleness steps ahead as the
real loop does, takes the step's micro-batches, trains for a time per token, then publishes the
next version; it checks every delivered sample as the trainer's own accounting would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlmesh.common.v1 import common_pb2
from services.manager.domain.state import ManagerState


@dataclass(frozen=True, slots=True)
class TrainerModel:
    prompts_per_step: int
    group_size: int
    max_tokens: int
    seconds_per_token: float
    """Training time per response token of the step (units of the simulation)."""
    fixed_seconds: float = 0.0
    micro_batch_groups: int = 8
    publishes: bool = True
    """Whether each step publishes a new version (False: every step samples version 0, as a mesh
    without a weights service does)."""
    announce_seconds: float = 0.0
    """How long after a step ends the manager learns its version (the upload to the weights service,
    then the announcement); the pushes to instances count from the step's end (Scenario.push_seconds)."""

    def step_seconds(self, tokens: int) -> float:
        return self.fixed_seconds + self.seconds_per_token * tokens


@dataclass(slots=True)
class Accounts:
    """What the trainer saw: staleness, samples lost or duplicated, tokens trained."""

    violations: int = 0
    """Samples trained with a token older than max_staleness versions."""
    lost: int = 0
    duplicated: int = 0
    trained_tokens: int = 0
    trained_samples: int = 0
    max_staleness_seen: int = 0
    step_ends: list[float] = field(default_factory=list)
    trainer_busy_seconds: float = 0.0
    wait_seconds: float = 0.0


class SimTrainer:
    def __init__(self, model: TrainerModel, steps: int, max_staleness: int, seed: int, call: Callable) -> None:
        self.model = model
        self.call = call
        """Runs one call of the manager's (the simulation times them)."""
        self.steps = steps
        self.max_staleness = max_staleness
        self.seed = seed
        self.step = 0
        """The step to train next; the policy is at version `step`."""
        self.submitted: set[int] = set()
        self.received: dict[str, int] = {}
        self.tokens = 0
        self.training_until: float | None = None
        self.waiting_since = 0.0
        self.accounts = Accounts()
        self.published: list[tuple[float, int]] = []
        """(time, version) of each publish, for the weight pushes."""
        self.announcing: list[tuple[float, int]] = []
        """(time, version) of each announcement to the manager still to come, oldest first."""
        self.reports: list[tuple[str, float, float]] = []
        self.balance = None
        """The manager's stage balance after the last step reported."""

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def version_of(self, step: int) -> int:
        """The version step `step` is trained at."""
        return step if self.model.publishes else 0

    def tick(self, now: float, state: ManagerState) -> None:
        while self.announcing and self.announcing[0][0] <= now:
            self.call(state.publish, self.announcing.pop(0)[1])
        if self.training_until is not None:
            if now < self.training_until:
                return
            self._finish(now, state)
        if self.done:
            return
        self._plan_ahead(now, state)
        self._collect(now, state)

    def _plan_ahead(self, now: float, state: ManagerState) -> None:
        for ahead in range(self.step, min(self.steps, self.step + self.max_staleness + 1)):
            if ahead in self.submitted:
                continue
            sampling = common_pb2.SamplingParams(
                temperature=1.0, max_tokens=self.model.max_tokens, seed=self.seed + ahead
            )
            prompts = [
                (f"s{ahead}p{i}", [1, 2, 3, 4], self.model.group_size) for i in range(self.model.prompts_per_step)
            ]
            self.call(state.submit, batch_id(ahead), self.version_of(ahead), prompts, sampling)
            self.submitted.add(ahead)

    def _collect(self, now: float, state: ManagerState) -> None:
        batch = batch_id(self.step)
        while True:
            taken = self.call(state.take_micro_batch, batch, self.model.micro_batch_groups)
            if taken is None:
                return
            groups, remaining = taken
            for group in groups:
                self._check(group)
            if remaining == 0:
                break
        self.call(state.acknowledge, batch)
        self._check_complete()
        seconds = self.model.step_seconds(self.tokens)
        self.accounts.wait_seconds += now - self.waiting_since
        self.accounts.trainer_busy_seconds += seconds
        self.training_until = now + seconds
        self.reports.append((batch, seconds + now - self.waiting_since, now - self.waiting_since))

    def _check(self, group: list) -> None:
        for request in group:
            self.received[request.prompt_id] = self.received.get(request.prompt_id, 0) + 1
            staleness = self.version_of(self.step) - min(request.weight_versions) if request.weight_versions else 0
            self.accounts.max_staleness_seen = max(self.accounts.max_staleness_seen, staleness)
            self.accounts.violations += staleness > self.max_staleness
            self.tokens += len(request.token_ids)
            self.accounts.trained_samples += 1

    def _check_complete(self) -> None:
        expected = {f"s{self.step}p{i}" for i in range(self.model.prompts_per_step)}
        for prompt_id in expected:
            count = self.received.get(prompt_id, 0)
            self.accounts.lost += max(0, self.model.group_size - count)
            self.accounts.duplicated += max(0, count - self.model.group_size)
        self.accounts.duplicated += sum(n for p, n in self.received.items() if p not in expected)
        self.accounts.trained_tokens += self.tokens

    def _finish(self, now: float, state: ManagerState) -> None:
        self.step += 1
        self.received, self.tokens, self.training_until = {}, 0, None
        self.waiting_since = now
        self.accounts.step_ends.append(now)
        if self.model.publishes:
            if self.model.announce_seconds:
                self.announcing.append((now + self.model.announce_seconds, self.step))
            else:
                self.call(state.publish, self.step)
            self.published.append((now, self.step))
        batch, step_seconds, wait_seconds = self.reports[-1]
        self.balance = self.call(state.report_training_step, batch, step_seconds, wait_seconds)


def batch_id(step: int) -> str:
    return f"step-{step}"
