"""The local provisioner's rule: follow the manager's recommended number of rollout instances,
with hysteresis (a recommendation must hold for a while, then a cooldown) and the job's bounds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Autoscaler:
    """Moves the instance count one at a time toward the recommendation, within [minimum, maximum].

    A change happens only when every recommendation seen for `patience_seconds` pointed the same
    way (more, or fewer, instances than now), and at least `cooldown_seconds` after the last
    change: a recommendation that flaps, or one made before a new instance had time to matter,
    changes nothing."""

    minimum: int
    maximum: int
    patience_seconds: float = 30.0
    cooldown_seconds: float = 60.0
    _direction: int = 0
    _since: float = 0.0
    _last_change: float = field(default=float("-inf"))

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"rollout instances need 1 <= minimum <= maximum, got {self.minimum}:{self.maximum}")

    def observe(self, now: float, recommended: int, current: int) -> int | None:
        """The new instance count, or None to keep `current`. `recommended` 0 means no estimate yet."""
        wanted = min(max(recommended, self.minimum), self.maximum) if recommended > 0 else current
        direction = (wanted > current) - (wanted < current)
        if direction != self._direction:
            self._direction, self._since = direction, now
            return None
        if direction == 0 or now - self._since < self.patience_seconds or now - self._last_change < self.cooldown_seconds:
            return None
        self._last_change = now
        self._since = now
        return current + direction
