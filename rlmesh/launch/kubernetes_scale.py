"""The autoscaler's Kubernetes target: the rollout Deployment's replicas, read and set through the
scale subresource with the official client (the ServiceAccount's RBAC allows nothing else)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rlmesh.config import ConfigError
from rlmesh.launch.autoscale import TargetUnavailable

log = structlog.get_logger()

CALL_TIMEOUT = (5.0, 10.0)
"""(connect, read) seconds of every call to the API server."""
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In a pod, its ServiceAccount's credentials; elsewhere a kubeconfig (`kubeconfig`, else
    $KUBECONFIG or ~/.kube/config)."""
    try:
        if kubeconfig is None:
            try:
                config.load_incluster_config()
                return client.ApiClient()
            except config.ConfigException:
                pass
        return config.new_client_from_config(config_file=kubeconfig)
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or "the pod's ServiceAccount, $KUBECONFIG or ~/.kube/config"
        raise ConfigError(f"no Kubernetes credentials from {where}: {exc}") from None


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else `default`."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(slots=True)
class DeploymentReplicas:
    """A Deployment's replicas as the autoscaler's target. Reads and writes go through
    `deployments/scale` only, with a merge patch of `spec.replicas`. A refusal that will not mend by
    itself (credentials, RBAC, no such Deployment) raises ConfigError; a timeout or a server error
    raises TargetUnavailable."""

    api: client.ApiClient
    name: str
    namespace: str
    _apps: client.AppsV1Api = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._apps = client.AppsV1Api(self.api)

    async def current(self) -> int:
        return await asyncio.to_thread(self._read)

    async def scale_to(self, count: int, why: str) -> None:
        before = await self.current()
        if before == count:
            return
        await asyncio.to_thread(self._write, count)
        log.info(
            "rollout replicas changed",
            deployment=self.name,
            namespace=self.namespace,
            before=before,
            after=count,
            why=why,
        )

    def _read(self) -> int:
        try:
            scale = self._apps.read_namespaced_deployment_scale(
                self.name, self.namespace, _request_timeout=CALL_TIMEOUT
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise self._refusal("read", exc) from None
        return int(scale.spec.replicas or 0)

    def _write(self, count: int) -> None:
        try:
            self._apps.patch_namespaced_deployment_scale(
                self.name,
                self.namespace,
                {"spec": {"replicas": count}},
                field_manager="rlmesh-autoscaler",
                _request_timeout=CALL_TIMEOUT,
                _content_type="application/merge-patch+json",
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise self._refusal(f"set to {count} replicas", exc) from None

    def _refusal(self, action: str, exc: ApiException | urllib3.exceptions.HTTPError) -> Exception:
        """What the API server said, with what to check first for the usual codes."""
        where = f"deployment {self.namespace}/{self.name} could not be {action}"
        if not isinstance(exc, ApiException):
            return TargetUnavailable(f"{where}: {exc}")
        try:
            message = json.loads(exc.body or "{}").get("message", "") or exc.reason
        except ValueError:
            message = exc.reason
        hint = PERMANENT.get(exc.status or 0)
        if hint is None:
            return TargetUnavailable(f"{where}: HTTP {exc.status}: {message}")
        return ConfigError(f"{where}: {hint}: HTTP {exc.status}: {message}")


PERMANENT = {
    400: "the API server refused the request",
    401: "the credentials were not accepted",
    403: "the ServiceAccount needs get and patch on deployments/scale for this Deployment "
    "(deploy/k8s/base/autoscaler.yaml's Role)",
    404: "no such Deployment in this namespace",
}
"""Refusals that will not mend by themselves, with what to check first."""
