"""What each service's config takes from a job: its own settings models as the job holds them,
whole (no field copied by name), and the wiring the job's model, mesh and output sections decide."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlmesh.entrypoint import config_file_variable
from rlmesh.settings.manager import StalenessSetting
from rlmesh.settings.trainer import AlgorithmConfig


def trainer_settings(job, base: Path, model_dir: Path, output_dir: Path) -> dict:
    """The trainer's config: the job's algorithm, trainer and tracking sections as they are, and the
    wiring: folders, tasks, and the dtype the model section picks."""
    return {
        **job.algorithm.model_dump(mode="json", include=set(AlgorithmConfig.model_fields)),
        **job.trainer.model_dump(mode="json"),
        "model_dir": str(model_dir),
        "output_dir": str(output_dir),
        "weights_dtype": job.model.dtype,
        "tasks": [task.model_dump(mode="json") for task in job.tasks],
        "python_path": [str(base)],
        "tracking": job.tracking.model_dump(mode="json"),
    }


def service_settings(job) -> dict[str, dict]:
    """What the manager, its relay shards, the weights service and every rollout instance take from
    the job: its sections of the same names as they are, and η for the manager. The launcher's environment
    settings (sockets, addresses, folders, the model's dtype) come on top."""
    return {
        "manager": {
            **job.manager.model_dump(mode="json"),
            **job.algorithm.model_dump(mode="json", include=set(StalenessSetting.model_fields)),
        },
        "relay": job.relay.model_dump(mode="json"),
        "weights": job.weights.model_dump(mode="json"),
        "rollout": job.rollout.model_dump(mode="json"),
    }


def hand_settings_to_services(job, output_dir: Path) -> dict[str, str]:
    """Writes each service's settings file in the run's folder and names it in this process's
    environment, which every service the launcher starts inherits; returns the variables set."""
    named = {}
    for service, settings in service_settings(job).items():
        path = output_dir / f"{service}.json"
        path.write_text(json.dumps(settings, indent=2))
        named[config_file_variable(service)] = str(path)
    os.environ.update(named)
    return named
