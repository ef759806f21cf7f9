"""Role secrets: `rlmesh secrets` writes one per role, private, and digests only in the verifiers;
a rotated secret replaces the old one at the servers without a restart; a verifiers file broken
mid-rotation keeps the last good table; bad files are named."""

import json
import stat

import pytest

from rlmesh.cli.main import main
from rlmesh.config import ConfigError
from rlmesh.rpc import credentials
from rlmesh.rpc.authz import ROLES
from rlmesh.rpc.credentials import VERIFIERS_FILE, Verifiers, create_secrets, read_secret, rotate_secret, secret_path


def test_each_role_gets_its_own_private_secret_and_the_verifiers_hold_digests_only(tmp_path):
    folder = create_secrets(tmp_path / "secrets")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    secrets = {role: read_secret(secret_path(folder, role)) for role in ROLES}
    assert len(set(secrets.values())) == len(ROLES)
    assert {stat.S_IMODE(secret_path(folder, role).stat().st_mode) for role in ROLES} == {0o600}
    text = (folder / VERIFIERS_FILE).read_text()
    assert not any(secret in text for secret in secrets.values())
    verifiers = Verifiers(folder / VERIFIERS_FILE)
    assert {role: verifiers.role_of(secret) for role, secret in secrets.items()} == {role: role for role in ROLES}
    assert verifiers.role_of("rlmesh-trainer-guessed") is None
    create_secrets(folder)
    assert {role: read_secret(secret_path(folder, role)) for role in ROLES} == secrets


def test_a_rotated_secret_replaces_the_old_one_without_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(credentials, "RELOAD_SECONDS", 0.0)
    folder = create_secrets(tmp_path)
    verifiers = Verifiers(folder / VERIFIERS_FILE)
    old = read_secret(secret_path(folder, "trainer"))
    assert verifiers.role_of(old) == "trainer"
    rotate_secret(folder, "trainer")
    new = read_secret(secret_path(folder, "trainer"))
    assert new != old and verifiers.role_of(new) == "trainer" and verifiers.role_of(old) is None
    assert verifiers.role_of(read_secret(secret_path(folder, "operator"))) == "operator"
    (folder / VERIFIERS_FILE).write_text("{not json")
    assert verifiers.role_of(new) == "trainer"


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="holds no verifiers.json"):
        rotate_secret(tmp_path, "trainer")
    (tmp_path / "empty.secret").write_text("\n")
    with pytest.raises(ConfigError, match="empty.secret is empty"):
        read_secret(tmp_path / "empty.secret")
    (tmp_path / VERIFIERS_FILE).write_text(json.dumps({"root": "0" * 64}))
    with pytest.raises(ConfigError, match="unknown role 'root'"):
        Verifiers(tmp_path / VERIFIERS_FILE)
    with pytest.raises(ConfigError, match="cannot read the verifiers file"):
        Verifiers(tmp_path / "missing.json")


def test_the_secrets_command_makes_and_rotates(tmp_path, capsys):
    assert main(["secrets", "--dir", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"operator: {tmp_path / 's' / 'operator.secret'}" in out and "authorization: Bearer" in out
    before = read_secret(tmp_path / "s" / "weights.secret")
    assert main(["secrets", "--dir", str(tmp_path / "s"), "--rotate", "weights"]) == 0
    assert read_secret(tmp_path / "s" / "weights.secret") != before
    assert main(["secrets", "--dir", str(tmp_path / "none"), "--rotate", "weights"]) == 2
