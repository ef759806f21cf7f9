"""The critic of PPO with a critic (advantage_estimator `gae`): a value model (a copy of the
policy's trunk with a scalar head) sharded with FSDP2 over the trainer's ranks like the policy,
with its own Adam optimizer and learning rate. Its forward and backward run in every training
micro-batch beside the policy's, its optimizer steps with the policy's (per mini-batch), and it is
checkpointed and resumed with the policy. Every method is collective (`policy.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlmesh.models.loading import load_causal_lm
from services.trainer.algorithms.losses import clipped_value_loss
from services.trainer.config import TrainerConfig
from services.trainer.ranks.batching import MicroBatch
from services.trainer.ranks.distributed import RankInfo
from services.trainer.ranks.optimizing import clipped_norm


@dataclass(frozen=True, slots=True)
class CriticSums:
    """A micro-batch's critic figures as sums over its response tokens (they add up over
    micro-batches and ranks); `metrics` turns a step's sums into its figures."""

    tokens: float = 0.0
    value_loss: float = 0.0
    values: float = 0.0
    returns: float = 0.0
    returns_squared: float = 0.0
    residuals: float = 0.0
    """Returns less values."""
    residuals_squared: float = 0.0

    def __add__(self, other: CriticSums) -> CriticSums:
        return CriticSums(*(a + b for a, b in zip(self.as_list(), other.as_list())))

    def as_list(self) -> list[float]:
        return [
            self.tokens,
            self.value_loss,
            self.values,
            self.returns,
            self.returns_squared,
            self.residuals,
            self.residuals_squared,
        ]

    def metrics(self) -> dict[str, float]:
        """`critic/explained_variance`: 1 - Var(returns - values) / Var(returns), 1 for a perfect
        critic, 0 for one no better than the mean return (0 when the returns do not vary)."""
        count = max(self.tokens, 1.0)
        returns_variance = self.returns_squared / count - (self.returns / count) ** 2
        residual_variance = self.residuals_squared / count - (self.residuals / count) ** 2
        explained = 1.0 - residual_variance / returns_variance if returns_variance > 1e-12 else 0.0
        return {
            "critic/value_loss": self.value_loss / count,
            "critic/explained_variance": explained,
            "critic/values_mean": self.values / count,
        }


class ValueModel(torch.nn.Module):
    """A causal LM's trunk (its decoder without the LM head) and a linear head giving one value
    per position: the expected return from the state after that position's token."""

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        super().__init__()
        self.trunk = getattr(causal_lm, causal_lm.base_model_prefix)
        self.head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        # Values start at 0 everywhere: the first returns, not a random head, set their scale.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self._no_split_modules = causal_lm._no_split_modules

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Summed over the head's one output rather than squeezed: FSDP hooks the root's output, which
        # must not be a view.
        return self.head(hidden).sum(dim=-1)


def whiten(advantages: torch.Tensor, mask: torch.Tensor, rank: RankInfo) -> torch.Tensor:
    """Advantages centred and scaled over every rank's response tokens of the micro-batch (one
    all-reduce: N ranks compute what one rank computes)."""
    masked = advantages * mask
    sums = torch.tensor(
        [float(mask.sum()), float(masked.sum()), float((masked * advantages).sum())], dtype=torch.float64
    )
    if rank.world_size > 1:
        dist.all_reduce(sums, group=rank.control)
    count, total, squares = sums.tolist()
    if count == 0:
        return advantages
    mean = total / count
    std = max(squares / count - mean**2, 0.0) ** 0.5
    return (advantages - mean) / (std + 1e-6) * mask


class ShardedCritic:
    def __init__(self, config: TrainerConfig, rank: RankInfo, compute_dtype: torch.dtype, shard) -> None:
        """`shard`: how the policy is sharded (`policy.shard_model`), applied to the value model alike."""
        self.config = config
        self.rank = rank
        self.model = shard(
            ValueModel(load_causal_lm(config.model_dir).to(rank.device)).to(rank.device), rank, compute_dtype
        )
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.critic_learning_rate)
        self.snapshot = None
        """The value model as the training step began, for the old values of micro-batches that
        arrive after the step's first optimizer step (with one mini-batch per step none does)."""
        if config.mini_batches_per_step > 1:
            snapshot = ValueModel(load_causal_lm(config.model_dir).to(rank.device)).to(rank.device)
            snapshot.requires_grad_(False)
            self.snapshot = shard(snapshot, rank, compute_dtype)
        self.pending_tokens = 0.0
        """Response tokens (every rank's) trained on since the last optimizer step."""

    def values(self, batch: MicroBatch) -> torch.Tensor:
        """[B, L-1]: the value of the state each response token is sampled in, in fp32, with gradient."""
        return self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[:, :-1].float()

    def old_values(self, batch: MicroBatch, values: torch.Tensor, from_snapshot: bool) -> torch.Tensor:
        """The values as the training step began: the snapshot's once the critic stepped in this step."""
        if not from_snapshot:
            return values.detach()
        with torch.no_grad():
            return self.snapshot(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[:, :-1].float()

    def loss(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, CriticSums]:
        """The micro-batch's value loss as an unnormalised sum over its response tokens, and its sums."""
        total = clipped_value_loss(values, old_values, returns, mask, self.config.value_clip)
        with torch.no_grad():
            residuals = (returns - values) * mask
            figures = torch.stack(
                [
                    mask.sum(),
                    total.detach(),
                    (values * mask).sum(),
                    (returns * mask).sum(),
                    (returns * returns * mask).sum(),
                    residuals.sum(),
                    (residuals * residuals).sum(),
                ]
            )
        return total, CriticSums(*figures.tolist())

    def idle_loss(self, dummy: torch.Tensor, from_snapshot: bool) -> torch.Tensor:
        """A rank with no sample of the micro-batch runs the same forwards (FSDP collectives need every
        rank) and a loss that contributes nothing."""
        loss = self.model(input_ids=dummy).sum() * 0.0
        if from_snapshot:
            with torch.no_grad():
                self.snapshot(input_ids=dummy)
        return loss

    def copy_to_snapshot(self, copy_shards) -> None:
        if self.snapshot is not None:
            copy_shards(self.model, self.snapshot)

    def clip_gradients(self) -> float:
        """Normalises the mini-batch's gradients by its response tokens and clips them; returns
        their norm (the policy steps both models only when both norms are finite)."""
        count, self.pending_tokens = self.pending_tokens, 0.0
        return clipped_norm(self.model, count, self.config.max_grad_norm)

    def step(self) -> None:
        self.optimizer.step()
        self.clear()

    def clear(self) -> None:
        """Drops the accumulated gradients (a refused step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_tokens = 0.0
