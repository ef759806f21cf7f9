"""How a harness reaches its session on the manager's OpenAI gateway: the session's base URL (https
when the mesh runs TLS, the gateway then serving the manager's certificate) and what its HTTP client
must trust for it (a CA bundle: the system's roots and the mesh's CA)."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

from rlmesh.atomic_file import write_atomically
from rlmesh.rpc.channels import mesh_tls

KEY_HEADER = "x-rlmesh-session-key"
"""The header a client can carry its session's key in, when its bearer key is meant for another hop."""


def gateway_origin(address: str) -> str:
    """`http://host:port`, or `https://` when this process calls the mesh with TLS."""
    return f"{'https' if mesh_tls() is not None else 'http'}://{address}"


def session_base_url(address: str, session_id: str) -> str:
    """The OpenAI base URL of one session (its key goes as the bearer key, never in the URL)."""
    return f"{gateway_origin(address)}/sessions/{session_id}/v1"


def trust_environment() -> dict[str, str]:
    """Environment variables that make an agent's HTTP client trust the gateway's certificate:
    SSL_CERT_FILE (Python's ssl, httpx and so the `openai` client), REQUESTS_CA_BUNDLE and
    NODE_EXTRA_CA_CERTS. Empty without TLS."""
    files = mesh_tls()
    if files is None:
        return {}
    bundle = str(ca_bundle(files.ca_file, os.environ.get("SSL_CERT_FILE", "")))
    return {"SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle, "NODE_EXTRA_CA_CERTS": files.ca_file}


@functools.cache
def ca_bundle(mesh_ca: str, system: str = "") -> Path:
    """A file of the roots a client trusts by default (`system`, else certifi's) and the mesh's CA:
    replacing the defaults with the mesh's CA alone would cut the agent off from every other site."""
    import certifi

    pem = Path(system or certifi.where()).read_bytes().rstrip(b"\n") + b"\n" + Path(mesh_ca).read_bytes()
    path = Path(tempfile.gettempdir()) / f"rlmesh-ca-bundle-{hashlib.sha256(pem).hexdigest()[:16]}.pem"
    if not path.is_file():
        # Named by its content, so processes writing it at once write the same bytes.
        write_atomically(path, pem, 0o644)
    return path
