"""The local CA of `rlmesh certs`: certificates chain to it, name the right hosts and their role,
serve and call, keep their keys private, and a second run keeps what is valid; bad TLS settings
name the field; `rlmesh up` hands each service its files and its role's secret."""

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from rlmesh.cli.main import main
from rlmesh.config import ConfigError, TlsFiles, load_config
from rlmesh.job import Job, load_job
from rlmesh.launch.plan import LaunchPlan
from rlmesh.rpc.credentials import create_secrets, read_secret
from rlmesh.rpc.tls import NAMES, ROLE_OF_NAME, create_certificates, role_of_certificate
from services.manager.config import ManagerConfig


def certificate(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_every_certificate_chains_to_the_ca_names_its_hosts_and_serves_and_calls(tmp_path):
    files = create_certificates(tmp_path, ["10.0.0.7", "rollout-3.internal"])
    assert set(files) == set(NAMES) == {"manager", "weights", "rollout", "trainer", "client", "observer"}
    ca = certificate(tmp_path / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, tls in files.items():
        cert = certificate(tmp_path / f"{name}.pem")
        assert tls == TlsFiles(
            ca_file=str(tmp_path / "ca.pem"),
            cert_file=str(tmp_path / f"{name}.pem"),
            key_file=str(tmp_path / f"{name}-key.pem"),
        )
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("10.0.0.7"),
        ]
        assert names.get_values_for_type(x509.DNSName) == ["localhost", name, "rollout-3.internal"]
        assert role_of_certificate((tmp_path / f"{name}.pem").read_bytes()) == ROLE_OF_NAME[name]
    assert ROLE_OF_NAME["rollout"] == "instance" and ROLE_OF_NAME["client"] == "operator"
    assert role_of_certificate((tmp_path / "ca.pem").read_bytes()) is None


def test_keys_are_readable_by_their_owner_only(tmp_path):
    create_certificates(tmp_path)
    keys = sorted(tmp_path.glob("*-key.pem"))
    assert [k.name for k in keys] == sorted(["ca-key.pem", *(f"{n}-key.pem" for n in NAMES)])
    assert {stat.S_IMODE(k.stat().st_mode) for k in keys} == {0o600}
    assert not list(tmp_path.glob(".*partial"))


def test_a_second_run_keeps_what_is_valid_and_a_new_host_reissues_only_the_leaves(tmp_path):
    create_certificates(tmp_path)
    first = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    create_certificates(tmp_path)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == first
    create_certificates(tmp_path, ["gpu-node-1"])
    again = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert again["ca.pem"] == first["ca.pem"] and again["ca-key.pem"] == first["ca-key.pem"]
    assert again["manager.pem"] != first["manager.pem"]
    certificate(tmp_path / "manager.pem").verify_directly_issued_by(certificate(tmp_path / "ca.pem"))


def test_a_ca_mounted_without_its_key_is_used_but_cannot_issue(tmp_path):
    create_certificates(tmp_path)
    (tmp_path / "ca-key.pem").unlink()
    assert create_certificates(tmp_path)["manager"].cert_file == str(tmp_path / "manager.pem")
    with pytest.raises(ConfigError, match="does not cover .*elsewhere.*ca-key.pem"):
        create_certificates(tmp_path, ["elsewhere"])


def test_tls_settings_from_the_environment_are_checked_at_start(tmp_path):
    files = create_certificates(tmp_path)["manager"]
    environ = {
        "RLMESH_MANAGER_SERVER__TLS__CA_FILE": files.ca_file,
        "RLMESH_MANAGER_SERVER__TLS__CERT_FILE": files.cert_file,
        "RLMESH_MANAGER_SERVER__TLS__KEY_FILE": files.key_file,
    }
    assert load_config(ManagerConfig, env_prefix="RLMESH_MANAGER_", environ=environ).server.tls == files
    missing = {**environ, "RLMESH_MANAGER_SERVER__TLS__KEY_FILE": str(tmp_path / "nope.pem")}
    with pytest.raises(ConfigError, match=r"server\.tls\.key_file: .*nope\.pem is not a file"):
        load_config(ManagerConfig, env_prefix="RLMESH_MANAGER_", environ=missing)
    partial = {"RLMESH_MANAGER_SERVER__TLS__CERT_FILE": files.cert_file}
    with pytest.raises(ConfigError, match=r"server\.tls\.ca_file: Field required"):
        load_config(ManagerConfig, env_prefix="RLMESH_MANAGER_", environ=partial)


def test_certs_command_and_health_with_missing_certificates(tmp_path, capsys):
    assert main(["certs", "--dir", str(tmp_path / "tls"), "--host", "node-2"]) == 0
    out = capsys.readouterr().out
    assert f"grpcurl -cacert {tmp_path / 'tls' / 'ca.pem'}" in out
    assert "node-2" in str(
        certificate(tmp_path / "tls" / "trainer.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName)
    )
    assert main(["health", "127.0.0.1:9", "--tls-dir", str(tmp_path / "empty")]) == 2
    assert "client.pem is not a file" in capsys.readouterr().err


def test_up_hands_each_service_its_files_and_its_role_secret(tmp_path):
    create_certificates(tmp_path)
    secrets = create_secrets(tmp_path / "secrets")
    plan = LaunchPlan(Job(), output_dir=tmp_path, model_dir=tmp_path, tls_dir=tmp_path, secrets_dir=secrets)
    manager = plan.security_settings("manager")
    assert manager == {
        "RLMESH_MANAGER_SERVER__TLS__CA_FILE": str(tmp_path / "ca.pem"),
        "RLMESH_MANAGER_SERVER__TLS__CERT_FILE": str(tmp_path / "manager.pem"),
        "RLMESH_MANAGER_SERVER__TLS__KEY_FILE": str(tmp_path / "manager-key.pem"),
        "RLMESH_MANAGER_SERVER__AUTH__VERIFIERS_FILE": str(secrets / "verifiers.json"),
        "RLMESH_MANAGER_SERVER__AUTH__SECRET_FILE": str(secrets / "manager.secret"),
    }
    assert load_config(ManagerConfig, env_prefix="RLMESH_MANAGER_", environ=manager).server.auth.secret_file == str(
        secrets / "manager.secret"
    )
    assert plan.security_settings("rollout")["RLMESH_ROLLOUT_SERVER__AUTH__SECRET_FILE"] == str(
        secrets / "instance.secret"
    )
    assert plan.security_settings("trainer")["RLMESH_TRAINER_SERVER__TLS__KEY_FILE"] == str(
        tmp_path / "trainer-key.pem"
    )
    assert read_secret(plan.secret_file("operator")).startswith("rlmesh-operator-")
    plain = LaunchPlan(Job(), output_dir=tmp_path, model_dir=tmp_path)
    assert plain.security_settings("manager") == {"RLMESH_MANAGER_SERVER__AUTH__INSECURE": "true"}
    assert plain.tls_files("client") is None and plain.secret_file("operator") is None


def test_a_job_naming_a_tls_folder_must_turn_tls_on():
    with pytest.raises(ConfigError, match="tls_dir needs tls = true"):
        load_job(None, {"mesh.tls_dir": "certs"})
    assert load_job(None, {"mesh.tls": True, "mesh.tls_dir": "certs"})[0].mesh.tls
    with pytest.raises(ConfigError, match="registration_token was replaced by a bearer secret per role"):
        load_job(None, {"mesh.registration_token": "auto"})
    with pytest.raises(ConfigError, match="secrets_dir and insecure = true contradict"):
        load_job(None, {"mesh.insecure": True, "mesh.secrets_dir": "secrets"})
