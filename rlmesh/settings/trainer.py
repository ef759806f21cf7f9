"""The trainer's settings a job sets: the algorithm (`[algorithm]`: the loss and the step's shape)
and how the trainer process runs (`[trainer]`). `services/trainer/config.py` adds the wiring."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlmesh.config import ServerSettings, StrictModel

LossKind = Literal["ppo", "decoupled", "tis"]
"""The policy losses registered in `services/trainer/algorithms/losses.py` (a test keeps them equal)."""
AdvantageEstimatorKind = Literal["grpo", "rloo", "reinforce_pp", "gae"]
"""The advantage estimators registered in `services/trainer/algorithms/advantages.py` (a test keeps them equal)."""
LossAggregation = Literal["sequence-mean", "token-mean"]
CapMode = Literal["truncate", "drop"]
Role = Literal["train", "logp", "ref_logp"]
"""The trainer's roles: `train` (forward and backward of the policy), `logp` (the proximal
policy's log-probabilities: the policy as the step began) and `ref_logp` (the frozen reference's)."""
Placement = list[list[Role]]
REFERENCE_APART: Placement = [["train", "logp"], ["ref_logp"]]
"""The reference in a process of its own, scoring groups as they arrive while the ranks train."""
REFERENCE_COLOCATED: Placement = [["train", "logp", "ref_logp"]]
"""The reference sharded over the trainer's ranks, its forward inside each training micro-batch."""


def check_placement(placement: Placement) -> None:
    """Raises ValueError unless `placement` puts every role in exactly one process group and
    `train` and `logp` in the same one."""
    roles = [role for group in placement for role in group]
    repeated = sorted({r for r in roles if roles.count(r) > 1})
    missing = sorted(set(Role.__args__) - set(roles))
    if repeated or missing or not all(placement):
        raise ValueError(
            f"placement must list process groups naming each of train, logp, ref_logp exactly once "
            f"(e.g. {REFERENCE_APART}); repeated: {repeated}, missing: {missing}"
        )
    if not any({"train", "logp"} <= set(group) for group in placement):
        raise ValueError(
            "placement puts logp apart from train: logp (the proximal policy's log-probabilities) needs "
            "the live policy's weights, which only train's processes hold"
        )


def reference_apart(placement: Placement) -> bool:
    return ["ref_logp"] in placement


class LossConfig(StrictModel):
    """The policy loss and its regularisers."""

    learning_rate: float = Field(default=3e-4, gt=0)
    """Adam's learning rate for the policy."""
    loss: LossKind = "ppo"
    """The policy loss (`services/trainer/algorithms/losses.py`): `ppo` clips the ratio to the
    behaviour policy that sampled (on-policy, engine and trainer agree); `decoupled` is AReaL's
    decoupled PPO for stale rollouts (max_staleness >= 1): the clip anchors on the policy at the
    start of the training step and pi_prox / pi_behav, bounded by importance_cap, weighs each
    token; `tis` is truncated importance sampling for on-policy runs whose engine computes
    probabilities differently from the trainer: the same objective, the weight always truncated."""
    importance_cap: float = Field(default=2.0, ge=1)
    """Bound on pi_prox / pi_behav under `decoupled` and `tis`."""
    importance_cap_mode: CapMode = "truncate"
    """What `decoupled` does with a token whose weight exceeds importance_cap: `truncate` weighs it
    by the cap; `drop` leaves it out, as AReaL's code does. `tis` always truncates."""
    clip_epsilon: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range, both sides: the ratio is kept in [1 - clip_epsilon, 1 + clip_epsilon]
    unless clip_epsilon_low or clip_epsilon_high says otherwise."""
    clip_epsilon_low: float | None = Field(default=None, gt=0, lt=1)
    """Lower clip range (None: clip_epsilon): the ratio's floor is 1 - clip_epsilon_low."""
    clip_epsilon_high: float | None = Field(default=None, gt=0)
    """Upper clip range (None: clip_epsilon): the ratio's ceiling is 1 + clip_epsilon_high. DAPO's
    clip-higher sets it above the lower one (0.28 against 0.2) so that unlikely tokens with a
    positive advantage can grow, which keeps the policy's entropy from collapsing."""
    loss_aggregation: LossAggregation = "sequence-mean"
    """How a mini-batch's token losses become its loss: `sequence-mean` averages each sequence's
    tokens, then the sequences; `token-mean` (DAPO) averages every token of the mini-batch, so a
    long response counts in proportion to its length."""
    overlong_buffer_tokens: int = Field(default=0, ge=0)
    """DAPO's soft overlong punishment: a response longer than max_tokens - overlong_buffer_tokens
    loses reward linearly, up to overlong_penalty at its task's max_tokens; 0 is off."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Reward lost by a response of exactly its task's max_tokens under overlong_buffer_tokens."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to a frozen reference (the initial policy); 0 loads no reference."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm before each optimizer step."""
    advantage_estimator: AdvantageEstimatorKind = "grpo"
    """How each sample's advantage is estimated (`services/trainer/algorithms/advantages.py`):
    `grpo` normalises each group's rewards by the group's mean and standard deviation; `rloo`
    subtracts the mean reward of the group's other samples; `reinforce_pp` (REINFORCE++ with a
    baseline) subtracts the group's mean, then normalises over the micro-batch; `gae` trains a
    critic (a value model) beside the policy and estimates per-token advantages from its values
    (PPO with a critic: the settings below)."""
    critic_learning_rate: float = Field(default=5e-4, gt=0)
    """Adam's learning rate for the critic (advantage_estimator `gae`)."""
    critic_warmup_steps: int = Field(default=0, ge=0)
    """Training steps at the start during which only the critic learns: the policy's optimizer
    steps wait until its values have seen some returns."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """GAE's discount of later tokens' rewards."""
    gae_lambda: float = Field(default=1.0, ge=0, le=1)
    """GAE's λ: 1 takes the whole return less the value (no bias from the critic, more variance);
    lower trusts the critic's values more."""
    value_clip: float = Field(default=0.5, gt=0)
    """The critic's loss is the larger of the squared errors of its value and of its value kept
    within value_clip of the value at the step's start (PPO's value clipping)."""

    @model_validator(mode="after")
    def _cap_mode_applies(self) -> LossConfig:
        if self.loss == "tis" and self.importance_cap_mode == "drop":
            raise ValueError(
                "importance_cap_mode drop applies to the decoupled loss; tis truncates by definition "
                "(use loss = decoupled to drop tokens past the cap)"
            )
        return self

    @property
    def clip_low(self) -> float:
        return self.clip_epsilon if self.clip_epsilon_low is None else self.clip_epsilon_low

    @property
    def clip_high(self) -> float:
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high


class AlgorithmConfig(LossConfig):
    """What the trainer learns and in what steps: the loss (LossConfig) and the step's shape."""

    steps: int = Field(default=600, ge=1)
    """Training steps; each publishes a weight version."""
    prompts_per_step: int = Field(default=16, ge=1)
    """Prompts (groups) trained on per step, drawn from the tasks by weight."""
    group_size: int = Field(default=8, ge=2)
    """Samples per prompt; group-normalised advantages need at least two."""
    micro_batch_groups: int = Field(default=4, ge=1)
    """Most groups per forward/backward; micro-batches are trained on as they arrive."""
    min_micro_batch_groups: int = Field(default=1, ge=1)
    """Fewest groups an async micro-batch waits for (ordered ones, at max_staleness 0 or under the
    sync schedule, are always full). 1 trains whatever has arrived, so that when a step's longest
    response comes in only its own group is left to train."""
    micro_batch_max_tokens: int = Field(default=0, ge=0)
    """Token budget of a micro-batch (prompt + response of every sample; 0: none)."""
    mini_batches_per_step: int = Field(default=1, ge=1)
    """Optimizer steps per training step; prompts_per_step must divide evenly."""
    schedule: Literal["async", "sync"] = "async"
    """`async`: prompts are submitted up to max_staleness steps ahead (the manager's), every batch
    is read and scored as its groups finish, and a step trains on its groups as they come.
    `sync`: the plain synchronous loop, for reference: submit one step's prompts, wait for all
    its groups, train on them in prompt order, publish. At max_staleness 0 both give the same
    numbers bit for bit."""
    validation: Literal["background", "inline"] = "background"
    """Held-out evaluation every eval_every steps: `background` evaluates the version just
    published on spare rollout capacity, every prompt pinned to that version, while training goes
    on (filed under the step and `eval/weight_version` when it is done); `inline` generates on the
    trainer's own policy and training waits for it."""
    validation_priority: Literal["low", "normal"] = "low"
    """`low`: a background validation's requests are background work: an instance decodes them at
    the lowest CPU priority while nothing else shares its batch, so on a host shared with the
    trainer they take only the CPU training leaves. `normal`: like training requests."""
    episode_driver: Literal["process", "trainer"] = "process"
    """Where multi-turn tasks' episodes run (the environments' code, their turns and agent
    commands): `process`, a process of their own that rank 0 starts, so that the Python of a
    training step never delays an episode nor an episode a step (bench.agentic); `trainer`, rank
    0's own event loop, beside reward scoring (one process less)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no learning signal) is dropped
    and a new prompt drawn for the same step in its place, within the capacity rule."""
    placement: Placement = Field(default_factory=lambda: [list(g) for g in REFERENCE_APART])
    """Which of the trainer's roles share processes (with kl_coef > 0): [["train", "logp"],
    ["ref_logp"]] runs the frozen reference in a process of its own, started by rank 0, that scores
    each group as it arrives, off the training path; [["train", "logp", "ref_logp"]] shards it over
    the trainer's ranks and runs its forward in each training micro-batch. train and logp always
    share."""
    seed: int = 0
    """Seeds the prompt order and each prompt's sampling: the same seed draws the same prompts."""
    eval_every: int = Field(default=10, ge=1)
    """Steps between held-out evaluations."""
    checkpoint_every: int = Field(default=25, ge=1)
    """Steps between checkpoints (the last step is always checkpointed)."""

    @field_validator("placement")
    @classmethod
    def _placement_valid(cls, placement: Placement) -> Placement:
        check_placement(placement)
        return placement

    @model_validator(mode="after")
    def _batches_split(self) -> AlgorithmConfig:
        if self.prompts_per_step % self.mini_batches_per_step:
            raise ValueError("prompts_per_step must be a multiple of mini_batches_per_step")
        if (self.prompts_per_step // self.mini_batches_per_step) % self.micro_batch_groups:
            raise ValueError("prompts per mini-batch must be a multiple of micro_batch_groups (groups are never split)")
        if self.min_micro_batch_groups > self.micro_batch_groups:
            raise ValueError(
                f"min_micro_batch_groups ({self.min_micro_batch_groups}) must not exceed "
                f"micro_batch_groups ({self.micro_batch_groups})"
            )
        return self

    @property
    def reference_apart(self) -> bool:
        """The reference runs in a process of its own (kl_coef > 0 and ref_logp placed alone)."""
        return self.kl_coef > 0 and reference_apart(self.placement)


class TrainerSettings(StrictModel):
    """How the trainer process runs: device, precision, threads, hand-off, checkpoint resumption
    and deadlines."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    resume: bool = True
    """Continue from the newest checkpoint in the output folder if there is one."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the FSDP ranks, which picks their device: `nccl` runs each rank
    on one GPU, `gloo` on the CPU, `auto` is NCCL when CUDA is available, else gloo. Commands from
    rank 0 always travel on a gloo group. Without torchrun (one rank) the process forms a one-rank
    group by itself."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """What the policy computes in: `auto` is bf16 on CUDA and fp32 on CPU; `bf16` keeps fp32
    master weights (what the optimizer steps and checkpoints hold) and gathers bf16 copies for the
    forward and backward (FSDP2 mixed precision), with gradients reduced in fp32; `fp32` computes
    in fp32 throughout. The loss is computed in fp32 either way (logits upcast)."""
    threads: int = Field(default=1, ge=1)
    """Intra-op torch threads of each rank."""
    handoff: Literal["shm", "stream"] = "shm"
    """How each rank hands its FSDP shards to the weights service: `shm` writes them into a
    shared-memory file under /dev/shm and sends only the header (the weights service must run on
    the same host); `stream` sends them as 1 MiB chunks after the header (another host)."""
    collective_timeout_seconds: float = Field(default=1800.0, gt=0)
    """How long a rank waits in one collective; ranks other than 0 wait in one for rank 0's next
    command (while it waits for rollouts), so this must exceed rollout_timeout_seconds."""
    publish_timeout_seconds: float = Field(default=300.0, gt=0)
    """How long a version is handed over again while the weights service is unreachable (it is
    restarted by `rlmesh up`) before training fails."""
    manager_outage_seconds: float = Field(default=120.0, gt=0)
    """How long calls to the manager are retried while it is unreachable (`rlmesh up` restarts it
    on its journal) before training fails."""
    upload_timeout_seconds: float = Field(default=60.0, gt=0)
    """Deadline of one rank's UploadShards call (the weights service replies once it copied the bytes)."""
    rpc_timeout_seconds: float = Field(default=10.0, gt=0)
    """Deadline of the trainer's other calls to the manager and the weights service."""
    rollout_timeout_seconds: float = Field(default=300.0, gt=0)
    """Deadline for one step's rollouts to arrive."""
    startup_timeout_seconds: float = Field(default=120.0, gt=0)
    """How long the trainer waits at start for the manager, the weights service and its ranks."""

    @model_validator(mode="after")
    def _collectives_outwait_rollouts(self) -> TrainerSettings:
        if self.collective_timeout_seconds <= self.rollout_timeout_seconds:
            raise ValueError(
                "collective_timeout_seconds must exceed rollout_timeout_seconds "
                "(ranks other than 0 wait in a collective while rank 0 waits for rollouts)"
            )
        return self
