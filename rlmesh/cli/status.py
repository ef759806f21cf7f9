"""`rlmesh status`: a live terminal view of a running mesh, read from the services' status RPCs
(manager, weights, trainer): instances, queue, staleness, pushes, the trainer's progress."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, open_channel
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc

RPC_TIMEOUT_SECONDS = 2.0
"""Deadline of each status call of the live view, which asks again at its next refresh."""
ONCE_RPC_TIMEOUT_SECONDS = 10.0
"""Deadline of each status call of `--once`: there is no next refresh, the calls include connecting,
and the weights service, at background CPU priority, answers late on a busy host."""


@dataclass(frozen=True, slots=True)
class MeshAddresses:
    manager: str
    weights: str | None = None
    trainer: str | None = None

    @classmethod
    def of_run(cls, run: Path) -> MeshAddresses:
        """From the mesh.json `rlmesh up` keeps in its output folder."""
        from rlmesh.launch.state import STATE_FILE

        state = json.loads((run / STATE_FILE).read_text())
        services = {s["name"]: s["address"] for s in state.get("services", [])}
        return cls(state["manager"], services.get("weights"), state.get("trainer", {}).get("address"))


@dataclass(slots=True)
class Snapshot:
    """One reading of the mesh; a service that did not answer has None and the reason."""

    manager: manager_pb2.GetStatusResponse | None
    weights: weights_pb2.GetStatusResponse | None
    trainer: trainer_pb2.GetTrainingStatusResponse | None
    errors: dict[str, str]

    @property
    def reachable(self) -> bool:
        return any(s is not None for s in (self.manager, self.weights, self.trainer))


class MeshReader:
    """The services' status RPCs, over channels opened once and kept while the view runs."""

    def __init__(self, addresses: MeshAddresses, rpc_timeout: float = RPC_TIMEOUT_SECONDS) -> None:
        self.addresses = addresses
        self.rpc_timeout = rpc_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __aenter__(self) -> MeshReader:
        named = {
            "manager": self.addresses.manager,
            "weights": self.addresses.weights,
            "trainer": self.addresses.trainer,
        }
        self._channels = {name: open_channel(address) for name, address in named.items() if address is not None}
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))

    async def read(self) -> Snapshot:
        errors: dict[str, str] = {}

        async def call(name: str, stub_class, method: str, request):
            channel = self._channels.get(name)
            if channel is None:
                return None
            try:
                return await getattr(stub_class(channel), method)(request, **call_options(self.rpc_timeout))
            except grpc.aio.AioRpcError as exc:
                errors[name] = f"{getattr(self.addresses, name)}: {exc.code().name} {exc.details() or ''}".strip()
                return None

        manager, weights, trainer = await asyncio.gather(
            call("manager", manager_pb2_grpc.ManagerServiceStub, "GetStatus", manager_pb2.GetStatusRequest()),
            call("weights", weights_pb2_grpc.WeightsServiceStub, "GetStatus", weights_pb2.GetStatusRequest()),
            call(
                "trainer",
                trainer_pb2_grpc.TrainerServiceStub,
                "GetTrainingStatus",
                trainer_pb2.GetTrainingStatusRequest(),
            ),
        )
        return Snapshot(manager, weights, trainer, errors)


async def read_once(addresses: MeshAddresses) -> Snapshot:
    async with MeshReader(addresses, ONCE_RPC_TIMEOUT_SECONDS) as reader:
        return await reader.read()


def _figure(metrics, name: str, digits: int = 3) -> str:
    return f"{metrics[name]:.{digits}f}" if name in metrics else "-"


def authorization_text(authorization: str) -> Text:
    """How the manager authorizes callers; "off" (--insecure) stands out."""
    if authorization == "off":
        return Text("INSECURE: authorization off", style="bold red")
    return Text(f"authorization: {authorization or 'unknown'}")


def render(snapshot: Snapshot) -> Group:
    """The view of one snapshot: the trainer's line, the manager's line, the instances' table."""
    parts: list = []
    trainer = snapshot.trainer
    if trainer is not None:
        m = trainer.metrics
        phase = trainer_pb2.Phase.Name(trainer.phase).removeprefix("PHASE_").lower()
        parts.append(
            Text.assemble(
                ("trainer ", "bold"),
                f"step {trainer.step}/{trainer.total_steps}  {phase}  version {trainer.weight_version}  ",
                f"reward {_figure(m, 'reward')}  kl {_figure(m, 'kl', 4)}  step {_figure(m, 'step_seconds')} s  ",
                f"waited {_figure(m, 'rollout_wait_seconds')} s  staleness {_figure(m, 'staleness_mean', 2)} "
                f"(max {_figure(m, 'staleness_max', 0)})",
            )
        )
        if trainer.error:
            parts.append(Text(f"trainer error: {trainer.error}", style="red"))
    manager = snapshot.manager
    if manager is not None:
        parts.append(
            Text.assemble(
                ("manager ", "bold"),
                f"published {manager.published_version}  η {manager.max_staleness}  ",
                f"queued {manager.queued_samples}  running {manager.running_samples}  ready groups "
                f"{manager.ready_groups}  ",
                f"{manager.tokens_per_second:.0f} tok/s  migrated {manager.migrated_samples}  "
                f"continued tokens {manager.continued_tokens}  requeued {manager.requeued_samples}  ",
                authorization_text(manager.authorization),
            )
        )
    pushes = {p.instance_id: p for p in snapshot.weights.instances} if snapshot.weights is not None else {}
    if snapshot.weights is not None:
        parts.append(
            Text.assemble(
                ("weights ", "bold"),
                f"latest version {snapshot.weights.latest_version}  "
                f"{snapshot.weights.latest_bytes / 1e6:.1f} MB  backend {snapshot.weights.backend}",
            )
        )
    table = Table(
        "instance",
        "version",
        "running",
        "tok/s",
        "tokens",
        "state",
        "push ms",
        "GB/s",
        "stored→served ms",
        title="rollout instances",
        title_justify="left",
    )
    for instance in manager.instances if manager is not None else ():
        push = pushes.get(instance.instance_id)
        if instance.quarantine_remaining_seconds:
            state = f"quarantined {instance.quarantine_remaining_seconds:.0f} s ({instance.quarantines}x)"
        else:
            state = "draining" if instance.draining else ("ready" if instance.schedulable else "loading")
        if instance.preemptible:
            state += ", spot"
        running = str(instance.running_requests)
        if instance.saturation_batch_size:
            running += f" (knee {instance.saturation_batch_size})"
        table.add_row(
            instance.instance_id,
            str(instance.weight_version),
            running,
            f"{instance.tokens_per_second:.0f}",
            str(instance.generated_tokens),
            state,
            f"{push.last_push_ms:.1f}" if push else "-",
            f"{push.last_push_gbps:.2f}" if push else "-",
            f"{push.last_version_latency_ms:.1f}" if push else "-",
        )
    parts.append(table)
    for name, error in sorted(snapshot.errors.items()):
        parts.append(Text(f"{name} unreachable: {error}", style="yellow"))
    return Group(*parts)


@contextmanager
def _keys_unbuffered() -> Iterator[bool]:
    """stdin in cbreak mode (a key press arrives alone, unechoed) while the view runs; yields
    whether keys can be read at all (stdin is a terminal)."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def watch(addresses: MeshAddresses, interval: float, console: Console) -> None:
    """Refreshes the view in place every `interval` seconds until `q` (or Ctrl-C)."""
    quit_pressed = asyncio.Event()
    loop = asyncio.get_running_loop()
    with _keys_unbuffered() as keys:
        if keys:

            def on_key() -> None:
                if os.read(sys.stdin.fileno(), 1) in (b"q", b"Q"):
                    quit_pressed.set()

            loop.add_reader(sys.stdin.fileno(), on_key)
        try:
            async with MeshReader(addresses) as reader:
                with Live(console=console, auto_refresh=False, screen=False) as live:
                    while not quit_pressed.is_set():
                        snapshot = await reader.read()
                        footer = Text("q or Ctrl-C to quit", style="dim")
                        live.update(Group(render(snapshot), footer), refresh=True)
                        try:
                            await asyncio.wait_for(quit_pressed.wait(), interval)
                        except TimeoutError:
                            pass
        finally:
            if keys:
                loop.remove_reader(sys.stdin.fileno())
