"""Network namespaces for rollout instances: their names and addresses, creating and removing
them with their veth pairs, entering one, and sweeping away what a killed `rlmesh up` left."""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rlmesh.lifecycle import CAP_NET_ADMIN, CAP_SYS_ADMIN, effective_capabilities

NETNS_PREFIX = "rlmesh-"
"""Network namespaces of rollout instances are named rlmesh-<mesh tag>-<launcher pid>-<index>."""
NETNS_DIR = Path("/var/run/netns")
"""Where `ip netns add` pins each named namespace (a file to open and enter)."""
CLONE_NEWNET = 0x40000000


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
    missing = [
        name
        for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not effective >> bit & 1
    ]
    if missing:
        return f"it needs {' and '.join(missing)} to create network namespaces and veth pairs (run as root)"
    try:
        _ip("netns", "list")
    except RuntimeError as exc:
        return str(exc)
    return ""


def enter_netns(namespace: str) -> None:
    """Moves this process into the named network namespace, as `ip netns exec` does for the command
    it runs: sockets it opens afterwards live there. The process must have one thread (setns(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(NETNS_DIR / namespace, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(descriptor, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter network namespace {namespace}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


def mesh_tag(output_dir: Path) -> str:
    """Six hex digits naming a mesh (its output folder) in interface and namespace names."""
    return hashlib.sha1(str(output_dir).encode()).hexdigest()[:6]


def plan_netns(output_dir: Path, count: int) -> NetnsLayout:
    """Names and addresses for `count` namespaces: a /24 between 10.200.0.0 and 10.249.255.0,
    picked from the mesh's tag among those no address on the host falls in, a /30 per instance."""
    tag = mesh_tag(output_dir)
    in_use = [
        ipaddress.ip_interface(cidr).network for cidr in re.findall(r"\binet (\S+)", _ip("-o", "-4", "addr", "show"))
    ]
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
    links = tuple(
        NetnsLink(
            f"{NETNS_PREFIX}{tag}-{os.getpid()}-{index}",
            f"rlm{tag}h{index}",
            f"rlm{tag}n{index}",
            str(base + 4 * index + 1),
            str(base + 4 * index + 2),
        )
        for index in range(count)
    )
    return NetnsLayout(tag, str(base + 254), links)


def create_netns(layout: NetnsLayout) -> None:
    for link in layout.links:
        _ip("netns", "add", link.namespace)
        _ip(
            "link",
            "add",
            link.host_device,
            "type",
            "veth",
            "peer",
            "name",
            link.namespace_device,
            "netns",
            link.namespace,
        )
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
        tag, pid = name[len(NETNS_PREFIX) :].split("-")[:2]
        if _launcher_alive(int(pid)):
            live_tags.add(tag)
            continue
        _ip("netns", "delete", name)
        removed.append(name)
    for address, label, tag in re.findall(
        r"\binet (\S+) .*\b(lo:rlm([0-9a-f]{6}))\b", _ip("-o", "-4", "addr", "show", "dev", "lo")
    ):
        if tag not in live_tags:
            _ip("addr", "del", address, "dev", "lo")
            removed.append(f"{label} {address}")
    return removed
