"""Inter-stage balance between training and rollout, after PolyRL / RLBoost: from the last
steps' training and rollout times, move the reserved instances' local generation window by a
third of the bubble difference and estimate how many rollout instances the trainer can use: from
the times when rollout and training take turns, from the work when they overlap."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepTiming:
    step_seconds: float
    wait_seconds: float
    """Of the step, time the trainer waited for rollouts (its bubble)."""
    rollout_seconds: float
    """From the batch's submission until its last group was complete."""
    tokens: int
    """Response tokens of the step's batch."""


@dataclass(frozen=True, slots=True)
class Balance:
    observed_steps: int = 0
    train_seconds: float = 0.0
    rollout_seconds: float = 0.0
    trainer_wait_seconds: float = 0.0
    rollout_idle_seconds: float = 0.0
    local_window_seconds: float = 0.0
    recommended_rollout_instances: int = 0
    offload_fraction: float = 0.0


class StageBalancer:
    """Keeps the last `history` steps; each new step moves the local window once."""

    def __init__(self, history: int = 5, min_window_seconds: float = 0.0) -> None:
        self.steps: deque[StepTiming] = deque(maxlen=history)
        self.min_window_seconds = min_window_seconds
        self.window_seconds: float | None = None
        self.balance = Balance()

    def observe(
        self,
        timing: StepTiming,
        instances: int,
        reserved_tokens_per_second: float,
        fleet_tokens_per_second: float = 0.0,
        overlapped: bool = False,
    ) -> Balance:
        """`fleet_tokens_per_second`: what the instances generate with their batches full, all together.
        `overlapped`: rollout runs ahead of training (max_staleness > 0)."""
        if timing.step_seconds < 0 or timing.wait_seconds < 0 or timing.wait_seconds > timing.step_seconds:
            raise ValueError("need 0 <= wait_seconds <= step_seconds")
        self.steps.append(timing)
        trainer_bubble = timing.wait_seconds
        rollout_bubble = max(0.0, timing.step_seconds - timing.rollout_seconds)
        if self.window_seconds is None:
            # Start with the whole step generated locally, then let the bubbles move the window.
            self.window_seconds = timing.rollout_seconds
        # PolyRL's rule: when the rollout side idles longer than the trainer waits, reserved
        # instances hand work over sooner (shrink); when the trainer waits longer, they keep
        # generating longer (grow). A third of the difference damps the oscillation.
        self.window_seconds = max(self.min_window_seconds, self.window_seconds + (trainer_bubble - rollout_bubble) / 3)

        count = len(self.steps)
        step = sum(s.step_seconds for s in self.steps) / count
        wait = sum(s.wait_seconds for s in self.steps) / count
        rollout = sum(s.rollout_seconds for s in self.steps) / count
        tokens = sum(s.tokens for s in self.steps) / count
        train = max(step - wait, 1e-9)
        if overlapped and fleet_tokens_per_second > 0 and instances > 0:
            # A batch submitted steps ahead is in flight for several steps: its rollout time says
            # how far ahead, not how much capacity it took. This many instances generate a step's
            # tokens in a training step.
            per_instance = fleet_tokens_per_second / instances
            recommended = max(1, math.ceil(tokens / train / per_instance - 1e-9))
        else:
            # Rollout throughput scales with instances: this many would make rollout as long as training.
            recommended = max(1, math.ceil(max(instances, 1) * rollout / train - 1e-9))
        local_tokens = reserved_tokens_per_second * self.window_seconds
        offload = 1.0 if tokens <= 0 else min(1.0, max(0.0, 1.0 - local_tokens / tokens))
        self.balance = Balance(
            observed_steps=count,
            train_seconds=train,
            rollout_seconds=rollout,
            trainer_wait_seconds=wait,
            rollout_idle_seconds=max(0.0, step - rollout),
            local_window_seconds=self.window_seconds,
            recommended_rollout_instances=recommended,
            offload_fraction=offload,
        )
        return self.balance
