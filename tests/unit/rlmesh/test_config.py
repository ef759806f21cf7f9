"""Typed configs: TOML, environment overrides, and errors that name the bad field."""

import pytest

from rlmesh.config import ConfigError, load_config
from services.manager.config import ManagerConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig


def test_toml_then_environment_override(tmp_path):
    path = tmp_path / "manager.toml"
    path.write_text("max_staleness = 2\n[server]\nport = 6000\n")
    config = load_config(
        ManagerConfig, path, env_prefix="RLMESH_MANAGER_", environ={"RLMESH_MANAGER_SERVER__PORT": "7000"}
    )
    assert config.max_staleness == 2
    assert config.server.port == 7000


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(ManagerConfig, env_prefix="X_", environ={"X_SERVER__PORT": "99999"})


def test_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "manager.toml"
    path.write_text("max_stalenes = 2\n")
    with pytest.raises(ConfigError, match="max_stalenes"):
        load_config(ManagerConfig, path)


def test_missing_required_field_is_named():
    with pytest.raises(ConfigError, match=r"engine"):
        load_config(RolloutConfig, environ={})


def test_cross_field_rule_is_explained():
    with pytest.raises(ConfigError, match="micro_batch_groups"):
        load_config(TrainerConfig, overrides={"model_dir": "m", "prompts_per_step": 16, "micro_batch_groups": 3})
    with pytest.raises(ConfigError, match="half of lease_seconds"):
        load_config(ManagerConfig, overrides={"lease_seconds": 2, "heartbeat_interval_seconds": 1.5})
    with pytest.raises(ConfigError, match=r"saturation_batch_size \(9\) must not exceed engine.max_batch_size \(8\)"):
        load_config(
            RolloutConfig, overrides={"engine": {"kind": "synthetic", "max_batch_size": 8, "saturation_batch_size": 9}}
        )


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(ManagerConfig, tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(ManagerConfig, bad)
