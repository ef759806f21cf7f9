"""A Kubernetes API server stand-in on loopback for the autoscaler's actuator: it answers the
Deployment scale subresource (GET, PATCH) with responses in the API's own shapes (autoscaling/v1
Scale, meta/v1 Status), checks the bearer token, and keeps every request it was sent."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "service-account-token-for-tests"
NAMESPACE = "rlmesh"


def scale_response(name: str, namespace: str, replicas: int, generation: int) -> dict:
    """What the API server returns for GET or PATCH of a Deployment's scale."""
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": "9b6f2c1e-1d2a-4c4b-9a37-5f3a0c2d7e11",
            "resourceVersion": str(41_000 + generation),
            "creationTimestamp": "2026-12-01T10:00:00Z",
        },
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": "app.kubernetes.io/name=rollout,app.kubernetes.io/part-of=rlmesh"},
    }


def status_response(code: int, reason: str, message: str, name: str) -> dict:
    """A meta/v1 Status, as the API server returns for a refused request."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "group": "apps", "kind": "deployments"},
        "code": code,
    }


def forbidden(verb: str, name: str) -> dict:
    return status_response(
        403,
        "Forbidden",
        f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:{NAMESPACE}:default" cannot {verb} '
        f'resource "deployments/scale" in API group "apps" in the namespace "{NAMESPACE}"',
        name,
    )


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: dict | None


@dataclass
class ScaleApi:
    """The state behind the stand-in: one Deployment's replicas, and refusals to answer with."""

    name: str = "rollout"
    replicas: int = 2
    allowed_verbs: set[str] = field(default_factory=lambda: {"get", "patch"})
    unavailable: int = 0
    """Requests still to answer 503 (an API server restarting)."""
    received: list[Received] = field(default_factory=list)
    generation: int = 0

    @property
    def path(self) -> str:
        return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{self.name}/scale"

    def answer(self, method: str, path: str, headers: dict[str, str], body: dict | None) -> tuple[int, dict]:
        self.received.append(Received(method, path, headers, body))
        if headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, status_response(401, "Unauthorized", "Unauthorized", self.name)
        if self.unavailable:
            self.unavailable -= 1
            return 503, status_response(
                503, "ServiceUnavailable", "the server is currently unable to handle the request", self.name
            )
        if path.split("?")[0] != self.path:
            return 404, status_response(404, "NotFound", f'deployments.apps "{path}" not found', self.name)
        verb = {"GET": "get", "PATCH": "patch"}.get(method, method.lower())
        if verb not in self.allowed_verbs:
            return 403, forbidden(verb, self.name)
        if verb == "patch":
            self.replicas = int(body["spec"]["replicas"])
            self.generation += 1
        return 200, scale_response(self.name, NAMESPACE, self.replicas, self.generation)


class _Handler(BaseHTTPRequestHandler):
    api: ScaleApi

    def _serve(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        code, payload = self.api.answer(self.command, self.path, headers, json.loads(raw) if raw else None)
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_PUT = do_POST = _serve

    def log_message(self, *args) -> None:
        pass


class KubernetesApiStandIn:
    """`with KubernetesApiStandIn(ScaleApi()) as server:` serves on 127.0.0.1 at `server.url`."""

    def __init__(self, api: ScaleApi) -> None:
        handler = type("Handler", (_Handler,), {"api": api})
        self.api = api
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> KubernetesApiStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, token: str = TOKEN) -> dict:
        """A kubeconfig for this server with a ServiceAccount-style bearer token."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "autoscaler", "user": {"token": token}}],
            "contexts": [
                {"name": "test", "context": {"cluster": "test", "user": "autoscaler", "namespace": NAMESPACE}}
            ],
            "current-context": "test",
        }
