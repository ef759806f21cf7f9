"""The policy sharded with FSDP2 over the trainer's ranks, and what every rank does with it.

Each decoder layer is its own FSDP unit, the root holds the rest (embeddings, final norm, lm_head):
every parameter is a DTensor sharded along dim 0 (torch.chunk semantics). Every method here is
collective: every rank calls it with the same arguments in the same order (rank 0 broadcasts
them, see `ranks.py`), and it runs on the rank's torch thread.

Data parallel: each rank computes the loss of its share of a micro-batch's samples, so the sum
of the ranks' gradients is the micro-batch's gradient. FSDP would average the ranks' gradients;
its divide factor is set to 1 with plain SUM reductions (gloo has no PREMUL_SUM), so N ranks
compute what one rank computes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlmesh.lifecycle import return_freed_memory
from rlmesh.models.families import check_model_dir
from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import load_hf_tokenizer, stop_token_ids
from rlmesh.models.tp_layout import ModelShape, fsdp_rows
from rlmesh.shards import LocalShard
from services.trainer.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.distributed import RankInfo
from services.trainer.evaluation import EvalRequest, EvalResponses, generate_responses
from services.trainer.grpo import grpo_loss


@dataclass(frozen=True, slots=True)
class MicroBatchStats:
    """A micro-batch's figures summed over every rank (what one rank would compute alone)."""

    loss: float
    kl: float
    clip_fraction: float
    tokens: int


def shard_model(model: torch.nn.Module, rank: RankInfo) -> torch.nn.Module:
    """FSDP2: each module of a class HF marks as not to be split (the decoder layers), then the root."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in no_split]
    if not units:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard (_no_split_modules)")
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


class ShardedPolicy:
    def __init__(self, config: TrainerConfig, rank: RankInfo) -> None:
        self.config = config
        self.rank = rank
        torch.manual_seed(config.seed)
        # An architecture without layout rules is refused before any weight is loaded.
        check_model_dir(config.model_dir)
        policy = load_causal_lm(config.model_dir).to(rank.device)
        self.shape = ModelShape.from_hf_config(policy.config)
        policy.train()
        self.model = shard_model(policy, rank)
        self.reference = None
        if config.grpo.kl_coef > 0:
            reference = load_causal_lm(config.model_dir).to(rank.device)
            reference.requires_grad_(False)
            self.reference = shard_model(reference, rank)
        # The full tensors each rank loaded are freed now that it keeps only its shards.
        return_freed_memory()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.grpo.learning_rate)
        self.tokenizer = load_hf_tokenizer(config.model_dir)
        self.stop_ids = stop_token_ids(self.model.config, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.normaliser = config.prompts_per_step // config.mini_batches_per_step * config.group_size
        """Sequences per mini-batch: the loss of every micro-batch is divided by it."""

    def share(self, samples: list[TrainingSample]) -> list[TrainingSample]:
        """This rank's samples of a micro-batch."""
        return samples[self.rank.rank :: self.rank.world_size]

    def backward(self, samples: list[TrainingSample]) -> MicroBatchStats:
        """Forward and backward of this rank's share of the micro-batch; gradients accumulate."""
        grpo = self.config.grpo
        share = self.share(samples)
        if share:
            batch = build_micro_batch(share, self.pad_id)
            batch = type(batch)(*(t.to(self.rank.device) for t in (batch.input_ids, batch.attention_mask, batch.response_mask,
                                                                   batch.behaviour_logprobs, batch.advantages, batch.temperatures)))
            logprobs = token_logprobs(self.model, batch)
            reference = None
            if self.reference is not None:
                with torch.no_grad():
                    reference = token_logprobs(self.reference, batch)
            loss, stats = grpo_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask,
                                    grpo.clip_epsilon, self.normaliser, reference, grpo.kl_coef)
            tokens = float(batch.response_mask.sum())
            figures = [loss.item(), stats.kl * tokens, stats.clip_fraction * tokens, tokens]
        else:
            # More ranks than samples: FSDP's all-gathers and reduce-scatters need every rank, so
            # this one runs a forward and backward that contributes nothing.
            dummy = torch.tensor([[self.pad_id]], device=self.rank.device)
            if self.reference is not None:
                with torch.no_grad():
                    self.reference(input_ids=dummy)
            loss = self.model(input_ids=dummy).logits.sum() * 0.0
            figures = [0.0, 0.0, 0.0, 0.0]
        loss.backward()
        totals = torch.tensor(figures, dtype=torch.float64)
        if self.rank.world_size > 1:
            dist.all_reduce(totals, group=self.rank.control)
        loss_sum, kl_sum, clip_sum, tokens = totals.tolist()
        return MicroBatchStats(loss=loss_sum, kl=kl_sum / max(tokens, 1.0), clip_fraction=clip_sum / max(tokens, 1.0),
                               tokens=int(tokens))

    def optimizer_step(self) -> float:
        """Clips the gradient norm (over every rank's shards), steps, clears; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grpo.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def evaluate(self, request: EvalRequest) -> EvalResponses:
        """Held-out responses; every rank runs the same generation (FSDP forwards need every rank),
        kept in lockstep (synced_gpus) until every rank is done."""
        return generate_responses(self.model, request, self.stop_ids, self.pad_id, synced_gpus=self.rank.world_size > 1,
                                  device=self.rank.device)

    def local_shards(self) -> dict[str, LocalShard]:
        """This rank's rows of every parameter (HF names, tied weights once): views, no copy, no gather."""
        shards = {}
        for name, param in self.model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            rows = fsdp_rows(param.shape[0], self.rank.world_size, self.rank.rank)
            if local.shape[0] != rows[1] - rows[0]:
                raise RuntimeError(f"{name}: rank {self.rank.rank} holds {local.shape[0]} rows, expected rows {rows}")
            shards[name] = LocalShard(local.detach(), tuple(param.shape), *rows)
        return shards

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole on every rank. For tests only: never on the hand-off path."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                for name, p in self.model.named_parameters()}

    def save(self, directory: Path, state: TrainerState, export_hf: bool) -> Path:
        return save_checkpoint(directory, self.model, self.optimizer, state, export_hf=export_hf,
                               tokenizer_dir=Path(self.config.model_dir), group=self.rank.control)

    def load(self, path: Path) -> TrainerState:
        return load_checkpoint(path, self.model, self.optimizer)
