"""What `rlmesh up` starts: the job (its mesh section above all) with what the run adds to it (the
output folder, the model folder, the certificates, the role secrets, the network namespaces), and
what follows from them: each service's address and security settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlmesh.config import TlsFiles
from rlmesh.job import Job, MeshSection
from rlmesh.launch.netns import NetnsLayout, NetnsLink
from rlmesh.rpc.authz import Role
from rlmesh.rpc.credentials import secret_path, service_auth_settings

ROLLOUT_PORT_OFFSET = 10
"""Rollout instance i listens on the base port + ROLLOUT_PORT_OFFSET + i."""
RELAY_PORT_OFFSET = 4
"""Relay shard i listens on the base port + RELAY_PORT_OFFSET + i (below the rollout instances')."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    job: Job
    output_dir: Path
    model_dir: Path
    trainer_config: Path | None = None
    """The trainer's config file, written from the job (tasks, algorithm, outputs)."""
    tls_dir: Path | None = None
    """Mutual TLS with the certificates in this folder (`rlmesh certs`); None: plaintext."""
    secrets_dir: Path | None = None
    """The bearer secret of each role and their verifiers; None: authorization is off (--insecure)."""
    netns: NetnsLayout | None = None
    """The first len(netns.links) rollout instances each run in their own network namespace."""
    job_dir: Path | None = None
    """The job file's folder, where its reward modules are found (None: the working directory)."""
    warm_fork_server: Path | None = None
    """The socket of a warm fork server (`rlmesh fork-server`) to fork the services from; None, or
    none answering there: the run starts its own."""

    @property
    def mesh(self) -> MeshSection:
        return self.job.mesh

    @property
    def steps(self) -> int:
        return self.job.algorithm.steps

    @property
    def log_dir(self) -> Path:
        return self.output_dir / "logs"

    @property
    def manager_host(self) -> str:
        return self.netns.manager_host if self.netns is not None else self.mesh.host

    @property
    def manager_address(self) -> str:
        return f"{self.manager_host}:{self.mesh.base_port}"

    @property
    def weights_address(self) -> str:
        return f"{self.mesh.host}:{self.mesh.base_port + 1}"

    @property
    def gateway_address(self) -> str:
        """The manager's OpenAI-compatible gateway (HTTP)."""
        return f"{self.manager_host}:{self.mesh.base_port + 3}"

    @property
    def trainer_address(self) -> str:
        return f"{self.mesh.host}:{self.mesh.base_port + 2}"

    @property
    def relay_addresses(self) -> list[str]:
        """The manager's relay shards, beside it."""
        return [
            f"{self.manager_host}:{self.mesh.base_port + RELAY_PORT_OFFSET + i}" for i in range(self.mesh.relay_shards)
        ]

    def netns_link(self, index: int) -> NetnsLink | None:
        if self.netns is None or index >= len(self.netns.links):
            return None
        return self.netns.links[index]

    def rollout_host(self, index: int) -> str:
        link = self.netns_link(index)
        return link.namespace_address if link is not None else self.mesh.host

    def rollout_address(self, index: int) -> str:
        return f"{self.rollout_host(index)}:{self.mesh.base_port + ROLLOUT_PORT_OFFSET + index}"

    def tls_files(self, name: str) -> TlsFiles | None:
        return TlsFiles.in_directory(self.tls_dir, name) if self.tls_dir is not None else None

    def secret_file(self, role: Role) -> Path | None:
        return secret_path(self.secrets_dir, role) if self.secrets_dir is not None else None

    def security_settings(self, service: str, prefix: str = "") -> dict[str, str]:
        """The environment settings that give `service` its certificate, its role's bearer secret
        and the verifiers it checks its callers' secrets against (or turn authorization off), under
        `prefix` (default: the service's own)."""
        from rlmesh.rpc.tls import ROLE_OF_NAME

        prefix = prefix or f"RLMESH_{service.upper()}_"
        settings = {}
        files = self.tls_files(service)
        if files is not None:
            settings |= {
                f"{prefix}SERVER__TLS__CA_FILE": files.ca_file,
                f"{prefix}SERVER__TLS__CERT_FILE": files.cert_file,
                f"{prefix}SERVER__TLS__KEY_FILE": files.key_file,
            }
        if self.secrets_dir is None:
            settings[f"{prefix}SERVER__AUTH__INSECURE"] = "true"
        else:
            settings |= service_auth_settings(prefix, self.secrets_dir, ROLE_OF_NAME[service])
        return settings
