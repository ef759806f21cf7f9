"""The suite's credentials: a bearer secret per role (made once per run), the auth settings and
loopback server configs that check them, and a certificate of the mesh's CA that names no role."""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import shutil
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlmesh.config import AuthSettings, ServerConfig, TlsFiles
from rlmesh.rpc.authz import Role
from rlmesh.rpc.channels import use_secret
from rlmesh.rpc.credentials import (
    VERIFIERS_FILE,
    create_secrets,
    peer_secrets,
    read_secret,
    secret_path,
    service_auth_settings,
)

SECRETS_VARIABLE = "RLMESH_TEST_SECRETS"
if SECRETS_VARIABLE not in os.environ:
    # Made once, by the first process of the suite: the processes it starts inherit the variable.
    os.environ[SECRETS_VARIABLE] = str(create_secrets(Path(tempfile.mkdtemp(prefix="rlmesh-test-secrets-"))))
    atexit.register(shutil.rmtree, os.environ[SECRETS_VARIABLE], True)
TEST_SECRETS = Path(os.environ[SECRETS_VARIABLE])
"""A bearer secret per role for the suite: its servers check them, and its calls present the
secret of a role the method allows (`play_every_role`), so the suite runs with authorization on."""


def role_secret(role: Role) -> str:
    return read_secret(secret_path(TEST_SECRETS, role))


def play_every_role() -> None:
    """Every call this process makes presents the secret of the first role allowed to make it: a
    test drives each service as the peer it talks to would."""
    use_secret(peer_secrets(TEST_SECRETS))


def suite_auth(role: Role | None = None) -> AuthSettings:
    """The suite's verifiers and, with `role`, that role's secret for what the service starts (the
    manager's gateway process calls the manager with the manager's)."""
    return AuthSettings(
        verifiers_file=str(TEST_SECRETS / VERIFIERS_FILE),
        secret_file=str(secret_path(TEST_SECRETS, role)) if role else "",
    )


def suite_auth_env(prefix: str, role: Role) -> dict[str, str]:
    """The environment settings that give a service process started by a test its role's secret
    and the suite's verifiers."""
    return service_auth_settings(prefix, TEST_SECRETS, role)


def loopback(tls: TlsFiles | None = None, role: Role | None = None) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5, auth=suite_auth(role), tls=tls)


def roleless_certificate(tls_dir: Path) -> TlsFiles:
    """A certificate of the mesh's CA that names no role: it passes the handshake, and then the
    caller's role must come from its bearer secret."""
    ca = x509.load_pem_x509_certificate((tls_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((tls_dir / "ca-key.pem").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "no-role")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (tls_dir / "no-role.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tls_dir / "no-role-key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return TlsFiles.in_directory(tls_dir, "no-role")
