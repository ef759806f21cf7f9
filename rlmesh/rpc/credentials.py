"""Bearer secrets, one per role: `rlmesh secrets` and `rlmesh up` write them (mode 0600) with the
verifiers file servers check them against, which holds only their SHA-256 digests; and the tokens
tasks configure for the user's services, which never get a role's."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from rlmesh.atomic_file import write_atomically
from rlmesh.config import ConfigError
from rlmesh.rpc.authz import ROLES, Role, allowed_roles

log = structlog.get_logger()

VERIFIERS_FILE = "verifiers.json"
RELOAD_SECONDS = 1.0
"""A server looks at its verifiers file's modification time at most this often, so a rotated
secret is honoured without a restart."""


def secret_path(directory: str | Path, role: Role) -> Path:
    return Path(directory) / f"{role}.secret"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _new_secret(role: Role) -> bytes:
    # 32 random bytes; the role in the text only helps a person tell the files apart.
    return f"rlmesh-{role}-{secrets.token_urlsafe(32)}\n".encode()


def _write_verifiers(directory: Path) -> None:
    verifiers = {role: digest(read_secret(secret_path(directory, role))) for role in ROLES}
    write_atomically(directory / VERIFIERS_FILE, (json.dumps(verifiers, indent=2) + "\n").encode(), 0o644)


def create_secrets(directory: str | Path) -> Path:
    """Writes in `directory` (mode 0700) a secret per role that is not there yet, ROLE.secret with
    mode 0600, and verifiers.json with their digests. Returns the folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for role in ROLES:
        path = secret_path(directory, role)
        if not path.is_file():
            write_atomically(path, _new_secret(role), 0o600)
    _write_verifiers(directory)
    return directory


def rotate_secret(directory: str | Path, role: Role) -> Path:
    """Replaces `role`'s secret and its digest: servers refuse the old one within RELOAD_SECONDS,
    and the processes of that role need the new one (restart them)."""
    directory = Path(directory)
    if not (directory / VERIFIERS_FILE).is_file():
        raise ConfigError(f"{directory} holds no {VERIFIERS_FILE}: make the secrets first (rlmesh secrets {directory})")
    path = secret_path(directory, role)
    write_atomically(path, _new_secret(role), 0o600)
    _write_verifiers(directory)
    return path


def read_secret(path: str | Path) -> str:
    """A secret file's text, stripped; ConfigError naming the file when it is unreadable or empty."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(f"the secret file {path} is empty")
    return secret


def user_service_token(reference: str | None, what: str) -> str:
    """The bearer token a task configures for a user's service (`env:NAME` or `file:PATH`; None:
    no token, ""). ConfigError naming `what` and the reference when it cannot be read."""
    if not reference:
        return ""
    source, _, name = reference.partition(":")
    if source == "env":
        token = os.environ.get(name, "").strip()
        if not token:
            raise ConfigError(f"{what} = {reference!r}: the environment variable {name} is not set or empty")
        return token
    if source == "file":
        return read_secret(name)
    raise ConfigError(f"{what} = {reference!r} must be env:NAME or file:PATH")


def service_auth_settings(prefix: str, directory: str | Path, role: Role) -> dict[str, str]:
    """The environment settings (PREFIX_SERVER__AUTH__...) that give a service its role's secret
    and the verifiers it checks its callers against."""
    return {
        f"{prefix}SERVER__AUTH__VERIFIERS_FILE": str(Path(directory) / VERIFIERS_FILE),
        f"{prefix}SERVER__AUTH__SECRET_FILE": str(secret_path(directory, role)),
    }


def peer_secrets(directory: str | Path) -> Callable[[str], str]:
    """For a tool that drives services as their peers would (a benchmark, a test): per method, the
    secret of the first role the authorization table allows to call it."""
    by_role = {role: read_secret(secret_path(directory, role)) for role in ROLES}

    def secret_of(method: str) -> str:
        allowed = allowed_roles(method)
        return by_role[min(allowed, key=ROLES.index)] if allowed else ""

    return secret_of


def _parse_verifiers(path: Path) -> dict[str, Role]:
    try:
        table = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the verifiers file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the verifiers file {path} is not JSON: {exc}") from exc
    if not isinstance(table, dict):
        raise ConfigError(f"the verifiers file {path} must map roles to SHA-256 digests")
    by_digest: dict[str, Role] = {}
    for role, hex_digest in table.items():
        if role not in ROLES:
            raise ConfigError(f"the verifiers file {path} names an unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(hex_digest, str) or len(hex_digest) != 64:
            raise ConfigError(f"the verifiers file {path}: {role} must be a SHA-256 digest in hex")
        by_digest[hex_digest] = role
    return by_digest


class Verifiers:
    """The role behind a bearer secret, from a verifiers file that is read again when it changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mtime_ns = self.path.stat().st_mtime_ns if self.path.exists() else 0
        self._by_digest = _parse_verifiers(self.path)
        self._checked_at = time.monotonic()

    def role_of(self, secret: str) -> Role | None:
        self._reload_if_changed()
        presented = digest(secret)
        # Compared in constant time against each digest: the loop is over six roles.
        return next((role for known, role in self._by_digest.items() if hmac.compare_digest(known, presented)), None)

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < RELOAD_SECONDS:
            return
        self._checked_at = now
        try:
            mtime_ns = self.path.stat().st_mtime_ns
            if mtime_ns != self._mtime_ns:
                self._by_digest, self._mtime_ns = _parse_verifiers(self.path), mtime_ns
                log.info("verifiers reloaded", path=str(self.path))
        except (OSError, ConfigError) as exc:
            # A half-rotated or vanished file keeps the last good table rather than locking everyone out.
            log.warning("verifiers file unusable; keeping the last good one", path=str(self.path), error=str(exc))
