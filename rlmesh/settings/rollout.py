"""A rollout instance's settings a job sets (`[rollout]`): its engine, weight receiver and
deadlines. `services/rollout/config.py` adds the wiring (its socket and id, the manager's address,
the model folder and the dtype the job's model section picks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlmesh.config import ServerSettings, StrictModel


class VllmConfig(StrictModel):
    kv_cache_gib: int = Field(default=1, ge=1)
    """KV-cache memory on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype vLLM serves the model in."""
    max_model_len: int = Field(default=0, ge=0)
    """0: the model's own limit."""


class SyntheticConfig(StrictModel):
    """The synthetic engine (benchmarks only): timed tokens from no model."""

    throughput_tokens_per_second: float = Field(default=2000.0, gt=0)
    """Tokens per second of a full batch at speed 1: a decode step of b sequences takes b / throughput."""
    min_step_seconds: float = Field(default=0.004, gt=0)
    """Shortest decode step (a lone sequence's per-token latency) at speed 1."""
    speed: float = Field(default=1.0, gt=0)
    """This instance's speed factor: every step takes 1/speed as long."""
    length: Literal["fixed", "uniform", "lognormal"] = "lognormal"
    """Response length distribution; lognormal gives a long tail."""
    mean_tokens: float = Field(default=200.0, gt=0)
    sigma: float = Field(default=1.0, ge=0)
    """Spread: the lognormal's sigma, or the uniform's half-width as a fraction of the mean."""
    stream_interval: int = Field(default=1, ge=1)
    """Tokens per chunk (the last chunk may be shorter), like vLLM's stream_interval."""
    vocab_size: int = Field(default=32_000, ge=2)
    """Token ids are drawn below it; with a model folder, below the model's vocabulary too (a
    trainer embeds them)."""
    tick_seconds: float = Field(default=0.002, gt=0)
    """How often the engine advances its sequences; below it, steps are accumulated."""
    fail_after_requests: int | None = Field(default=None, ge=0)
    """Fault injection: every request after the first this many fails at once (INTERNAL), as on an
    instance whose engine core died while its server stayed up (0: every one); None: none fails."""


EngineKind = Literal["torch", "vllm", "synthetic"]
"""`synthetic` is for benchmarks only, never the default: its tokens come from no model."""


class EngineSettings(StrictModel):
    kind: EngineKind = "torch"
    """Inference backend: `torch` (HF models on CPU or one GPU) or `vllm` (its async engine; runs
    each instance with the vLLM virtualenv, `make setup-vllm`). `synthetic` is for benchmarks only,
    never the default: tokens at the rate and lengths `synthetic` sets, drawn from no model (the
    trainer still scores and trains them, and weight pushes still travel), so a whole mesh can be
    timed with a rollout speed known exactly (`bench.scale` checks its simulator so)."""
    max_batch_size: int = Field(default=256, ge=1)
    """Sequences the instance decodes at once. 1 makes every response's tokens and logprobs
    independent of what else runs (bit-reproducible runs, as the η = 0 check uses), at a large
    cost in throughput."""
    saturation_batch_size: int = Field(default=0, ge=0)
    """Running sequences beyond which a decode step gains no throughput, only latency: the
    engine's knee (`python -m bench.async --knee-only` measures the torch engine's; at most
    max_batch_size). While the instance runs this many, the manager starts on it no sample of a
    later step than the oldest it runs: the stragglers the trainer waits for keep decoding at full
    speed, and work for later steps fills only what the knee leaves free. 0: not known, the
    instance takes work up to max_batch_size regardless of step."""
    stream_interval: int = Field(default=1, ge=1)
    """Torch engine: tokens per chunk streamed back (a response's last chunk may be shorter), as
    vLLM's stream_interval. One message per token costs the instance and the manager CPU that
    decoding and training need; a request whose instance dies regenerates elsewhere up to
    stream_interval - 1 tokens it had not sent yet. 1 for a service started on its own; 16 in a job
    (`rlmesh/job.py`, JOB_DEFAULTS). The synthetic engine has its own (`synthetic.stream_interval`)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Torch engine: where the weights, the KV cache and sampling live. `cuda`: one GPU (the current
    CUDA device; tensor_parallel_size 1); pushes land in pinned host memory and are copied to the
    GPU bucket by bucket into the standby copy, which is switched to between two decode steps.
    vLLM picks its device itself."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Processes the torch engine splits the model over (heads, MLP and vocabulary; gloo on CPU);
    rank 0 is the service process, the others are workers it starts."""
    update_mode: Literal["continue", "pause", "abort-continue"] = "continue"
    """What requests in flight do when a new weight version arrives: `continue` decoding while it
    loads and on it after the switch (their KV cache kept); `pause`: no decode step from the start
    of the push to its commit, then on with the KV cache kept (verl, slime); `abort-continue`: at
    the switch their KV cache is recomputed under the new version from their tokens so far
    (SkyRL). Every token records the version that produced it."""
    prefix_cache_mib: float = Field(default=256.0, ge=0)
    """Torch engine: memory for the KV caches of finished turns of multi-turn sessions (per
    tensor-parallel rank), kept so the session's next turn prefills only its new tokens; the least
    recently used go first, and all go at a weight switch. 0: none kept."""
    seed: int = 0
    """Seed of the engine's sampling."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads (per tensor-parallel rank); tiny models decode faster with one thread per process."""
    update_pause_limit_seconds: float = Field(default=30.0, gt=0)
    """In pause mode, the longest a push may hold generation: a push that neither commits nor fails
    by then (its sender died or gave up) lets generation resume on the served version; a late
    commit holds it again while it switches."""
    vllm: VllmConfig = VllmConfig()
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _device_and_split_fit_the_kind(self) -> EngineSettings:
        if self.saturation_batch_size > self.max_batch_size:
            raise ValueError(
                f"engine.saturation_batch_size ({self.saturation_batch_size}) must not exceed "
                f"engine.max_batch_size ({self.max_batch_size})"
            )
        if self.device == "cuda" and self.kind != "torch":
            raise ValueError(
                f"engine.device cuda applies to the torch engine, not {self.kind} (vLLM picks its device itself)"
            )
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            raise ValueError("engine.device cuda runs one rank per instance: tensor_parallel_size must be 1")
        if self.tensor_parallel_size > 1 and self.kind != "torch":
            raise ValueError(
                f"engine.tensor_parallel_size: only the torch engine runs tensor-parallel, not {self.kind}"
            )
        return self


class TransferSettings(StrictModel):
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """The Mooncake transfer engine's protocol, when its endpoint is offered."""
    tcp: bool = True
    """Offer a plain TCP receiver per tensor-parallel rank for weight pushes (framed buckets)."""
    background_priority: bool = True
    """Receive, check and copy weights on idle-class threads, which run only when generation
    leaves a CPU free: a push slows down under load instead of slowing generation."""
    catch_up_delay_seconds: float = Field(default=1.0, ge=0)
    """On a delta link, how long after serving a version each rank waits before copying it into
    its standby buffer (the next delta's base); the next version's push starts the copy at once."""


class RolloutSettings(StrictModel):
    """The engine's and the weight receiver's settings, and the instance's deadlines."""

    server: ServerSettings = ServerSettings()
    """The service's gRPC server limits and log level (its socket is the mesh's)."""
    engine: EngineSettings = EngineSettings()
    transfer: TransferSettings = TransferSettings()
    preemptible: bool = False
    """Runs on a spot / preemptible machine: the manager may offload work to it and expects it to vanish."""
    drain_timeout_seconds: float = Field(default=10.0, gt=0)
    """On SIGTERM or a preemption notice, how long to wait for running requests to be handed back."""
    register_timeout_seconds: float = Field(default=60.0, gt=0)
    """How long to keep trying to reach the manager at start."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    """Deadline of the instance's calls to the manager."""
