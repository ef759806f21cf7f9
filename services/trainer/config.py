"""Configuration of the trainer: the settings a job sets (`rlmesh/settings/trainer.py`) and the
wiring `rlmesh up` fills in (addresses, folders, tasks, the model's dtype)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlmesh.config import ServerConfig
from rlmesh.settings.tracking import TrackingSettings
from rlmesh.settings.trainer import AlgorithmConfig, LossConfig, TrainerSettings
from rlmesh.tasks.config import TaskConfig

__all__ = ["LossConfig", "TrainerConfig"]


class TrainerConfig(AlgorithmConfig, TrainerSettings):
    server: ServerConfig = ServerConfig(port=50153)
    manager_address: str = "127.0.0.1:50151"
    weights_address: str = "127.0.0.1:50152"
    gateway_address: str = ""
    """The manager's OpenAI gateway (host:port): agent commands of multi-turn tasks are pointed at it."""
    model_dir: str
    """Local HF-format folder with the initial policy (version 0)."""
    output_dir: str = "runs/latest"
    """Metrics (JSONL, TensorBoard), the reward plot, the rollout ledger and checkpoints."""
    tasks: list[TaskConfig] = Field(
        default_factory=lambda: [TaskConfig(name="increment", kind="increment")], min_length=1
    )
    """What the policy is trained on: prompts, rendering, reward and sampling per task; several
    tasks are mixed by weight within every step."""
    python_path: list[str] = Field(default_factory=list)
    """Folders put first on the import path before user code (reward functions) is loaded: the
    job file's folder."""
    weights_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The dtype each weight version is handed to the weights service in (the master shards are
    cast to it): `auto` is the model folder's (its config's dtype, float32 when unstated), the
    dtype the rollout engines serve it in."""
    tracking: TrackingSettings = TrackingSettings()
    """The experiment trackers rank 0 reports the run to: the job's `[tracking]`."""
