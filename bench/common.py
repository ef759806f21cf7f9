"""What the benchmarks share: a manager and synthetic rollout instances as real processes on
loopback, one rollout step driven the way the trainer drives it, what else the (shared) machine
runs meanwhile, and result files."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, spawn_service, stop_children, wait_started
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.authz import Role
from rlmesh.rpc.channels import call_options, open_channel, use_secret
from rlmesh.rpc.credentials import create_secrets, peer_secrets, service_auth_settings

QUIET_CORES = 0.25
"""Before each run a bench waits until other processes use less CPU than this, QUIET_WAIT_SECONDS
at most over the whole bench (each run reports what they used during it)."""
QUIET_WAIT_SECONDS = 300

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
"""Where a benchmark's plot goes when a docs page shows it."""


@dataclass(frozen=True, slots=True)
class BenchAuth:
    """Authorization of a benchmark's services: a bearer secret per role made in `folder`, as
    `rlmesh up` does, or none when `insecure` (to measure what authorization costs)."""

    folder: Path
    insecure: bool = False

    def __post_init__(self) -> None:
        if not self.insecure:
            create_secrets(self.folder)

    def settings(self, prefix: str, role: Role) -> dict[str, str]:
        """A service's environment settings (prefix RLMESH_NAME_) to serve and call as `role`."""
        if self.insecure:
            return {f"{prefix}SERVER__AUTH__INSECURE": "true"}
        return service_auth_settings(prefix, self.folder, role)

    def use(self) -> None:
        """This process calls every service as the peer that calls it would."""
        use_secret("" if self.insecure else peer_secrets(self.folder))


@dataclass
class InstanceSpec:
    instance_id: str
    speed: float = 1.0
    settings: dict[str, str] = field(default_factory=dict)
    """Further rollout settings by environment name without the prefix (ENGINE__MAX_BATCH_SIZE)."""


@dataclass
class StepResult:
    seconds: float
    groups: list[manager_pb2.Group]

    @property
    def samples(self) -> list[manager_pb2.Sample]:
        return [s for g in self.groups for s in g.samples]

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


def spawn_manager(address: str, auth: BenchAuth, log_dir: Path, settings: dict[str, str] | None = None) -> Child:
    """A manager process on `address`, logging to `log_dir`; `settings` by environment name without
    the prefix (DISPATCH_POLICY)."""
    return spawn_service(
        "manager",
        "services.manager",
        address,
        {
            "RLMESH_MANAGER_SERVER__HOST": "127.0.0.1",
            "RLMESH_MANAGER_SERVER__PORT": address.rsplit(":", 1)[1],
            "RLMESH_MANAGER_SERVER__LOG_LEVEL": "warning",
            **auth.settings("RLMESH_MANAGER_", "manager"),
            **{f"RLMESH_MANAGER_{k}": v for k, v in (settings or {}).items()},
        },
        log_dir,
        str(log_dir),
    )


class BenchMesh:
    """A manager process and synthetic rollout processes; logs go to a temporary folder."""

    def __init__(
        self, instances: list[InstanceSpec], manager_settings: dict[str, str] | None = None, insecure: bool = False
    ) -> None:
        self.instances = instances
        self.manager_settings = manager_settings or {}
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlmesh-bench-"))
        self.auth = BenchAuth(self.log_dir / "secrets", insecure)
        self.children: list[Child] = []
        self.manager_address = f"127.0.0.1:{free_port()}"
        self.instance_addresses: dict[str, str] = {}
        self._channel = None
        self.manager: manager_pb2_grpc.ManagerServiceStub | None = None

    def spawn_instance(self, spec: InstanceSpec) -> Child:
        port = free_port()
        settings = {
            "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
            "RLMESH_ROLLOUT_SERVER__PORT": str(port),
            "RLMESH_ROLLOUT_INSTANCE_ID": spec.instance_id,
            "RLMESH_ROLLOUT_MANAGER_ADDRESS": self.manager_address,
            "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
            "RLMESH_ROLLOUT_ENGINE__KIND": "synthetic",
            "RLMESH_ROLLOUT_ENGINE__SYNTHETIC__SPEED": str(spec.speed),
            "RLMESH_ROLLOUT_SERVER__LOG_LEVEL": "warning",
            **self.auth.settings("RLMESH_ROLLOUT_", "instance"),
            **{f"RLMESH_ROLLOUT_{k}": v for k, v in spec.settings.items()},
        }
        child = spawn_service(
            spec.instance_id, "services.rollout", f"127.0.0.1:{port}", settings, self.log_dir, str(self.log_dir)
        )
        self.children.append(child)
        self.instance_addresses[spec.instance_id] = child.address
        return child

    async def __aenter__(self) -> BenchMesh:
        manager = spawn_manager(self.manager_address, self.auth, self.log_dir, self.manager_settings)
        self.children.append(manager)
        self.auth.use()
        await wait_started([manager])
        await wait_started([self.spawn_instance(spec) for spec in self.instances])
        self._channel = open_channel(self.manager_address)
        self.manager = manager_pb2_grpc.ManagerServiceStub(self._channel)
        await self.wait_for_instances(len(self.instances))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(stop_children, self.children)

    async def status(self) -> manager_pb2.GetStatusResponse:
        return await self.manager.GetStatus(manager_pb2.GetStatusRequest(), **call_options(10))

    async def wait_for_instances(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len((await self.status()).instances) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} instances did not register within {timeout:.0f} s; logs in {self.log_dir}")
            await asyncio.sleep(0.1)

    async def run_step(
        self,
        batch_id: str,
        prompts: int,
        group_size: int,
        sampling: common_pb2.SamplingParams,
        micro_batch_groups: int = 8,
    ) -> StepResult:
        """Submits a batch and streams it back as the trainer does; the step's time runs from the
        submission to the last micro-batch received."""
        request = manager_pb2.SubmitPromptsRequest(
            batch_id=batch_id,
            policy_version=0,
            sampling=sampling,
            prompts=[
                manager_pb2.Prompt(prompt_id=f"p{i}", token_ids=[1, 2, 3, 4, 5, i % 7 + 1], n=group_size)
                for i in range(prompts)
            ],
        )
        started = time.perf_counter()
        await self.manager.SubmitPrompts(request, **call_options(30))
        groups: list[manager_pb2.Group] = []
        stream = self.manager.StreamRollouts(
            manager_pb2.StreamRolloutsRequest(batch_id=batch_id, micro_batch_groups=micro_batch_groups),
            **call_options(600),
        )
        async for reply in stream:
            groups += reply.groups
        elapsed = time.perf_counter() - started
        await self.manager.AcknowledgeRollouts(
            manager_pb2.AcknowledgeRolloutsRequest(batch_id=batch_id), **call_options(30)
        )
        return StepResult(elapsed, groups)


def busy_cpu_seconds() -> float:
    """CPU time all processes of the machine used since boot (/proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and of its children that have exited (the services it started)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherProcesses:
    """Cores that processes other than the bench's used meanwhile: the machine may be shared, and a
    rate measured while something else ran is not comparable with one measured alone."""

    def __enter__(self) -> Self:
        self.started, self.busy, self.own = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        others = (busy_cpu_seconds() - self.busy) - (own_cpu_seconds() - self.own)
        self.cores = max(0.0, others) / (time.monotonic() - self.started)


class QuietMachine:
    """Waits until other processes use less than QUIET_CORES over a second, within a budget of
    QUIET_WAIT_SECONDS for the whole bench."""

    def __init__(self) -> None:
        self.budget = QUIET_WAIT_SECONDS

    async def wait(self) -> None:
        while self.budget > 0:
            started = time.monotonic()
            with OtherProcesses() as others:
                await asyncio.sleep(1.0)
            if others.cores < QUIET_CORES:
                return
            print(f"  (other processes use {others.cores:.2f} cores: waiting)", flush=True)
            await asyncio.sleep(2.0)
            self.budget -= time.monotonic() - started


def check_exactly_once(result: StepResult, prompts: int, group_size: int) -> tuple[int, int]:
    """(samples lost, samples duplicated) of a step, from what reached the trainer."""
    seen: dict[str, int] = {}
    for group in result.groups:
        seen[group.prompt_id] = seen.get(group.prompt_id, 0) + len(group.samples)
    expected = {f"p{i}": group_size for i in range(prompts)}
    lost = sum(max(0, n - seen.get(p, 0)) for p, n in expected.items())
    duplicated = sum(max(0, seen.get(p, 0) - expected.get(p, 0)) for p in seen)
    return lost, duplicated


def write_result(name: str, figures: dict, baseline: dict, ratios: dict, targets: dict, settings: dict) -> dict:
    """Prints the figures with their same-run baseline and writes bench/results/<name>.json."""
    result = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "figures": figures,
        "baseline": baseline,
        "ratios": ratios,
        "targets": targets,
        "settings": settings,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n== {name} ==")
    for title, values in (
        ("figures", figures),
        ("baseline (same run)", baseline),
        ("ratios", ratios),
        ("targets", targets),
    ):
        print(f"{title}:")
        for key, value in values.items():
            print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return result
