"""A training job: one typed file (`job.toml`) naming the model, the tasks, the algorithm, the
mesh's shape and the outputs. `rlmesh up --job job.toml` runs it; flags override its fields."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rlmesh.config import METRICS_PORT_OFFSET, ConfigError, StrictModel
from rlmesh.settings.manager import ManagerSettings, RelaySettings, StalenessSetting
from rlmesh.settings.rollout import RolloutSettings
from rlmesh.settings.tracking import TrackingSettings
from rlmesh.settings.trainer import AlgorithmConfig, TrainerSettings
from rlmesh.settings.weights import WeightsSettings
from rlmesh.tasks.config import TaskConfig

DEFAULT_MODELS = {
    "tiny-increment": Path(".rlmesh/models/tiny-qwen2-increment"),
    # v2: the 1,200-iteration warm-up; a folder the 60-iteration one made is not taken for it.
    "tiny-chat": Path(".rlmesh/models/tiny-qwen2-chat-v2"),
    "tiny-feedback": Path(".rlmesh/models/tiny-qwen2-feedback"),
}
"""Built-in models, created on first use (random init and a short supervised warm-up)."""
NETNS_MAX_INSTANCES = 62
"""Rollout instances a mesh can put in network namespaces: a /30 each in one /24, whose last
addresses hold the manager's."""
MOVED_MESH_KEYS = {
    "rollout_tp": "rollout.engine.tensor_parallel_size",
    "rollout_device": "rollout.engine.device",
    "rollout_max_batch_size": "rollout.engine.max_batch_size",
    "rollout_stream_interval": "rollout.engine.stream_interval",
    "engine": "rollout.engine.kind",
    "update_mode": "rollout.engine.update_mode",
    "transfer_backend": "weights.backend",
    "compression": "weights.compression",
    "trainer_precision": "trainer.precision",
    "trainer_device": "trainer.distributed_backend (cpu: gloo, cuda: nccl)",
}
"""Mesh keys of earlier job files that are now their service's settings: a job naming one is
refused with the key to write instead."""
JOB_DEFAULTS = {"rollout.engine.stream_interval": 16}
"""Where a job's default differs from a service's standalone one, by dotted key: applied unless
the job sets the key. Streaming a chunk per 16 tokens leaves `rlmesh up`'s shared CPUs to
decoding and training (see the field's docstring)."""


class ModelSection(StrictModel):
    path: str | None = None
    """A local HF-format model folder (config.json, safetensors, tokenizer) of a supported family.
    Relative to the job file. None takes the built-in model `builtin`."""
    builtin: Literal["tiny-increment", "tiny-chat", "tiny-feedback"] = "tiny-increment"
    """`tiny-increment`: a tiny Qwen2 with a digit tokenizer (the default task); `tiny-chat`: a tiny
    Qwen2 with a printable-ASCII tokenizer and a chat template (the word-problem task);
    `tiny-feedback`: `tiny-increment` with a longer warm-up that also shows the `feedback`
    environment's format (its marks, then the hidden code)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The dtype weight versions travel and are served in: the trainer publishes its (fp32 master)
    weights cast to it (its `weights_dtype`) and the torch engine holds its weights and KV cache in
    it (its `engine.dtype`), so the two always agree. `auto`: the model folder's (`dtype` in
    config.json; bf16 for Qwen2.5, fp32 for the built-in models)."""


class AlgorithmSection(StalenessSetting, AlgorithmConfig):
    """The trainer's algorithm (`rlmesh/settings/trainer.py`, AlgorithmConfig) and η, the manager's
    bound on how far rollout may run ahead of it: every field of either is a field here."""


class MeshSection(StrictModel):
    trainer_ranks: int = Field(default=1, ge=1)
    """FSDP ranks of the trainer on this machine (more than one runs it under torchrun)."""
    rollout_instances: int = Field(default=1, ge=1)
    """Rollout instances at start, and the fewest `rlmesh scale` or the autoscaler may leave."""
    max_rollout_instances: int | None = Field(default=None, ge=1)
    """The most rollout instances `rlmesh scale` or the autoscaler may run (None: rollout_instances)."""
    autoscale: bool = False
    """Follow the manager's recommended number of rollout instances (the rollout work a training
    step needs), one instance at a time, with hysteresis, between the two bounds."""
    autoscale_patience_seconds: float = Field(default=30.0, ge=0)
    """How long the recommendation must point the same way before an instance is added or drained."""
    autoscale_cooldown_seconds: float = Field(default=60.0, ge=0)
    """The least time between two changes, so a new instance has time to show in the measurements."""
    relay_shards: int = Field(default=0, ge=0, le=6)
    """Relay shards beside the manager (each a process, `python -m services.manager.relay`): the
    rollout instances' tokens for training go through them to the trainer, and the manager keeps
    only their counts, so the mesh's token ceiling grows with the shards (docs/scale.md). 0: the
    manager relays every token itself."""
    rollout_netns: int = Field(default=0, ge=0)
    """The first N rollout instances each run in their own network namespace, linked to the host
    by a veth pair (10.x addresses; the manager then listens on an address they reach). Lets the
    chaos suite cut an instance's network. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)."""
    fork_server: bool = True
    """Start and restart the services forked from one process that has imported torch,
    transformers and gRPC once (each service would spend 1 to 6 CPU-seconds importing them).
    Services run by another interpreter (vLLM) or by torchrun are started by exec either way; a
    rollout instance in a network namespace enters it once forked."""
    host: str = "127.0.0.1"
    """The address every service listens on and is reached at."""
    base_port: int = Field(default=50151, ge=1024, le=65000)
    """The manager's port; weights +1, trainer +2, rollout instances +10..."""
    tls: bool = False
    """Mutual TLS on every service and every call between them (grpc SSL credentials): only holders
    of a certificate from the mesh's CA get past the handshake. `rlmesh up` creates a local CA
    and a certificate per service in <output>/tls, or uses tls_dir."""
    tls_dir: str | None = None
    """The certificates to use (ca.pem, NAME.pem and NAME-key.pem for manager, weights, rollout,
    trainer, client and observer, as `rlmesh certs` writes them; what is missing or expired is issued from
    ca-key.pem). Relative to the working directory, like output.dir. Needs tls = true."""
    insecure: bool = False
    """Turn authorization off: every service answers every RPC to anyone who reaches its port, with
    no credential. For a mesh on one trusted machine only; the console and GetStatus say so."""
    secrets_dir: str | None = None
    """The bearer secret of each role and their verifiers, as `rlmesh secrets` writes them (what is
    missing is made); None: made for each run in <output>/secrets (mode 0600). Relative to the
    working directory, like output.dir."""

    @property
    def instance_cap(self) -> int:
        """The most rollout instances `rlmesh scale` or the autoscaler may run."""
        return self.max_rollout_instances or self.rollout_instances

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and (
            moved := [f"mesh.{key} moved to {new}" for key, new in MOVED_MESH_KEYS.items() if key in data]
        ):
            raise ValueError("; ".join(moved))
        if isinstance(data, dict) and "registration_token" in data:
            raise ValueError(
                "mesh.registration_token was replaced by a bearer secret per role, on by default "
                "(mesh.secrets_dir; see docs/security.md)"
            )
        return data

    @model_validator(mode="after")
    def _compatible(self) -> MeshSection:
        if self.tls_dir is not None and not self.tls:
            raise ValueError("tls_dir needs tls = true")
        if self.secrets_dir is not None and self.insecure:
            raise ValueError("secrets_dir and insecure = true contradict each other: insecure checks no secret")
        cap = self.instance_cap
        if cap < self.rollout_instances:
            raise ValueError(f"max_rollout_instances ({cap}) is below rollout_instances ({self.rollout_instances})")
        if self.autoscale and cap == self.rollout_instances:
            raise ValueError(
                "autoscale needs room: set max_rollout_instances above rollout_instances (--rollout-instances MIN:MAX)"
            )
        if self.rollout_netns > self.rollout_instances:
            raise ValueError(
                f"rollout_netns ({self.rollout_netns}) is more than the rollout instances at start "
                f"({self.rollout_instances})"
            )
        if self.rollout_netns > NETNS_MAX_INSTANCES:
            raise ValueError(f"rollout_netns: at most {NETNS_MAX_INSTANCES} instances run in network namespaces")
        if self.base_port + METRICS_PORT_OFFSET + 10 + cap > 65535:
            raise ValueError(
                f"base_port leaves no room for every rollout instance's port and its metrics port "
                f"(+{METRICS_PORT_OFFSET}): at most {65535 - METRICS_PORT_OFFSET - 10 - cap}"
            )
        return self


class OutputSection(StrictModel):
    dir: str | None = None
    """Metrics, plot, checkpoints and logs; None: runs/<time>. A folder holding a checkpoint resumes."""


class Job(StrictModel):
    model: ModelSection = ModelSection()
    tasks: list[TaskConfig] = Field(
        default_factory=lambda: [TaskConfig(name="increment", kind="increment")], min_length=1
    )
    """One [[tasks]] table per task; several are mixed by weight within every step."""
    algorithm: AlgorithmSection = AlgorithmSection()
    """What the trainer learns and in what steps: the loss, the step's shape, η."""
    trainer: TrainerSettings = TrainerSettings()
    """How the trainer process runs (`rlmesh/settings/trainer.py`)."""
    manager: ManagerSettings = ManagerSettings()
    """Leases, dispatch and the journal (`rlmesh/settings/manager.py`)."""
    relay: RelaySettings = RelaySettings()
    """The relay shards' streams and reports, when `mesh.relay_shards` runs some (`rlmesh/settings/manager.py`)."""
    rollout: RolloutSettings = RolloutSettings()
    """Every rollout instance's engine, weight receiver and deadlines (`rlmesh/settings/rollout.py`)."""
    weights: WeightsSettings = WeightsSettings()
    """How weight versions are pushed (`rlmesh/settings/weights.py`)."""
    mesh: MeshSection = MeshSection()
    """The mesh's shape: how many processes of each service, where they listen, and security."""
    output: OutputSection = OutputSection()
    tracking: TrackingSettings = TrackingSettings()
    """Experiment trackers the run is reported to: Weights & Biases, MLflow (`rlmesh/settings/tracking.py`)."""

    @model_validator(mode="before")
    @classmethod
    def _job_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for dotted, value in JOB_DEFAULTS.items():
                data = _default_at(data, dotted.split("."), value)
        return data

    def missing_file(self) -> str:
        """The first data file a task names that is not there ("" when all are)."""
        return next((missing for task in self.tasks if (missing := task.missing_file())), "")

    def missing_gpu(self) -> str:
        """Why this host cannot run the devices the job asks for ("" when it can)."""
        wants_gpu = [
            setting
            for setting, wanted in (
                ("rollout.engine.device = cuda", self.rollout.engine.device == "cuda"),
                ("trainer.distributed_backend = nccl", self.trainer.distributed_backend == "nccl"),
            )
            if wanted
        ]
        if not wants_gpu:
            return ""
        import torch

        if torch.cuda.is_available():
            return ""
        return f"{wants_gpu[0]}, but torch {torch.__version__} sees no CUDA device on this host"

    @model_validator(mode="after")
    def _consistent(self) -> Job:
        names = [t.name for t in self.tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"task names must be unique; repeated: {duplicates}")
        lossy = sorted({self.weights.compression, *self.weights.link_compression.values()} & {"int8", "fp8"})
        if lossy:
            raise ValueError(
                f"weights compression {lossy[0]} is lossy: only engines serving quantized weights take it, "
                f"and the torch and vllm engines serve the weights as pushed (use none, zstd or delta)"
            )
        buffer = self.algorithm.overlong_buffer_tokens
        short = [f"{t.name} ({t.max_tokens})" for t in self.tasks if t.max_tokens < buffer]
        if short:
            raise ValueError(
                f"algorithm.overlong_buffer_tokens ({buffer}) exceeds the max_tokens of task {', '.join(short)}"
            )
        return self


def _default_at(section: dict[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
    """`section` with `value` at the path `keys` unless it holds one there (a copy; a nested section
    given as a model, not a table, is its author's whole choice and is kept)."""
    head, *rest = keys
    if not rest:
        return section if head in section else {**section, head: value}
    nested = section.get(head, {})
    if not isinstance(nested, dict):
        return section
    return {**section, head: _default_at(nested, rest, value)}


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node: Any = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        if isinstance(node, list):
            node = node[int(key)]
        else:
            node = node.setdefault(key, {})
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def parse_value(text: str) -> Any:
    """A `--set` value as TOML reads it (numbers, booleans, quoted strings), else the raw text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_job(path: str | Path | None, overrides: dict[str, Any] | None = None) -> tuple[Job, Path]:
    """The job of a file (None: the built-in default job) with dotted-key overrides applied; paths
    in it resolved against the file's folder, which is returned too. Raises ConfigError naming
    the field."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"job file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"job file {path} is not valid TOML: {exc}") from exc
        base = path.resolve().parent
    if "tasks" not in data and any(key.startswith("tasks.") for key in overrides or {}):
        # `--set tasks.0....` on the default job addresses its default task.
        data["tasks"] = [task.model_dump(exclude_defaults=True) for task in Job().tasks]
    for dotted, value in (overrides or {}).items():
        try:
            _set_dotted(data, dotted, value)
        except (IndexError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot set {dotted}: {exc}") from exc
    try:
        job = Job.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        where = f"job {path}" if path else "job"
        raise ConfigError(f"invalid {where}: {problems}") from exc
    tasks = [task.resolve_paths(base) for task in job.tasks]
    model_path = job.model.path
    if model_path is not None and not Path(model_path).is_absolute():
        model_path = str((base / model_path).resolve())
    job = job.model_copy(update={"tasks": tasks, "model": job.model.model_copy(update={"path": model_path})})
    return job, base
