"""The rules every sampling request must meet, shared by the manager (at submission) and the
rollout service (at generation), so a bad value is refused where it enters, with its name."""

from __future__ import annotations

import math

MIN_TEMPERATURE = 1e-5
"""Below this (and above 0, which means greedy) logits divided by the temperature overflow float32."""
MAX_TEMPERATURE = 1e3
"""Above this sampling is uniform to float precision: almost surely a mistake."""
MAX_SEED = 2**62
"""The torch engine adds a continuation's length to the seed; torch takes seeds below 2^63."""


def sampling_problem(temperature: float, top_p: float, max_tokens: int, seed: int) -> str | None:
    """What is wrong with these sampling values, or None."""
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    if not math.isfinite(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        return f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {temperature}"
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        return f"top_p must be in [0, 1] (0 means 1), got {top_p}"
    if seed >= MAX_SEED:
        return f"seed must be below 2^62, got {seed}"
    return None
