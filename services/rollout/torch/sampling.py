"""The torch engine's sampling of one token per running sequence, on the device the logits are on."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.rollout.engine import Sampling


def draw(
    logits: torch.Tensor,
    sampling: Sequence[Sampling],
    generators: Sequence[torch.Generator | None],
    rng: torch.Generator,
) -> tuple[torch.Tensor, list[float]]:
    """One token per row and its logprob, vectorised except for rows with a generator of their own
    (seeded requests); the logprob is taken under the temperature-scaled distribution before top-p
    truncation. Temperature 0 is greedy."""
    temperatures = torch.tensor([s.temperature for s in sampling], device=logits.device)
    top_p = torch.tensor([s.top_p for s in sampling], device=logits.device)
    logprobs = torch.log_softmax(logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None], dim=-1)
    tokens = logprobs.argmax(-1)
    sampled = (temperatures > 0).nonzero().flatten().tolist()
    if sampled:
        probs = _nucleus(logprobs[sampled].exp(), top_p[sampled])
        shared = [i for i, row in enumerate(sampled) if generators[row] is None]
        if shared:
            draws = torch.multinomial(probs[shared], 1, generator=rng).flatten()
            tokens[[sampled[i] for i in shared]] = draws
        for i, row in enumerate(sampled):
            if generators[row] is not None:
                tokens[row] = torch.multinomial(probs[i], 1, generator=generators[row])
    chosen = logprobs.gather(1, tokens[:, None]).flatten().tolist()
    return tokens, chosen


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keeps the smallest set of most likely tokens whose mass reaches top_p."""
    if bool((top_p >= 1).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)
