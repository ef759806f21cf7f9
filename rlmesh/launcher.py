"""`rlmesh up`: the whole mesh as local processes on loopback: start in dependency order, wait on
each health service, show training progress, keep the manager, the weights service and the rollout
instances running (restarted with backoff when they exit; instances scaled by `rlmesh scale` or the
autoscaler, optionally each in its own network namespace), and stop every process at the end or on Ctrl-C."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from rlmesh.autoscale import Autoscaler
from rlmesh.config import METRICS_PORT_OFFSET, TlsFiles
from rlmesh.lifecycle import CAP_NET_ADMIN, CAP_SYS_ADMIN, die_with_parent, effective_capabilities
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import call_options, open_channel, use_tls, wait_healthy
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc

MESH_ID_ENV = "RLMESH_MESH_ID"
"""Set in every process of a mesh (to its output folder) so its processes can be found."""
STOP_TIMEOUT_SECONDS = 15.0
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
"""The vLLM engine's own virtualenv (`make setup-vllm`)."""
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
TRAINER_RESTARTS = 20
"""Most times a trainer killed by a signal is started again in one run."""
"""Waits before restarting a service that exited, growing with each restart in a row."""
STABLE_SECONDS = 60.0
"""A service that ran this long is healthy again: its next restart waits the shortest time."""
STATE_FILE = "mesh.json"
"""Written by `rlmesh up` in the output folder: its pid and the rollout instances, for `rlmesh scale`."""
SCALE_FILE = "scale.json"
"""Written by `rlmesh scale` in the output folder: the number of rollout instances wanted."""
AUTOSCALE_POLL_SECONDS = 2.0
MANAGER_JOURNAL_FILE = "manager-journal.sqlite"
"""The manager's journal in the output folder: a restarted manager takes up its state from it."""
NETNS_PREFIX = "rlmesh-"
"""Network namespaces of rollout instances are named rlmesh-<mesh tag>-<launcher pid>-<index>."""


@dataclass(frozen=True, slots=True)
class NetnsLink:
    """A rollout instance's own network namespace and the veth pair linking it to the host."""

    namespace: str
    host_device: str
    """The host's end of the veth pair: setting it down cuts the instance off."""
    namespace_device: str
    host_address: str
    """The namespace's gateway."""
    namespace_address: str
    """The instance listens here."""


@dataclass(frozen=True, slots=True)
class NetnsLayout:
    """Where the rollout instances that run in their own network namespaces live, and the address
    the manager listens on so that they can reach it (on the host's loopback device, reached from
    a namespace through its veth pair)."""

    tag: str
    manager_host: str
    links: tuple[NetnsLink, ...]

    @property
    def manager_label(self) -> str:
        return f"lo:rlm{self.tag}"

    @property
    def hosts(self) -> list[str]:
        """Every address a service may be reached at, for certificates."""
        return [self.manager_host, *(link.namespace_address for link in self.links)]


@dataclass(frozen=True, slots=True)
class MeshPlan:
    output_dir: Path
    model_dir: Path
    steps: int
    rollout_instances: int
    host: str
    base_port: int
    max_staleness: int
    transfer_backend: str
    trainer_ranks: int = 1
    """FSDP ranks of the trainer; more than one runs it under torchrun on this machine."""
    rollout_tp: int = 1
    """Tensor-parallel processes per rollout instance."""
    rollout_device: str = "cpu"
    """Where a torch-engine instance runs: cpu or cuda."""
    rollout_dtype: str = "auto"
    """The dtype instances serve in (model.dtype)."""
    rollout_max_batch_size: int = 256
    """Sequences a rollout instance decodes at once."""
    rollout_stream_interval: int = 16
    """Tokens per chunk a torch-engine instance streams back."""
    compression: str = "none"
    """Link compression of weight pushes."""
    trainer_config: Path | None = None
    """The trainer's config file, written from the job (tasks, algorithm, outputs)."""
    engine: str = "torch"
    """Rollout engine: `torch`, or `vllm` run with the vLLM virtualenv's Python."""
    update_mode: str = "continue"
    """What a rollout instance's requests in flight do at a weight switch (mesh.update_mode)."""
    max_rollout_instances: int = 0
    """Most rollout instances `rlmesh scale` or the autoscaler may run (0: rollout_instances)."""
    autoscale: bool = False
    """Follow the manager's recommended instance count within [rollout_instances, max_rollout_instances]."""
    autoscale_patience_seconds: float = 30.0
    autoscale_cooldown_seconds: float = 60.0
    tls_dir: Path | None = None
    """Mutual TLS with the certificates in this folder (`rlmesh certs`); None: plaintext."""
    registration_token: str = ""
    """Asked by the manager of the rollout instances ("": none)."""
    netns: NetnsLayout | None = None
    """The first len(netns.links) rollout instances each run in their own network namespace."""

    @property
    def instance_cap(self) -> int:
        return max(self.max_rollout_instances, self.rollout_instances)

    @property
    def manager_host(self) -> str:
        return self.netns.manager_host if self.netns is not None else self.host

    @property
    def manager_address(self) -> str:
        return f"{self.manager_host}:{self.base_port}"

    @property
    def weights_address(self) -> str:
        return f"{self.host}:{self.base_port + 1}"

    @property
    def trainer_address(self) -> str:
        return f"{self.host}:{self.base_port + 2}"

    def netns_link(self, index: int) -> NetnsLink | None:
        if self.netns is None or index >= len(self.netns.links):
            return None
        return self.netns.links[index]

    def rollout_host(self, index: int) -> str:
        link = self.netns_link(index)
        return link.namespace_address if link is not None else self.host

    def rollout_address(self, index: int) -> str:
        return f"{self.rollout_host(index)}:{self.base_port + 10 + index}"

    def tls_files(self, name: str) -> TlsFiles | None:
        return TlsFiles.in_directory(self.tls_dir, name) if self.tls_dir is not None else None

    def security_settings(self, service: str) -> dict[str, str]:
        """The environment settings that give `service` its certificate and, for the manager and
        the rollout instances, the registration token."""
        prefix = f"RLMESH_{service.upper()}_"
        settings = {}
        files = self.tls_files(service)
        if files is not None:
            settings |= {f"{prefix}SERVER__TLS__CA_FILE": files.ca_file, f"{prefix}SERVER__TLS__CERT_FILE": files.cert_file,
                         f"{prefix}SERVER__TLS__KEY_FILE": files.key_file}
        if self.registration_token and service in ("manager", "rollout"):
            settings[f"{prefix}REGISTRATION_TOKEN"] = self.registration_token
        return settings


@dataclass(slots=True)
class Child:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def metrics_address(address: str) -> str:
    """Where the service at gRPC `address` serves Prometheus `/metrics`."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + METRICS_PORT_OFFSET}"


def _metrics_setting(prefix: str, address: str) -> dict[str, str]:
    return {f"{prefix}_SERVER__METRICS_PORT": _port(metrics_address(address))}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


MESH_PORT_OFFSETS = (0, 1, 2, *range(10, 26))
"""Ports `rlmesh up` takes from its base: manager, weights, trainer and up to 16 rollout
instances, each with its metrics port METRICS_PORT_OFFSET above."""


def _port_free(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


BASE_PORTS = range(20000, 31000)
"""Where `free_base_port` draws from: below the kernel's ephemeral ports, which outgoing
connections take at random (one landing on a mesh port would stop a service from binding it).
Processes that start meshes side by side (the test suite's workers) each narrow it to a slice of
their own: a port free when drawn is not yet bound, and another process could draw it too."""


def free_base_port(host: str = "127.0.0.1") -> int:
    """A base port for a mesh on `host` (tests, benchmarks) whose every port is free now."""
    while True:
        base = random.choice(BASE_PORTS)
        if all(_port_free(base + offset + extra, host) for offset in MESH_PORT_OFFSETS for extra in (0, METRICS_PORT_OFFSET)):
            return base


def torchrun_args(ranks: int, master_port: int, master_addr: str = "127.0.0.1") -> list[str]:
    """`python -m torch.distributed.run ...` arguments that run a module on `ranks` local processes."""
    return ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--master-addr", master_addr, "--master-port", str(master_port)]


def _ip(*args: str) -> str:
    """Runs iproute2's `ip` and returns its output; raises RuntimeError with its message."""
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or f'exit code {result.returncode}'}")
    return result.stdout


def netns_problem() -> str:
    """Why this process cannot run rollout instances in network namespaces ("" when it can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    effective = effective_capabilities()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not effective >> bit & 1]
    if missing:
        return f"it needs {' and '.join(missing)} to create network namespaces and veth pairs (run as root)"
    try:
        _ip("netns", "list")
    except RuntimeError as exc:
        return str(exc)
    return ""


def mesh_tag(output_dir: Path) -> str:
    """Six hex digits naming a mesh (its output folder) in interface and namespace names."""
    return hashlib.sha1(str(output_dir).encode()).hexdigest()[:6]


def plan_netns(output_dir: Path, count: int) -> NetnsLayout:
    """Names and addresses for `count` namespaces: a /24 between 10.200.0.0 and 10.249.255.0,
    picked from the mesh's tag among those no address on the host falls in, a /30 per instance."""
    tag = mesh_tag(output_dir)
    in_use = [ipaddress.ip_interface(cidr).network for cidr in re.findall(r"\binet (\S+)", _ip("-o", "-4", "addr", "show"))]
    choices = 50 * 256
    first = int(tag, 16) % choices
    for attempt in range(choices):
        number = (first + attempt) % choices
        subnet = ipaddress.ip_network(f"10.{200 + number // 256}.{number % 256}.0/24")
        if not any(subnet.overlaps(network) for network in in_use):
            break
    else:
        raise RuntimeError("every 10.200-249.x.0/24 subnet is in use on this host: no room for rollout namespaces")
    base = subnet.network_address
    links = tuple(NetnsLink(f"{NETNS_PREFIX}{tag}-{os.getpid()}-{index}", f"rlm{tag}h{index}", f"rlm{tag}n{index}",
                            str(base + 4 * index + 1), str(base + 4 * index + 2)) for index in range(count))
    return NetnsLayout(tag, str(base + 254), links)


def create_netns(layout: NetnsLayout) -> None:
    for link in layout.links:
        _ip("netns", "add", link.namespace)
        _ip("link", "add", link.host_device, "type", "veth", "peer", "name", link.namespace_device, "netns", link.namespace)
        _ip("addr", "add", f"{link.host_address}/30", "dev", link.host_device)
        _ip("link", "set", link.host_device, "up")
        _ip("-n", link.namespace, "addr", "add", f"{link.namespace_address}/30", "dev", link.namespace_device)
        _ip("-n", link.namespace, "link", "set", "lo", "up")
        _ip("-n", link.namespace, "link", "set", link.namespace_device, "up")
        _ip("-n", link.namespace, "route", "add", "default", "via", link.host_address)
    # Added after the namespaces: a sweep takes a manager address without namespaces of its tag for a leftover.
    _ip("addr", "add", f"{layout.manager_host}/32", "dev", "lo", "label", layout.manager_label)


def remove_netns(layout: NetnsLayout) -> None:
    """Deleting a namespace deletes the veth pair with an end in it."""
    for link in layout.links:
        try:
            _ip("netns", "delete", link.namespace)
        except RuntimeError:
            pass
    try:
        _ip("addr", "del", f"{layout.manager_host}/32", "dev", "lo")
    except RuntimeError:
        pass


def _launcher_alive(pid: int) -> bool:
    try:
        return b"rlmesh" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def sweep_netns() -> list[str]:
    """Removes the namespaces (with their veth pairs) and manager addresses left by an `rlmesh up`
    that is gone without cleaning up (killed with SIGKILL); returns what it removed."""
    removed = []
    live_tags = set()
    for name in re.findall(rf"^({re.escape(NETNS_PREFIX)}[0-9a-f]{{6}}-\d+-\d+)\b", _ip("netns", "list"), re.MULTILINE):
        tag, pid = name[len(NETNS_PREFIX):].split("-")[:2]
        if _launcher_alive(int(pid)):
            live_tags.add(tag)
            continue
        _ip("netns", "delete", name)
        removed.append(name)
    for address, label, tag in re.findall(r"\binet (\S+) .*\b(lo:rlm([0-9a-f]{6}))\b", _ip("-o", "-4", "addr", "show", "dev", "lo")):
        if tag not in live_tags:
            _ip("addr", "del", address, "dev", "lo")
            removed.append(f"{label} {address}")
    return removed


def spawn_service(name: str, module: str, address: str, settings: dict[str, str], log_dir: Path, mesh_id: str,
                  python: str | None = None, launcher: list[str] | None = None, args: list[str] | None = None,
                  wrapper: list[str] | None = None) -> Child:
    """Starts `python -m module args...` as its own process group with `settings` in its
    environment and its output in `log_dir/name.log`; `python` picks another virtualenv (the
    vLLM one); `launcher` runs the module through another module (`torchrun_args`); `wrapper` is
    a command that execs the rest (`ip netns exec NS`), so the pid is the service's."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, **settings, MESH_ID_ENV: mesh_id, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [*(wrapper or []), python or sys.executable, *(launcher or []), "-m", module, *(args or [])],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # If the launching process itself is killed, the kernel sends SIGTERM to its services too.
            preexec_fn=die_with_parent,
        )
    return Child(name, address, process, log_path)


async def wait_started(children: list[Child], timeout: float = 120.0) -> None:
    """Waits until every child's health service says SERVING; fails fast if one exits."""

    async def one(child: Child) -> None:
        waiting = asyncio.create_task(wait_healthy(child.address, timeout))
        while not waiting.done():
            if child.process.poll() is not None:
                waiting.cancel()
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} while starting; see {child.log_path}")
            await asyncio.sleep(0.1)
        waiting.result()

    await asyncio.gather(*(one(c) for c in children))


def stop_children(children: list[Child]) -> None:
    """SIGTERM in reverse start order, SIGKILL after a timeout."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


@dataclass(slots=True)
class Supervised:
    """A service the launcher keeps running: when it exits it is reported and, after a backoff,
    started again (`start` spawns it)."""

    name: str
    start: Callable[[], Child]
    child: Child
    started_at: float
    restarts_in_a_row: int = 0
    restarts_total: int = 0
    restart_at: float | None = None
    retiring: bool = False
    """Being scaled down: its exit is expected and it is not restarted."""


@dataclass(slots=True)
class MeshEvents:
    """What the supervisor did in one tick, for the console."""

    lines: list[str] = field(default_factory=list)


class Mesh:
    def __init__(self, plan: MeshPlan) -> None:
        self.plan = plan
        self.children: list[Child] = []
        self.log_dir = plan.output_dir / "logs"
        self.manager: Supervised | None = None
        self.weights: Supervised | None = None
        self.rollouts: dict[int, Supervised] = {}
        self.trainer: Child | None = None
        self.trainer_restarts = 0
        """Times the trainer was killed by a signal and started again (it resumes from its checkpoint)."""
        self.target_instances = plan.rollout_instances
        self.autoscaler = (Autoscaler(plan.rollout_instances, plan.instance_cap, plan.autoscale_patience_seconds,
                                      plan.autoscale_cooldown_seconds) if plan.autoscale else None)
        self._scale_seen = 0.0
        self._autoscale_at = 0.0

    def _spawn(self, name: str, module: str, address: str, settings: dict[str, str], launcher: list[str] | None = None,
               python: str | None = None, args: list[str] | None = None, wrapper: list[str] | None = None) -> Child:
        child = spawn_service(name, module, address, settings, self.log_dir, str(self.plan.output_dir), python=python,
                              launcher=launcher, args=args, wrapper=wrapper)
        self.children.append(child)
        return child

    def _spawn_manager(self) -> Child:
        """On the same port and journal every time: a restarted manager takes up where the last one stopped."""
        plan = self.plan
        return self._spawn("manager", "services.manager", plan.manager_address, {
            "RLMESH_MANAGER_SERVER__HOST": plan.manager_host,
            "RLMESH_MANAGER_SERVER__PORT": _port(plan.manager_address),
            "RLMESH_MANAGER_MAX_STALENESS": str(plan.max_staleness),
            "RLMESH_MANAGER_JOURNAL_PATH": str(plan.output_dir / MANAGER_JOURNAL_FILE),
            **_metrics_setting("RLMESH_MANAGER", plan.manager_address),
            **plan.security_settings("manager"),
        })

    def _spawn_weights(self) -> Child:
        plan = self.plan
        return self._spawn("weights", "services.weights", plan.weights_address, {
            "RLMESH_WEIGHTS_SERVER__HOST": plan.host,
            "RLMESH_WEIGHTS_SERVER__PORT": _port(plan.weights_address),
            "RLMESH_WEIGHTS_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_WEIGHTS_BACKEND": plan.transfer_backend,
            "RLMESH_WEIGHTS_COMPRESSION": plan.compression,
            **_metrics_setting("RLMESH_WEIGHTS", plan.weights_address),
            **plan.security_settings("weights"),
        })

    def _spawn_rollout(self, index: int) -> Child:
        plan = self.plan
        link = plan.netns_link(index)
        return self._spawn(f"rollout-{index}", "services.rollout", plan.rollout_address(index), {
            "RLMESH_ROLLOUT_SERVER__HOST": plan.rollout_host(index),
            "RLMESH_ROLLOUT_SERVER__PORT": _port(plan.rollout_address(index)),
            "RLMESH_ROLLOUT_INSTANCE_ID": f"rollout-{index}",
            "RLMESH_ROLLOUT_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_ROLLOUT_ENGINE__MODEL_DIR": str(plan.model_dir),
            "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "true" if plan.transfer_backend == "mooncake" else "false",
            "RLMESH_ROLLOUT_ENGINE__TENSOR_PARALLEL_SIZE": str(plan.rollout_tp),
            "RLMESH_ROLLOUT_ENGINE__DEVICE": plan.rollout_device,
            "RLMESH_ROLLOUT_ENGINE__DTYPE": plan.rollout_dtype,
            "RLMESH_ROLLOUT_ENGINE__MAX_BATCH_SIZE": str(plan.rollout_max_batch_size),
            "RLMESH_ROLLOUT_ENGINE__STREAM_INTERVAL": str(plan.rollout_stream_interval),
            "RLMESH_ROLLOUT_ENGINE__KIND": plan.engine,
            "RLMESH_ROLLOUT_ENGINE__UPDATE_MODE": plan.update_mode,
            **_metrics_setting("RLMESH_ROLLOUT", plan.rollout_address(index)),
            **plan.security_settings("rollout"),
        }, python=str(VLLM_PYTHON) if plan.engine == "vllm" else None,
            wrapper=["ip", "netns", "exec", link.namespace] if link is not None else None)

    def _supervise(self, name: str, start: Callable[[], Child]) -> Supervised:
        return Supervised(name, start, start(), time.monotonic())

    async def start_services(self) -> None:
        plan = self.plan
        # A journal left by an earlier `rlmesh up` of this folder describes batches past the checkpoint
        # the trainer resumes from; only restarts within this run take up the manager's state.
        for stale in plan.output_dir.glob(f"{MANAGER_JOURNAL_FILE}*"):
            stale.unlink()
        self.manager = self._supervise("manager", self._spawn_manager)
        await wait_started([self.manager.child])
        self.weights = self._supervise("weights", self._spawn_weights)
        for index in range(plan.rollout_instances):
            self.rollouts[index] = self._supervise(f"rollout-{index}", lambda index=index: self._spawn_rollout(index))
        await wait_started([self.weights.child, *(r.child for r in self.rollouts.values())])
        self.write_state()

    async def start_trainer(self) -> Child:
        """One trainer process, or torchrun with `trainer_ranks` of them (rank 0 serves the port)."""
        plan = self.plan
        launcher = torchrun_args(plan.trainer_ranks, free_port(plan.host), plan.host) if plan.trainer_ranks > 1 else None
        trainer = self._spawn("trainer", "services.trainer", plan.trainer_address, {
            "RLMESH_TRAINER_SERVER__HOST": plan.host,
            "RLMESH_TRAINER_SERVER__PORT": _port(plan.trainer_address),
            "RLMESH_TRAINER_MANAGER_ADDRESS": plan.manager_address,
            "RLMESH_TRAINER_WEIGHTS_ADDRESS": plan.weights_address,
            "RLMESH_TRAINER_MODEL_DIR": str(plan.model_dir),
            "RLMESH_TRAINER_OUTPUT_DIR": str(plan.output_dir),
            "RLMESH_TRAINER_STEPS": str(plan.steps),
            **_metrics_setting("RLMESH_TRAINER", plan.trainer_address),
            **plan.security_settings("trainer"),
        }, launcher, args=["--config", str(plan.trainer_config)] if plan.trainer_config else None)
        await wait_started([trainer])
        self.trainer = trainer
        self.write_state()
        return trainer

    def running_instances(self) -> list[int]:
        return sorted(i for i, r in self.rollouts.items() if not r.retiring)

    def _service_state(self, service: Supervised, index: int | None = None) -> dict:
        state = {"name": service.name, "pid": service.child.process.pid, "address": service.child.address,
                 "metrics": metrics_address(service.child.address),
                 "restarts": service.restarts_in_a_row, "restarts_total": service.restarts_total}
        link = self.plan.netns_link(index) if index is not None else None
        if link is not None:
            state |= {"netns": link.namespace, "link": link.host_device}
        return state

    def write_state(self) -> None:
        """mesh.json: what `rlmesh scale` and the chaos suite read (written whole, then renamed into place)."""
        plan = self.plan
        state = {
            "pid": os.getpid(),
            "manager": plan.manager_address,
            "services": [self._service_state(s) for s in (self.manager, self.weights) if s is not None],
            "rollout_instances": {
                "min": plan.rollout_instances, "max": plan.instance_cap, "target": self.target_instances,
                "running": [self._service_state(r, i) for i, r in sorted(self.rollouts.items()) if not r.retiring],
                "leaving": [r.name for _, r in sorted(self.rollouts.items()) if r.retiring],
            },
            "autoscale": plan.autoscale,
        }
        if self.trainer is not None:
            state["trainer"] = {"pid": self.trainer.process.pid, "address": self.trainer.address,
                                "metrics": metrics_address(self.trainer.address), "restarts": self.trainer_restarts}
        path = plan.output_dir / STATE_FILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(path)

    def _restart_due(self, service: Supervised, now: float, events: MeshEvents) -> None:
        code = service.child.process.returncode
        if service.restart_at is None:
            if now - service.started_at >= STABLE_SECONDS:
                service.restarts_in_a_row = 0
            wait = RESTART_BACKOFF_SECONDS[min(service.restarts_in_a_row, len(RESTART_BACKOFF_SECONDS) - 1)]
            service.restart_at = now + wait
            events.lines.append(f"{service.name} {describe_exit(code)}; restarting in {wait:.0f} s; see {service.child.log_path}")
        elif now >= service.restart_at:
            exited = service.child
            service.child = service.start()
            # In the exited one's place: the mesh stops in reverse start order, the manager last.
            self.children.remove(service.child)
            self.children[self.children.index(exited)] = service.child
            service.started_at, service.restart_at = now, None
            service.restarts_in_a_row += 1
            service.restarts_total += 1
            events.lines.append(f"{service.name} restarted (pid {service.child.process.pid}, restart {service.restarts_in_a_row} in a row)")
            self.write_state()

    def _scale_to(self, count: int, events: MeshEvents, why: str) -> None:
        count = min(max(count, self.plan.rollout_instances), self.plan.instance_cap)
        if count == self.target_instances:
            return
        events.lines.append(f"rollout instances: {self.target_instances} -> {count} ({why})")
        self.target_instances = count
        running = self.running_instances()
        for index in running[count:]:
            # SIGTERM drains: the instance hands its requests back with their tokens, then leaves.
            service = self.rollouts[index]
            service.retiring = True
            if service.child.process.poll() is None:
                service.child.process.send_signal(signal.SIGTERM)
        free = (i for i in range(self.plan.instance_cap) if i not in self.rollouts)
        for _ in range(count - len(running)):
            index = next(free)
            self.rollouts[index] = self._supervise(f"rollout-{index}", lambda index=index: self._spawn_rollout(index))
        self.write_state()

    def _read_scale_request(self, events: MeshEvents) -> None:
        path = self.plan.output_dir / SCALE_FILE
        try:
            modified = path.stat().st_mtime
        except FileNotFoundError:
            return
        if modified <= self._scale_seen:
            return
        self._scale_seen = modified
        try:
            wanted = int(json.loads(path.read_text())["rollout_instances"])
        except (ValueError, KeyError, TypeError) as exc:
            events.lines.append(f"ignored {path}: {exc}")
            return
        self._scale_to(wanted, events, "rlmesh scale")

    async def _autoscale(self, now: float, manager: manager_pb2_grpc.ManagerServiceStub, events: MeshEvents) -> None:
        if self.autoscaler is None or now < self._autoscale_at:
            return
        self._autoscale_at = now + AUTOSCALE_POLL_SECONDS
        try:
            status = await manager.GetStatus(manager_pb2.GetStatusRequest(), **call_options(2.0))
        except grpc.aio.AioRpcError:
            return
        recommended = status.stage_balance.recommended_rollout_instances
        new = self.autoscaler.observe(now, recommended, self.target_instances)
        if new is not None:
            self._scale_to(new, events, f"autoscale: the manager recommends {recommended}")

    async def supervise(self, manager: manager_pb2_grpc.ManagerServiceStub) -> MeshEvents:
        """One tick: restart what exited, apply scale requests and the autoscaler."""
        events = MeshEvents()
        now = time.monotonic()
        self._read_scale_request(events)
        await self._autoscale(now, manager, events)
        for index, service in list(self.rollouts.items()):
            if service.child.process.poll() is None:
                continue
            if service.retiring:
                self.children.remove(service.child)
                del self.rollouts[index]
                events.lines.append(f"{service.name} left (drained)")
                self.write_state()
            else:
                self._restart_due(service, now, events)
        for service in (self.manager, self.weights):
            if service is not None and service.child.process.poll() is not None:
                self._restart_due(service, now, events)
        return events

    def stop(self) -> None:
        """Trainer first, manager last."""
        stop_children(self.children)
        (self.plan.output_dir / STATE_FILE).unlink(missing_ok=True)


def describe_exit(code: int | None) -> str:
    return f"exited (killed by signal {-code})" if code is not None and code < 0 else f"exited (exit code {code})"


async def follow_training(mesh: Mesh, trainer: Child, stop: asyncio.Event) -> int:
    """Shows a progress bar until the trainer exits; returns its exit code (130 if interrupted). A
    trainer killed by a signal (the OOM killer, a lost machine, an operator) is started again, up
    to TRAINER_RESTARTS times: it resumes from its latest checkpoint, and its ledger shows every
    accepted prompt trained once."""
    channel = open_channel(trainer.address)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    manager_channel = open_channel(mesh.plan.manager_address)
    manager = manager_pb2_grpc.ManagerServiceStub(manager_channel)
    interactive = sys.stderr.isatty()
    bar = tqdm(total=mesh.plan.steps, unit="step", desc="training", dynamic_ncols=True, disable=not interactive)
    reported = 0
    try:
        while True:
            if stop.is_set():
                return 130
            code = trainer.process.poll()
            if code is not None:
                if code >= 0 or mesh.trainer_restarts >= TRAINER_RESTARTS:
                    break
                mesh.trainer_restarts += 1
                tqdm.write(f"trainer {describe_exit(code)}; starting it again (restart {mesh.trainer_restarts}): "
                           f"it resumes from its latest checkpoint", file=sys.stderr)
                trainer = await mesh.start_trainer()
                tqdm.write(f"trainer restarted (pid {trainer.process.pid})", file=sys.stderr)
                continue
            events = await mesh.supervise(manager)
            for line in events.lines:
                # Through tqdm, so a redrawn progress bar does not overwrite the line.
                tqdm.write(line, file=sys.stderr)
            try:
                status = await stub.GetTrainingStatus(trainer_pb2.GetTrainingStatusRequest(), **call_options(2.0))
                shown = {"reward": "reward", "eval/sampled_reward": "held-out", "eval/exact_match": "exact"}
                figures = {label: f"{status.metrics[key]:.3f}" for key, label in shown.items() if key in status.metrics}
                bar.update(status.step - bar.n)
                bar.set_postfix(figures)
                # Without a terminal, a line per tenth of the run instead of a redrawn bar.
                if not interactive and status.step >= reported + max(1, mesh.plan.steps // 10):
                    reported = status.step
                    print(f"step {status.step}/{mesh.plan.steps} " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
        bar.update(mesh.plan.steps - bar.n if trainer.process.returncode == 0 else 0)
        return trainer.process.returncode
    finally:
        bar.close()
        await channel.close()
        await manager_channel.close()


def print_summary(plan: MeshPlan, elapsed: float) -> None:
    summary_path = plan.output_dir / "summary.json"
    if not summary_path.exists():
        return
    summary = json.loads(summary_path.read_text())
    start, end = summary["start"], summary["end"]

    def figure(values: dict, key: str) -> str:
        # A validation no instance could serve is skipped: its figures are missing.
        return f"{values[key]:.3f}" if key in values else "n/a"

    print(
        f"\ntrained {summary['steps']} steps in {elapsed:.0f} s (weight version {summary['weight_version']})\n"
        f"held-out sampled reward {figure(start, 'eval/sampled_reward')} -> {figure(end, 'eval/sampled_reward')}, "
        f"greedy exact match {figure(start, 'eval/exact_match')} -> {figure(end, 'eval/exact_match')}\n"
        f"metrics:     {summary['metrics']}\n"
        f"tensorboard: {summary['tensorboard']}\n"
        f"plot:        {summary['plot']}\n"
        f"checkpoint:  {summary['checkpoint']}\n"
        f"logs:        {plan.output_dir / 'logs'}"
    )


async def run_mesh(plan: MeshPlan) -> int:
    # The launcher's own calls (health checks, progress, autoscaling) present the `client` certificate.
    use_tls(plan.tls_files("client"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    mesh = Mesh(plan)
    started = time.perf_counter()
    try:
        if plan.netns is not None:
            swept = sweep_netns()
            if swept:
                print(f"removed what killed meshes left: {', '.join(swept)}", file=sys.stderr)
            create_netns(plan.netns)
        starting = asyncio.create_task(mesh.start_services())
        interrupted = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        starting.result()
        interrupted.cancel()
        print(f"mesh up: manager {plan.manager_address}, weights {plan.weights_address}, "
              f"rollout {', '.join(plan.rollout_address(i) for i in range(plan.rollout_instances))}"
              + (f" (up to {plan.instance_cap}{', autoscaled' if plan.autoscale else ''})" if plan.instance_cap > plan.rollout_instances else "")
              + ", "
              f"trainer {plan.trainer_address}"
              + (f" ({plan.trainer_ranks} FSDP ranks)" if plan.trainer_ranks > 1 else "") + f"; logs in {mesh.log_dir}"
              + (f"; mutual TLS with the certificates in {plan.tls_dir}" if plan.tls_dir is not None else "")
              + ("; rollout instances register with a token" if plan.registration_token else "")
              + ("; in their own network namespaces: " + ", ".join(f"rollout-{i} ({link.namespace})" for i, link in enumerate(plan.netns.links))
                 if plan.netns is not None else ""))
        trainer = await mesh.start_trainer()
        code = await follow_training(mesh, trainer, stop)
        if code == 0:
            print_summary(plan, time.perf_counter() - started)
        elif code != 130:
            reason = plan.output_dir / "error.txt"
            why = f": {reason.read_text().strip()}" if reason.is_file() else ""
            print(f"training failed (exit {code}){why}\nsee {trainer.log_path}\n"
                  f"the run resumes from its last checkpoint when started again with --output-dir {plan.output_dir}",
                  file=sys.stderr)
        return code
    except (RuntimeError, TimeoutError) as exc:
        print(f"rlmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        await asyncio.to_thread(mesh.stop)
        if plan.netns is not None:
            remove_netns(plan.netns)


def find_running_mesh(runs: Path) -> Path | None:
    """The newest output folder under `runs` whose `rlmesh up` is still alive."""
    candidates = sorted(runs.glob(f"*/{STATE_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for state in candidates:
        try:
            os.kill(json.loads(state.read_text())["pid"], 0)
        except (ProcessLookupError, KeyError, ValueError, PermissionError):
            continue
        return state.parent
    return None


def mesh_processes(output_dir: Path, module: str | None = None) -> list[int]:
    """Pids of live processes started for the mesh writing to `output_dir` (only those running
    `python -m module` when given), found by the MESH_ID_ENV each one carries."""
    marker = f"{MESH_ID_ENV}={output_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if module is not None and f"-m\0{module}\0".encode() not in (entry / "cmdline").read_bytes():
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found
