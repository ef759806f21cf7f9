"""Simulated rollout instances: the synthetic engine's decode model (a step of b sequences takes
max(min_step, b / throughput) / speed), its response lengths from the same seeds, versions switched
between decode steps, and what a drain or a crash leaves the manager."""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from rlmesh.common.v1 import common_pb2
from services.manager.domain.records import Assignment, SampleRequest
from services.rollout.synthetic_engine import SyntheticConfig, response_length

BOOTING, LOADING, SERVING, GONE = "booting", "loading", "serving", "gone"


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """One kind of instance; token counts are in the simulation's units (see Scenario.token_unit)."""

    throughput: float
    """Units per second of a saturated batch at speed 1."""
    min_step_seconds: float
    """A lone sequence's time per unit at speed 1; throughput × min_step is the saturation batch."""
    max_batch_size: int
    lengths: SyntheticConfig
    """Response lengths (length, mean_tokens, sigma, in units), drawn per seed as the synthetic engine does."""
    stream_interval: int = 1
    """Units per chunk on the wire: what a crash leaves behind is what was not yet sent."""
    declares_saturation: bool = True
    """Whether the instance tells the manager its saturation batch when it registers, as a
    deployment sets `engine.saturation_batch_size`; `rlmesh up`'s default job does not (0)."""

    @property
    def saturation_batch_size(self) -> int:
        return min(self.max_batch_size, max(1, math.floor(self.throughput * self.min_step_seconds)))

    @property
    def declared_saturation_batch_size(self) -> int:
        """What the manager is told at registration (0: not known)."""
        return self.saturation_batch_size if self.declares_saturation else 0


@dataclass(slots=True)
class Sequence:
    """A request on an instance: it starts at the instance's decode step count `start`."""

    request: SampleRequest
    attempt: int
    start: float
    target: int
    """Units still to generate when it started (its drawn length less the tokens it continues from)."""
    reason: int
    recorded: int = 0
    """Units the manager has received."""


@dataclass(slots=True)
class SimInstance:
    instance_id: str
    model: InstanceModel
    speed: float
    warning_seconds: float
    """The preemption notice its cloud gives (0: none, it just vanishes)."""
    preemptible: bool = True
    phase: str = BOOTING
    token: str = ""
    version: int = 0
    steps: float = 0.0
    """Decode steps since it booted: every running sequence gains one unit per step."""
    switches: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])
    """(step count, version) at each version switch, oldest first."""
    running: dict[str, Sequence] = field(default_factory=dict)
    finishing: list[tuple[float, str, int]] = field(default_factory=list)
    """A heap of (step count at which it ends, request id, attempt)."""
    pushed: int | None = None
    """A version being pushed, switched to when the push arrives."""
    generated: int = 0
    """Units generated, whether or not they reached the manager."""
    alive_since: float = 0.0

    def step_seconds(self) -> float:
        busy = max(1, len(self.running))
        return max(self.model.min_step_seconds, busy / self.model.throughput) / self.speed

    def start(self, assignment: Assignment) -> Sequence | None:
        """Begins a request; returns it already finished when its continued tokens reach its length."""
        request = assignment.request
        total = response_length(self.model.lengths, request.sampling.seed, request.sampling.max_tokens)
        reason = (
            common_pb2.FINISH_REASON_LENGTH if total >= request.sampling.max_tokens else common_pb2.FINISH_REASON_STOP
        )
        sequence = Sequence(request, assignment.attempt, self.steps, max(0, total - len(request.token_ids)), reason)
        if sequence.target == 0:
            return sequence
        self.running[request.request_id] = sequence
        heapq.heappush(self.finishing, (self.steps + sequence.target, request.request_id, assignment.attempt))
        return None

    def advance(self, seconds: float) -> list[Sequence]:
        """Decodes for `seconds` (at the step time of the batch it runs now); returns the sequences that ended."""
        if not self.running:
            return []
        steps = seconds / self.step_seconds()
        self.generated += int(self.steps + steps) * len(self.running) - int(self.steps) * len(self.running)
        self.steps += steps
        ended = []
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, request_id, attempt = heapq.heappop(self.finishing)
            sequence = self.running.get(request_id)
            if sequence is not None and sequence.attempt == attempt:
                del self.running[request_id]
                ended.append(sequence)
        return ended

    def generated_units(self, sequence: Sequence) -> int:
        return min(sequence.target, int(self.steps - sequence.start))

    def unsent(self, sequence: Sequence, sent_in_chunks: bool) -> tuple[int, int]:
        """(first, last) unit of the sequence the manager has not received: all generated ones, or only
        whole chunks (what a stream delivered before its instance vanished)."""
        generated = self.generated_units(sequence)
        if sent_in_chunks:
            interval = self.model.stream_interval
            generated = max(sequence.recorded, generated // interval * interval)
        return sequence.recorded, generated

    def versions(self, sequence: Sequence, first: int, last: int) -> list[int]:
        """The version that generated each unit in [first, last) of the sequence: unit k came from
        decode step start + k, under the last switch at or before it."""
        starts = [at for at, _ in self.switches]
        index = max(0, bisect.bisect_right(starts, sequence.start + first) - 1)
        versions: list[int] = []
        unit = first
        while unit < last:
            following = starts[index + 1] if index + 1 < len(starts) else math.inf
            end = last if following == math.inf else min(last, max(unit, math.ceil(following - sequence.start)))
            versions += [self.switches[index][1]] * (end - unit)
            unit, index = end, index + 1
        return versions

    def switch(self, version: int) -> None:
        self.version = version
        self.switches.append((self.steps, version))
        # Only switches a running sequence may still span are needed.
        oldest = min((s.start for s in self.running.values()), default=self.steps)
        while len(self.switches) > 1 and self.switches[1][0] <= oldest:
            self.switches.pop(0)

    def drop(self, request_id: str) -> Sequence | None:
        return self.running.pop(request_id, None)
