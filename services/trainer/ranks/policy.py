"""The policy sharded with FSDP2 over the trainer's ranks, and what every rank does with it.

Each decoder layer is its own FSDP unit, the root holds the rest (embeddings, final norm, lm_head):
every parameter is a DTensor sharded along dim 0 (torch.chunk semantics). Every method here is
collective: every rank calls it with the same arguments in the same order (rank 0 broadcasts
them, see `ranks.py`), and it runs on the rank's torch thread.

Data parallel: each rank computes the loss of its share of a micro-batch's samples, so the sum
of the ranks' gradients is the micro-batch's gradient. FSDP would average the ranks' gradients;
its divide factor is set to 1 with plain SUM reductions (gloo has no PREMUL_SUM), so N ranks
compute what one rank computes.

Each micro-batch's loss is an unnormalised sum (over sequences or tokens, `algorithms.losses.policy_loss`):
the mini-batch's size is known only once its last micro-batch has streamed in, so the optimizer
step divides the accumulated gradients by it (gradients are linear: this is exact).

Precision (`TrainerConfig.precision`): the shards are fp32 master weights; under bf16 FSDP gathers
bf16 copies for the forward and backward and reduces the gradients in fp32."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from rlmesh.lifecycle import return_freed_memory
from rlmesh.models.families import check_model_dir
from rlmesh.models.loading import load_causal_lm, weights_dtype
from rlmesh.models.tokenizer import load_hf_tokenizer, stop_token_ids
from rlmesh.models.tp_layout import ModelShape, fsdp_rows
from rlmesh.transfer.shards import LocalShard
from services.trainer.algorithms import ADVANTAGE_ESTIMATORS
from services.trainer.algorithms.losses import policy_loss
from services.trainer.config import TrainerConfig
from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.ranks.checkpoint import Trained, TrainerState, load_checkpoint, save_checkpoint
from services.trainer.ranks.critic import CriticSums, ShardedCritic, whiten
from services.trainer.ranks.distributed import RankInfo
from services.trainer.ranks.evaluation import EvalRequest, EvalResponses, generate_responses
from services.trainer.ranks.optimizing import NonFiniteUpdate, clipped_norm, sample_names


@dataclass(frozen=True, slots=True)
class MicroBatchStats:
    """A micro-batch's figures over every rank (what one rank would compute alone). Each is a mean
    over the micro-batch; `loss_count` and `tokens` are the weights to average them with."""

    loss: float
    """Mean loss: per-sequence token means averaged (sequence-mean) or token losses averaged
    (token-mean). A mini-batch's loss is its micro-batches' loss weighted by loss_count."""
    loss_count: int
    """Sequences (sequence-mean) or response tokens (token-mean) the loss averages over."""
    tokens: int
    """Response tokens: the weight of every figure below."""
    kl: float
    """k3 KL of the policy to the reference (to the behaviour policy without a reference)."""
    clip_fraction: float
    """Share of tokens whose ratio lay outside the clip range."""
    importance_weight_mean: float
    """pi_prox / pi_behav before the cap (under `ppo`, pi_prox is the current policy)."""
    importance_weight_max: float
    capped_fraction: float
    """Share of tokens whose pi_prox / pi_behav exceeded importance_cap."""
    behaviour_kl: float
    """k3 estimate of KL(pi_behav || pi_prox): how far the rollouts' sampler is from pi_prox."""
    critic: CriticSums | None = None
    """The critic's sums over every rank's share (advantage_estimator `gae`)."""


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the forward and backward run in (`TrainerConfig.precision`): auto is bf16 on CUDA."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def publish_dtype(setting: str, model_dir: str | Path) -> torch.dtype:
    """The dtype a weight version is handed over in (`TrainerConfig.weights_dtype`): auto is the
    model folder's, which the rollout engines serve."""
    if setting == "auto":
        return weights_dtype(AutoConfig.from_pretrained(model_dir))
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[setting]


def shard_model(model: torch.nn.Module, rank: RankInfo, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """FSDP2: each module of a class HF marks as not to be split (the decoder layers), then the root.
    The shards stay fp32; a lower `dtype` is what FSDP gathers them in for compute."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in no_split]
    if not units:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard (_no_split_modules)")
    precision = (
        MixedPrecisionPolicy()
        if dtype == torch.float32
        else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    )
    for unit in units:
        fully_shard(unit, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def copy_shards(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Every rank's shards of `source` copied into `target`'s (a model of the same shape)."""
    # After a forward without backward (an evaluation, a snapshot's forward) a root holds its
    # gathered parameters in place of its shards: back to the shards, on both sides.
    reshard(source)
    reshard(target)
    snapshot = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            destination = snapshot[name].to_local() if isinstance(snapshot[name], DTensor) else snapshot[name]
            destination.copy_(param.to_local() if isinstance(param, DTensor) else param)


def reshard(model: torch.nn.Module) -> None:
    """Frees every gathered parameter of `model`, so its next forward gathers its shards afresh.
    The root keeps its parameters gathered after a forward without backward (FSDP2 expects the
    backward to use them at once), and a later forward would reuse them even after its shards
    changed."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ShardedPolicy:
    def __init__(self, config: TrainerConfig, rank: RankInfo) -> None:
        self.config = config
        self.rank = rank
        torch.manual_seed(config.seed)
        # An architecture without layout rules is refused before any weight is loaded.
        check_model_dir(config.model_dir)
        self.compute_dtype = compute_dtype(config.precision, rank.device)
        self.weights_dtype = publish_dtype(config.weights_dtype, config.model_dir)
        """What each published version's shards are cast to."""
        policy = load_causal_lm(config.model_dir).to(rank.device)
        self.shape = ModelShape.from_hf_config(policy.config)
        policy.train()
        self.model = shard_model(policy, rank, self.compute_dtype)
        self.reference = None
        """The frozen reference sharded over the ranks (placement: ref_logp with train); with the
        reference in its own process the samples carry its log-probabilities instead."""
        if config.kl_coef > 0 and not config.reference_apart:
            reference = load_causal_lm(config.model_dir).to(rank.device)
            reference.requires_grad_(False)
            self.reference = shard_model(reference, rank, self.compute_dtype)
        self.proximal = None
        """The policy as it was at the start of the training step, for the proximal log-probabilities
        of micro-batches that arrive after the step's first optimizer step (decoupled and tis only;
        with one mini-batch per step none does)."""
        if config.loss != "ppo" and config.mini_batches_per_step > 1:
            proximal = load_causal_lm(config.model_dir).to(rank.device)
            proximal.requires_grad_(False)
            proximal.train(policy.training)
            self.proximal = shard_model(proximal, rank, self.compute_dtype)
        needs_critic = ADVANTAGE_ESTIMATORS.get(config.advantage_estimator).needs_critic
        self.critic = ShardedCritic(config, rank, self.compute_dtype, shard_model) if needs_critic else None
        """The value model of PPO with a critic (advantage_estimator `gae`)."""
        self.training_step = 0
        """The training step under way (BeginStep): the policy waits critic_warmup_steps of them."""
        # The full tensors each rank loaded are freed now that it keeps only its shards.
        return_freed_memory()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate)
        self.tokenizer = load_hf_tokenizer(config.model_dir)
        self.stop_ids = stop_token_ids(self.model.config, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        """Positions the model takes (0: not known): a multi-turn episode's whole stream must fit."""
        self.pending_count = 0.0
        """Sequences or tokens (every rank's) trained on since the last optimizer step."""
        self.pending_samples: list[str] = []
        """The samples trained on since the last optimizer step, by id: a refused step names them."""
        self.step_begun = False
        """BeginStep was sent at least once (the decoupled and tis losses need it every step)."""
        self.stepped_in_step = False
        """The optimizer stepped since the training step began: the policy is no longer pi_prox."""
        self._read_by: torch.cuda.Event | None = None
        """Recorded on a side stream after its last read of the shards (a publish's copy to the host)."""

    def share(self, samples: list[TrainingSample]) -> list[TrainingSample]:
        """This rank's samples of a micro-batch."""
        return samples[self.rank.rank :: self.rank.world_size]

    def begin_step(self, step: int = 0) -> None:
        """Training step `step` starts: the current policy becomes the proximal policy pi_prox of
        every micro-batch until the next begin_step (and the critic the source of the old values)."""
        self.step_begun = True
        self.stepped_in_step = False
        self.training_step = step
        if self.proximal is not None:
            copy_shards(self.model, self.proximal)
        if self.critic is not None:
            self.critic.copy_to_snapshot(copy_shards)

    def _proximal_from_snapshot(self) -> bool:
        """Whether this micro-batch's pi_prox needs the step-start snapshot (the optimizer already
        stepped in this step) rather than the current policy's own log-probabilities."""
        if self.config.loss == "ppo":
            return False
        if not self.step_begun:
            raise RuntimeError(
                f"loss {self.config.loss!r} needs the policy at the start of each training step: "
                "the training loop must send BeginStep before a step's first micro-batch"
            )
        if self.stepped_in_step and self.proximal is None:
            raise RuntimeError(
                "a micro-batch arrived after an optimizer step of the same training step, but with "
                "mini_batches_per_step 1 no step-start snapshot is kept: send BeginStep at each step"
            )
        return self.stepped_in_step

    def backward(self, samples: list[TrainingSample]) -> MicroBatchStats:
        """Forward and backward of this rank's share of the micro-batch (the critic's too, with
        one); gradients accumulate. A loss that is not finite (on any rank) refuses the mini-batch's
        step: NonFiniteUpdate on every rank, naming the samples, the gradients cleared."""
        config = self.config
        share = self.share(samples)
        from_snapshot = self._proximal_from_snapshot()
        critic_from_snapshot = self.critic is not None and self.stepped_in_step and self.critic.snapshot is not None
        # Decided on the whole micro-batch, so every rank runs the same reference forwards (FSDP
        # collectives): the reference's own forward only for samples that bring no log-probabilities.
        given = all(s.reference_logprobs is not None for s in samples)
        if config.kl_coef > 0 and self.reference is None and not given:
            raise RuntimeError(
                "kl_coef > 0 with the reference in its own process (placement): every sample "
                "must carry its reference_logprobs"
            )
        own_reference = self.reference is not None and not given
        critic_sums = CriticSums()
        nonfinite = [0.0] * len(samples)
        """Per sample of the micro-batch, 1 where its loss is not finite (summed over the ranks)."""
        if share:
            batch = build_micro_batch(share, self.pad_id).to(self.rank.device)
            proximal = None
            if from_snapshot:
                with torch.no_grad():
                    proximal = token_logprobs(self.proximal, batch)
                # Frees the gathered root (embeddings, lm_head): the snapshot needs it only briefly.
                reshard(self.proximal)
            reference = batch.reference_logprobs
            if own_reference:
                with torch.no_grad():
                    reference = token_logprobs(self.reference, batch)
            advantages, kl_coef, value_loss = batch.advantages, config.kl_coef, None
            if self.critic is not None:
                advantages, value_loss, critic_sums = self._critic_pass(batch, reference, critic_from_snapshot)
                # The KL penalty is in the critic's rewards, not the loss.
                kl_coef = 0.0
            logprobs = token_logprobs(self.model, batch)
            loss, totals = policy_loss(
                logprobs,
                batch.behaviour_logprobs,
                advantages,
                batch.response_mask,
                loss=config.loss,
                proximal_logprobs=proximal,
                clip_low=config.clip_low,
                clip_high=config.clip_high,
                importance_cap=config.importance_cap,
                cap_mode=config.importance_cap_mode,
                aggregation=config.loss_aggregation,
                reference_logprobs=reference,
                kl_coef=kl_coef,
            )
            sums = [
                totals.loss,
                totals.count,
                totals.tokens,
                totals.kl,
                totals.clipped_tokens,
                totals.importance_weight,
                totals.capped_tokens,
                totals.behaviour_kl,
            ]
            weight_max = totals.importance_weight_max
            # This rank's rows are the micro-batch's samples rank, rank + world_size, ...
            for row in totals.nonfinite_rows:
                nonfinite[self.rank.rank + row * self.rank.world_size] = 1.0
        else:
            # More ranks than samples: FSDP's all-gathers and reduce-scatters need every rank, so
            # this one runs the same forwards and a backward that contributes nothing.
            dummy = torch.tensor([[self.pad_id]], device=self.rank.device)
            with torch.no_grad():
                if from_snapshot:
                    self.proximal(input_ids=dummy)
                    reshard(self.proximal)
                if own_reference:
                    self.reference(input_ids=dummy)
            value_loss = None
            if self.critic is not None:
                # The critic's forwards and the whitening's all-reduce in the order the other ranks run them.
                value_loss = self.critic.idle_loss(dummy, critic_from_snapshot)
                whiten(
                    torch.zeros(1, 1, device=self.rank.device), torch.zeros(1, 1, device=self.rank.device), self.rank
                )
            loss = self.model(input_ids=dummy).logits.sum() * 0.0
            sums, weight_max = [0.0] * 8, 0.0
        # The critic's graph apart from the policy's, after it: every rank reduces their gradients in one order.
        loss.backward()
        if value_loss is not None:
            value_loss.backward()
        critic_figures = critic_sums.as_list()
        summed = torch.tensor(sums + critic_figures + nonfinite, dtype=torch.float64)
        largest = torch.tensor([weight_max], dtype=torch.float64)
        if self.rank.world_size > 1:
            dist.all_reduce(summed, group=self.rank.control)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.rank.control)
        figures = summed.tolist()
        loss_sum, count, tokens, kl, clipped, weights, capped, behaviour_kl = figures[:8]
        critic_end = 8 + len(critic_figures)
        critic = CriticSums(*figures[8:critic_end]) if self.critic is not None else None
        names = [
            getattr(sample, "sample_id", "") or f"micro-batch sample {index}" for index, sample in enumerate(samples)
        ]
        self.pending_samples += names
        if not math.isfinite(loss_sum) or (critic is not None and not math.isfinite(critic.value_loss)):
            poisoned = [names[i] for i, flag in enumerate(figures[critic_end:]) if flag]
            self._refuse("non-finite loss", poisoned or names)
        if critic is not None:
            self.critic.pending_tokens += critic.tokens
        self.pending_count += count
        per_token = max(tokens, 1.0)
        return MicroBatchStats(
            loss=loss_sum / max(count, 1.0),
            loss_count=int(count),
            tokens=int(tokens),
            kl=kl / per_token,
            clip_fraction=clipped / per_token,
            importance_weight_mean=weights / per_token,
            importance_weight_max=largest.item(),
            capped_fraction=capped / per_token,
            behaviour_kl=behaviour_kl / per_token,
            critic=critic,
        )

    def _critic_pass(
        self, batch, reference: torch.Tensor | None, from_snapshot: bool
    ) -> tuple[torch.Tensor, torch.Tensor, CriticSums]:
        """The critic's values of the share, GAE's per-token advantages (whitened over the
        micro-batch) from the rewards (the KL penalty to the reference included, if any) and the
        values as the step began, and the value loss against GAE's returns."""
        config = self.config
        mask = batch.response_mask
        values = self.critic.values(batch)
        old_values = self.critic.old_values(batch, values, from_snapshot)
        rewards = batch.rewards
        if reference is not None and config.kl_coef > 0:
            rewards = rewards - config.kl_coef * (batch.behaviour_logprobs - reference) * mask
        estimate = ADVANTAGE_ESTIMATORS.get(config.advantage_estimator).compute
        advantages, returns = estimate(rewards, old_values, mask, config.gamma, config.gae_lambda)
        advantages = whiten(advantages.float(), mask, self.rank)
        value_loss, sums = self.critic.loss(values, old_values, returns.float(), mask)
        return advantages, value_loss, sums

    def optimizer_step(self) -> float:
        """Normalises the accumulated gradients by the mini-batch's size (sequences or tokens),
        clips their norm (over every rank's shards), steps, clears; returns the norm before clipping.
        A gradient that is not finite (the policy's or the critic's) never reaches either optimizer:
        NonFiniteUpdate on every rank, naming the mini-batch's samples, the gradients cleared."""
        count, self.pending_count = self.pending_count, 0.0
        self._wait_for_readers()
        norm = clipped_norm(self.model, count, self.config.max_grad_norm)
        critic_norm = self.critic.clip_gradients() if self.critic is not None else 0.0
        if not math.isfinite(norm):
            self._refuse(f"the policy's gradient (norm {norm}) is not finite", self.pending_samples)
        if not math.isfinite(critic_norm):
            self._refuse(f"the critic's gradient (norm {critic_norm}) is not finite", self.pending_samples)
        # During the critic's warm-up the policy's gradients are measured and dropped.
        if self.critic is None or self.training_step >= self.config.critic_warmup_steps:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.step()
        self.pending_samples = []
        self.stepped_in_step = True
        return norm

    def _refuse(self, what: str, samples: list[str]) -> NoReturn:
        """Refuses the mini-batch's optimizer step: its gradients are cleared, the weights and the
        optimizers' state stay as they are. Every rank decides it alike (on all-reduced figures)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.clear()
        self.pending_count = 0.0
        self.pending_samples = []
        raise NonFiniteUpdate(
            f"step {self.training_step}: {what} in samples {sample_names(samples)}: the optimizer step is "
            "refused, the weights and the optimizer state are unchanged"
        )

    def evaluate(self, request: EvalRequest) -> EvalResponses:
        """Held-out responses; every rank runs the same generation (FSDP forwards need every rank),
        kept in lockstep (synced_gpus) until every rank is done."""
        return generate_responses(
            self.model,
            request,
            self.stop_ids,
            self.pad_id,
            synced_gpus=self.rank.world_size > 1,
            device=self.rank.device,
        )

    def guard_writes(self, read_by: torch.cuda.Event | None) -> None:
        """Nothing changes the shards before `read_by` (None: nothing reads them in the background):
        a publish's copy to the host reads them on a side stream while training goes on."""
        self._read_by = read_by

    def _wait_for_readers(self) -> None:
        if self._read_by is not None:
            torch.cuda.current_stream(self.rank.device).wait_event(self._read_by)
            self._read_by = None

    def local_shards(self) -> dict[str, LocalShard]:
        """This rank's fp32 rows of every parameter (HF names, tied weights once): views, no copy,
        no gather; the hand-off casts them to `weights_dtype`."""
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
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in self.model.named_parameters()
        }

    @property
    def trained_critic(self) -> Trained | None:
        """The critic and its optimizer, checkpointed with the policy (None: no critic)."""
        return (self.critic.model, self.critic.optimizer) if self.critic is not None else None

    def save(self, directory: Path, state: TrainerState, export_hf: bool) -> Path:
        return save_checkpoint(
            directory,
            self.model,
            self.optimizer,
            state,
            export_hf=export_hf,
            tokenizer_dir=Path(self.config.model_dir),
            group=self.rank.control,
            critic=self.trained_critic,
        )

    def load(self, path: Path) -> TrainerState:
        self._wait_for_readers()
        return load_checkpoint(path, self.model, self.optimizer, critic=self.trained_critic)
