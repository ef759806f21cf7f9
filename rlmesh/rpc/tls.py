"""A local certificate authority for mutual TLS: `rlmesh certs` and `rlmesh up --tls` write a CA and
one certificate per service and tool (each good as server and as client, and naming its role),
reusing what is still valid."""

from __future__ import annotations

import datetime
import functools
import ipaddress
from pathlib import Path

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rlmesh.atomic_file import write_atomically
from rlmesh.config import ConfigError, TlsFiles
from rlmesh.rpc.authz import ROLES, Role

log = structlog.get_logger()

ROLE_OF_NAME: dict[str, Role] = {
    "manager": "manager",
    "weights": "weights",
    "rollout": "instance",
    "trainer": "trainer",
    "client": "operator",
    "observer": "observer",
}
"""A certificate for each service, `client` for the launcher and operator tools (`rlmesh status`,
grpcurl) and `observer` for read-only ones, with the role each carries."""
NAMES = tuple(ROLE_OF_NAME)
ROLE_URI_PREFIX = "urn:rlmesh:role:"
"""A certificate's role is the subject alternative name URI ROLE_URI_PREFIX + role."""
LOCAL_HOSTS = ("127.0.0.1", "localhost")
CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_BEFORE = datetime.timedelta(days=7)
"""A certificate that expires sooner than this is issued again."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _load(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """A certificate and its key, or None when either is missing, unreadable or they do not match."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        return None
    return cert, key


def _fresh(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc - RENEW_BEFORE > now


def _ca(directory: Path, now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    found = _load(directory / "ca.pem", directory / "ca-key.pem")
    if found is not None and _fresh(found[0], now):
        return found
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlmesh"),
            x509.NameAttribute(NameOID.COMMON_NAME, "rlmesh local CA"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_atomically(directory / "ca-key.pem", _key_pem(key), 0o600)
    write_atomically(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    log.info("created a certificate authority", path=str(directory / "ca.pem"))
    return cert, key


def _covers(cert: x509.Certificate, ca: x509.Certificate, hosts: list[str], role: Role, now: datetime.datetime) -> bool:
    """Whether an existing certificate is signed by `ca`, fresh, and names every host and its role."""
    if cert.issuer != ca.subject or not _fresh(cert, now):
        return False
    try:
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return (
        all(_san(host) in names for host in hosts) and x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role) in names
    )


def _leaf(
    name: str,
    hosts: list[str],
    role: Role,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlmesh"), x509.NameAttribute(NameOID.COMMON_NAME, name)]
            )
        )
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        # Every service both serves and calls the others, so one certificate does both.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [*(_san(host) for host in hosts), x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role)]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def create_certificates(directory: str | Path, hosts: list[str] | tuple[str, ...] = ()) -> dict[str, TlsFiles]:
    """Writes (or keeps, when still valid) in `directory`: ca.pem and ca-key.pem, and NAME.pem with
    NAME-key.pem for each of NAMES, naming 127.0.0.1, localhost, NAME (its compose host) and
    `hosts`. Keys are mode 0600. Returns each name's files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    if (directory / "ca.pem").is_file() and not (directory / "ca-key.pem").exists():
        # A CA from elsewhere, mounted without its key: the certificates beside it are used as they are.
        ca_cert, ca_key = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes()), None
    else:
        ca_cert, ca_key = _ca(directory, now)
    files = {}
    for name in NAMES:
        wanted = list(dict.fromkeys([*LOCAL_HOSTS, name, *hosts]))
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        found = _load(cert_path, key_path)
        if found is None or not _covers(found[0], ca_cert, wanted, ROLE_OF_NAME[name], now):
            if ca_key is None:
                raise ConfigError(
                    f"{cert_path} is missing or does not cover {', '.join(wanted)}, and {directory / 'ca-key.pem'} "
                    "is not there to issue it"
                )
            cert, key = _leaf(name, wanted, ROLE_OF_NAME[name], ca_cert, ca_key, now)
            write_atomically(key_path, _key_pem(key), 0o600)
            write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            log.info("issued a certificate", name=name, path=str(cert_path), hosts=wanted)
        files[name] = TlsFiles.in_directory(directory, name)
    return files


@functools.lru_cache(maxsize=256)
def role_of_certificate(pem: bytes) -> Role | None:
    """The role a peer's certificate names (None: none, or not one of ROLES); the chain was
    verified by the TLS handshake before this is asked."""
    try:
        names = (
            x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        )
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in names.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(ROLE_URI_PREFIX) and uri[len(ROLE_URI_PREFIX) :] in ROLES:
            return uri[len(ROLE_URI_PREFIX) :]  # type: ignore[return-value]
    return None
