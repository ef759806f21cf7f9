"""The experiment trackers a job reports to (`[tracking]`): Weights & Biases and MLflow. The
trainer's rank 0 sends each the job, every metric it files, the held-out samples and the reward
curve; `services/trainer/tracking/` holds the adapters."""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Literal

from pydantic import Field

from rlmesh.config import StrictModel

INSTALL_HINT = "install rlmesh's `tracking` extra: `pip install '.[tracking]'` in the checkout (`make setup` has it)"


class WandbSettings(StrictModel):
    """Weights & Biases. The API key comes from where wandb reads it (`WANDB_API_KEY`, or the
    netrc `wandb login` writes), never from the job file."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """`offline`: the run is written under <output>/wandb and needs no network (`wandb sync
    <output>/wandb/offline-run-*` uploads it later); `online`: sent to the W&B server as it goes
    (the server is `WANDB_BASE_URL`'s, wandb.ai unless set); `disabled`: no W&B run."""
    project: str = "rlmesh"
    """The W&B project the run is filed under."""
    entity: str | None = None
    """The W&B user or team that owns the project; None: the API key's default entity."""
    run_name: str | None = None
    """The run's display name; None: the output folder's name."""
    tags: list[str] = Field(default_factory=list)
    """Tags put on the run."""

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


class MlflowSettings(StrictModel):
    """MLflow (the `mlflow-skinny` package). Credentials of a tracking server come from MLflow's
    own variables (`MLFLOW_TRACKING_TOKEN`, `MLFLOW_TRACKING_USERNAME` and `_PASSWORD`)."""

    enabled: bool = False
    """Report the run to MLflow."""
    tracking_uri: str | None = None
    """Where runs are recorded: a tracking server (`http://host:5000`), a database
    (`sqlite:///path/mlflow.db`) or `databricks`. None: `MLFLOW_TRACKING_URI` when set, else a
    local SQLite store, `sqlite:///<output>/mlflow/mlflow.db`, its artifacts in
    <output>/mlflow/artifacts (`mlflow ui --backend-store-uri` shows it; no server needed)."""
    experiment: str = "rlmesh"
    """The MLflow experiment the run is filed under (created when missing)."""
    run_name: str | None = None
    """The run's name; None: the output folder's name."""


class TrackingSettings(StrictModel):
    """The experiment trackers the trainer's rank 0 reports the run to (see docs/tracking.md)."""

    wandb: WandbSettings = WandbSettings()
    mlflow: MlflowSettings = MlflowSettings()

    def missing_package(self) -> str:
        """Why a tracker the job enables cannot start here: the package it needs is not installed
        ("" when every enabled one can)."""
        if self.wandb.enabled and find_spec("wandb") is None:
            return f"tracking.wandb.mode = {self.wandb.mode} needs the `wandb` package: {INSTALL_HINT}"
        if self.mlflow.enabled:
            if find_spec("mlflow") is None:
                return f"tracking.mlflow.enabled needs the `mlflow-skinny` package: {INSTALL_HINT}"
            uri = self.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            if (uri is None or uri.startswith("sqlite:")) and not (find_spec("sqlalchemy") and find_spec("alembic")):
                return (
                    f"tracking.mlflow: MLflow's SQLite store needs the `sqlalchemy` and `alembic` packages: "
                    f"{INSTALL_HINT}"
                )
        return ""
