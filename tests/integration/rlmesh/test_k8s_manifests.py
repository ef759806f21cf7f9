"""deploy/k8s rendered offline with `kubectl kustomize` (each overlay, with and without the tls
component) and checked against a current Kubernetes schema (kubernetes-validate, bundled), then
for what the mesh needs: requests, probes on the service ports, the rollout's drain, the journal."""

import functools
import os
import shutil
import socket
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.paths import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37"
SERVICE_PORTS = {"manager": 50151, "weights": 50152, "trainer": 50153, "rollout": 50161}
PROBED = ("manager", "weights", "rollout")
"""Services with probes; the trainer has none, since only its global rank 0 serves."""
METRICS_PORT_OFFSET = 1000
TARGETS = [
    ("cpu", ()),
    ("gpu", ()),
    ("cpu", ("tls",)),
    ("gpu", ("tls",)),
    ("cpu", ("monitoring",)),
    ("gpu", ("tls", "monitoring")),
]
"""(overlay, the components added to it)."""
OPERATOR_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds of the Prometheus Operator's CRDs, which no Kubernetes schema has: checked for what they select."""


@functools.cache
def render(overlay: str, components: tuple[str, ...], scratch: Path) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, (
        "kubectl is not on PATH: it renders deploy/k8s (`kubectl kustomize`, kubectl >= 1.27, offline); "
        "`make test` installs it into .venv/tools/bin where the host has none (scripts/host_tools.py)"
    )
    target = K8S / "overlays" / overlay
    if components:
        # kustomize takes only relative paths to other kustomizations.
        target = scratch / "-".join((overlay, *components))
        target.mkdir(parents=True, exist_ok=True)
        (target / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(K8S / "overlays" / overlay, target)],
                    "components": [os.path.relpath(K8S / "components" / component, target) for component in components],
                }
            )
        )
    result = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {target}: {result.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(result.stdout) if obj)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("k8s")


@pytest.fixture(params=TARGETS, ids=["+".join((overlay, *components)) for overlay, components in TARGETS])
def rendered(request, scratch):
    overlay, components = request.param
    return overlay, "tls" in components, render(overlay, components, scratch)


def find(objects, kind: str, name: str) -> dict:
    matches = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_templates(objects):
    return [(obj, obj["spec"]["template"]) for obj in objects if obj["kind"] in ("Deployment", "Job")]


def container(objects, service: str) -> dict:
    workload = find(objects, "Job" if service == "trainer" else "Deployment", service)
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == service)


def env(container_spec: dict) -> dict[str, dict]:
    return {var["name"]: var for var in container_spec.get("env", [])}


def volume_behind(pod_spec: dict, container_spec: dict, path: str) -> dict:
    """The volume whose mount holds `path` in this container."""
    mount = next(
        (m for m in container_spec.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")), None
    )
    assert mount, f"{container_spec['name']}: nothing is mounted where {path} is"
    return next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])


@pytest.fixture
def no_network(monkeypatch):
    """The schemas are bundled with kubernetes-validate: any connection attempt fails the test."""

    def refuse(sock, address):
        raise AssertionError(f"validation tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def test_every_object_matches_the_kubernetes_schema(rendered, no_network):
    _, _, objects = rendered
    problems = []
    for obj in objects:
        assert "namespace" not in obj["metadata"], (
            f"{obj['kind']} {obj['metadata']['name']}: the namespace is the user's choice"
        )
        if (obj["apiVersion"], obj["kind"]) in OPERATOR_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.absolute_path)
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_every_container_requests_resources(rendered):
    _, _, objects = rendered
    for workload, template in pod_templates(objects):
        for spec in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            requests = spec.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= requests.keys(), (
                f"{workload['metadata']['name']}/{spec['name']} requests {requests}"
            )


def test_probes_call_the_health_service_on_the_service_port(rendered):
    _, tls, objects = rendered
    for service in PROBED:
        spec = container(objects, service)
        port = SERVICE_PORTS[service]
        assert {"containerPort": port, "name": "grpc"} in spec["ports"]
        assert env(spec)[f"RLMESH_{service.upper()}_SERVER__PORT"]["value"] == str(port)
        for kind in ("readinessProbe", "livenessProbe"):
            probe = spec[kind]
            if tls:
                # The kubelet's own gRPC probe cannot present a client certificate.
                assert "grpc" not in probe, f"{service} {kind}"
                assert probe["exec"]["command"] == [
                    "rlmesh",
                    "health",
                    f"127.0.0.1:{port}",
                    "--tls-dir",
                    "/etc/rlmesh/tls",
                    "--tls-name",
                    service,
                ], f"{service} {kind}"
            else:
                assert probe["grpc"] == {"port": port}, f"{service} {kind}"
    assert "livenessProbe" not in container(objects, "trainer")


def test_the_rollout_drains_before_it_stops(rendered):
    _, tls, objects = rendered
    rollout = find(objects, "Deployment", "rollout")["spec"]["template"]["spec"]
    spec = container(objects, "rollout")
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["rlmesh", "drain", f"127.0.0.1:{SERVICE_PORTS['rollout']}"]
    drain_wait = float(command[command.index("--timeout") + 1])
    instance_drain = float(env(spec)["RLMESH_ROLLOUT_DRAIN_TIMEOUT_SECONDS"]["value"])
    # The instance's own drain ends first, the command's wait next, the pod's grace last.
    assert instance_drain < drain_wait <= rollout["terminationGracePeriodSeconds"]
    if tls:
        assert command[-6:-2] == ["--tls-dir", "/etc/rlmesh/tls", "--tls-name", "rollout"]


def test_each_rollout_pod_is_its_own_instance_at_its_pod_ip(rendered):
    _, _, objects = rendered
    variables = env(container(objects, "rollout"))
    names = list(variables)
    assert variables["RLMESH_ROLLOUT_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert variables["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert variables["RLMESH_ROLLOUT_SERVER__ADVERTISE_HOST"]["value"] == "$(POD_IP)"
    # $(VAR) expands only variables declared earlier in the list.
    assert names.index("POD_IP") < names.index("RLMESH_ROLLOUT_SERVER__ADVERTISE_HOST")
    assert variables["RLMESH_ROLLOUT_PREEMPTIBLE"]["value"] == "true"


def test_the_manager_keeps_its_journal_on_a_claimed_volume(rendered):
    _, _, objects = rendered
    manager = find(objects, "Deployment", "manager")
    assert manager["spec"]["replicas"] == 1 and manager["spec"]["strategy"] == {"type": "Recreate"}
    pod = manager["spec"]["template"]["spec"]
    journal = env(container(objects, "manager"))["RLMESH_MANAGER_JOURNAL_PATH"]["value"]
    claim = volume_behind(pod, container(objects, "manager"), journal)["persistentVolumeClaim"]["claimName"]
    find(objects, "PersistentVolumeClaim", claim)


def test_trainer_pods_rendezvous_through_a_headless_service(rendered):
    _, _, objects = rendered
    job = find(objects, "Job", "trainer")
    assert job["spec"]["completionMode"] == "Indexed"
    variables = env(container(objects, "trainer"))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(variables["TRAINER_NODES"]["value"])
    subdomain = job["spec"]["template"]["spec"]["subdomain"]
    ranks = find(objects, "Service", subdomain)
    assert ranks["spec"]["clusterIP"] == "None" and ranks["spec"]["publishNotReadyAddresses"]
    args = container(objects, "trainer")["args"]
    assert f"--master-addr=$(TRAINER_JOB_NAME)-0.{subdomain}" in args
    assert variables["RLMESH_TRAINER_HANDOFF"]["value"] == "stream"
    assert find(objects, "Service", "trainer")["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"


def test_services_select_pods_that_serve_their_port(rendered):
    _, _, objects = rendered
    for service in (obj for obj in objects if obj["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [
            template
            for _, template in pod_templates(objects)
            if all(
                template["metadata"]["labels"].get(key) == value
                for key, value in selector.items()
                if not key.startswith("batch.kubernetes.io/")
            )
        ]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        port_names = {
            port.get("name") for pod in pods for c in pod["spec"]["containers"] for port in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (
                f"Service {service['metadata']['name']}: no port {port['targetPort']}"
            )


def test_overlays_pick_engine_backend_and_gpus(rendered):
    overlay, _, objects = rendered
    rollout, trainer = container(objects, "rollout"), container(objects, "trainer")
    engine = env(rollout)["RLMESH_ROLLOUT_ENGINE__KIND"]["value"]
    backend = env(trainer)["RLMESH_TRAINER_DISTRIBUTED_BACKEND"]["value"]
    if overlay == "cpu":
        assert (engine, backend) == ("torch", "gloo")
        assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in (rollout, trainer))
    else:
        assert (engine, backend) == ("vllm", "nccl")
        assert rollout["resources"]["limits"]["nvidia.com/gpu"] == "1"
        # One torchrun rank per GPU.
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == env(trainer)["TRAINER_RANKS_PER_NODE"]["value"]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_tls_points_every_service_at_mounted_certificates(overlay, scratch):
    objects = render(overlay, ("tls",), scratch)
    for service in SERVICE_PORTS:
        workload = find(objects, "Job" if service == "trainer" else "Deployment", service)
        pod, spec = workload["spec"]["template"]["spec"], container(objects, service)
        variables = env(spec)
        for field, file in (("CA_FILE", "ca.pem"), ("CERT_FILE", f"{service}.pem"), ("KEY_FILE", f"{service}-key.pem")):
            path = variables[f"RLMESH_{service.upper()}_SERVER__TLS__{field}"]["value"]
            assert Path(path).name == file
            volume = volume_behind(pod, spec, path)
            if service == "rollout":
                # Issued per pod for its IP by an init container from the CA's Secret.
                issuer = next(c for c in pod["initContainers"] if c["name"] == "issue-certificate")
                assert "emptyDir" in volume and any(m["name"] == volume["name"] for m in issuer["volumeMounts"])
                assert 'rlmesh certs --dir /etc/rlmesh/tls --host "$POD_IP"' in issuer["command"][-1]
                ca_volume = volume_behind(pod, issuer, "/etc/rlmesh/ca/ca-key.pem")
                assert ca_volume["secret"]["secretName"] == "rlmesh-tls-rollout-ca"
            else:
                assert volume["secret"]["secretName"] == f"rlmesh-tls-{service}"


ROLE_OF_SERVICE = {"manager": "manager", "weights": "weights", "rollout": "instance", "trainer": "trainer"}


def test_every_service_is_authorized_by_role_with_only_its_own_secret(rendered):
    """Authorization is on in every rendering: each pod mounts the verifiers and its own role's
    secret, nothing turns it off, and the rollout's preStop drain presents the instance's secret."""
    _, _, objects = rendered
    for service, role in ROLE_OF_SERVICE.items():
        workload = find(objects, "Job" if service == "trainer" else "Deployment", service)
        pod, spec = workload["spec"]["template"]["spec"], container(objects, service)
        variables = env(spec)
        prefix = f"RLMESH_{service.upper()}_SERVER__AUTH__"
        assert f"{prefix}INSECURE" not in variables
        for field, file in (("VERIFIERS_FILE", "verifiers.json"), ("SECRET_FILE", "secret")):
            path = variables[f"{prefix}{field}"]["value"]
            assert Path(path).name == file
            sources = volume_behind(pod, spec, path)["projected"]["sources"]
            assert [source["secret"]["name"] for source in sources] == ["rlmesh-verifiers", f"rlmesh-secret-{role}"]
    assert (
        find(objects, "Deployment", "manager")
        and env(container(objects, "manager"))["RLMESH_MANAGER_WEIGHTS_ADDRESS"]["value"] == "weights:50152"
    )
    drain = container(objects, "rollout")["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[drain.index("--secret-file") + 1] == "/etc/rlmesh/auth/secret"


def test_every_service_exposes_its_metrics_port(rendered):
    _, _, objects = rendered
    for service, port in SERVICE_PORTS.items():
        spec = container(objects, service)
        metrics = port + METRICS_PORT_OFFSET
        assert {"containerPort": metrics, "name": "metrics"} in spec["ports"], service
        assert env(spec)[f"RLMESH_{service.upper()}_SERVER__METRICS_PORT"]["value"] == str(metrics)
        assert {"name": "metrics", "port": metrics, "targetPort": "metrics"} in find(objects, "Service", service)[
            "spec"
        ]["ports"]


def test_the_service_monitor_scrapes_every_service(scratch):
    for overlay in ("cpu", "gpu"):
        objects = render(overlay, ("monitoring",), scratch)
        monitor = find(objects, "ServiceMonitor", "rlmesh")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
        selector = monitor["spec"]["selector"]["matchLabels"]
        scraped = {
            obj["metadata"]["name"]
            for obj in objects
            if obj["kind"] == "Service"
            and selector.items() <= obj["metadata"].get("labels", {}).items()
            and any(port["name"] == "metrics" for port in obj["spec"]["ports"])
        }
        assert scraped == set(SERVICE_PORTS), overlay
    assert not any(obj["kind"] == "ServiceMonitor" for obj in render("cpu", (), scratch)), (
        "the ServiceMonitor needs the operator's CRDs: only the monitoring component may add it"
    )


def test_the_trainer_points_agents_at_the_managers_gateway_through_its_service(rendered):
    """Agent commands and verifiers environments reach their sessions on the manager's OpenAI
    gateway: the manager serves it on a named port its Service publishes, with the policy's
    tokenizer mounted, and the trainer is given that address."""
    _, _, objects = rendered
    manager = container(objects, "manager")
    port = int(env(manager)["RLMESH_MANAGER_GATEWAY_PORT"]["value"])
    assert {"containerPort": port, "name": "gateway"} in manager["ports"]
    service_ports = {p["name"]: p for p in find(objects, "Service", "manager")["spec"]["ports"]}
    assert service_ports["gateway"]["port"] == port and service_ports["gateway"]["targetPort"] == "gateway"
    model_dir = env(manager)["RLMESH_MANAGER_MODEL_DIR"]["value"]
    pod = find(objects, "Deployment", "manager")["spec"]["template"]["spec"]
    assert volume_behind(pod, manager, model_dir + "/config.json")["persistentVolumeClaim"]["claimName"] == "models"
    assert model_dir == env(container(objects, "trainer"))["RLMESH_TRAINER_MODEL_DIR"]["value"]
    assert env(container(objects, "trainer"))["RLMESH_TRAINER_GATEWAY_ADDRESS"]["value"] == f"manager:{port}"


def test_only_the_autoscaler_holds_an_api_token_and_it_may_only_scale_the_rollout(rendered):
    """Least privilege: one Role, get and patch on the rollout Deployment's scale subresource, bound
    to the autoscaler's ServiceAccount, whose pod alone mounts a token; the autoscaler reads the
    manager with the observer's secret (GetStatus is all it calls)."""
    _, tls, objects = rendered
    roles = [obj for obj in objects if obj["kind"] in ("Role", "ClusterRole")]
    assert [role["metadata"]["name"] for role in roles] == ["rlmesh-autoscaler"]
    assert roles[0]["kind"] == "Role"
    assert roles[0]["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["rollout"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = find(objects, "RoleBinding", "rlmesh-autoscaler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rlmesh-autoscaler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlmesh-autoscaler"}]
    assert not [obj for obj in objects if obj["kind"] == "ClusterRoleBinding"]
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        if workload["metadata"]["name"] == "autoscaler":
            assert pod["serviceAccountName"] == "rlmesh-autoscaler" and pod["automountServiceAccountToken"] is True
        else:
            assert pod.get("automountServiceAccountToken") is False, workload["metadata"]["name"]
    spec = container(objects, "autoscaler")
    command = spec["command"]
    assert command[:3] == ["rlmesh", "autoscale", "--manager"] and command[3] == f"manager:{SERVICE_PORTS['manager']}"
    assert command[command.index("--deployment") + 1] == "rollout"
    pod = find(objects, "Deployment", "autoscaler")["spec"]["template"]["spec"]
    secret_file = command[command.index("--secret-file") + 1]
    sources = volume_behind(pod, spec, secret_file)["projected"]["sources"]
    assert [source["secret"]["name"] for source in sources] == ["rlmesh-secret-observer"]
    if tls:
        assert command[command.index("--tls-name") + 1] == "observer"
        tls_dir = command[command.index("--tls-dir") + 1]
        assert volume_behind(pod, spec, f"{tls_dir}/observer.pem")["secret"]["secretName"] == "rlmesh-tls-observer"
