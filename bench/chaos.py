"""The chaos suite (`make chaos`): a real training run of the tiny model under `rlmesh up` while
random faults hit it (SIGKILL, SIGTERM or a long SIGSTOP of a rollout instance, SIGKILL of the
weights service mid-push, of the manager or of a relay shard, a cut of a rollout instance's network
link). Training
must finish with every accepted prompt trained exactly once; faults survived and the time each kind
cost go to bench/results/chaos.json."""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.common import write_result
from rlmesh.launch.netns import netns_problem
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, mesh_processes, spawn_service, stop_children
from rlmesh.launch.state import STATE_FILE, run_secret
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import AUTHORIZATION_KEY, channel_options
from rlmesh.rpc.credentials import read_secret, service_auth_settings
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
FAULT_WEIGHTS = {
    "kill_rollout": 3,
    "term_rollout": 2,
    "stop_rollout": 1,
    "kill_weights_mid_push": 2,
    "kill_manager": 1,
    "kill_relay": 1,
    "cut_network": 1,
    "broken_engine": 1,
}
"""How often each kind of fault is drawn, relatively (every kind at least once when there are enough faults)."""
RECOVERY_WINDOW_SECONDS = {
    "kill_rollout": 10.0,
    "term_rollout": 10.0,
    "kill_weights_mid_push": 10.0,
    "kill_manager": 15.0,
    "kill_relay": 10.0,
    "broken_engine": 10.0,
}
"""Steps ending this long after a fault (after a manager's restart wait) count toward its cost (a
stop or a cut counts its own length + 5 s)."""
SHORT_CUT_SECONDS = 4.0
"""A cut the lease outlasts (heartbeats retry, the instance keeps its work). Cuts alternate between
long and short, the first long: a long cut lasts as long as a stop, so the lease expires and the
instance's samples continue elsewhere."""
MANAGER_RECOVERY_STEPS = 2
"""Steps trained after a manager kill before the next one: the first may use rollouts delivered
before the kill, the second needs the restarted manager."""
REJOIN_TIMEOUT_SECONDS = 90.0
QUARANTINE_TIMEOUT_SECONDS = 60.0
"""How long a broken instance may take to be quarantined once it joined the pool."""
BROKEN_ENGINE = {
    "ENGINE__KIND": "synthetic",
    "ENGINE__SYNTHETIC__FAIL_AFTER_REQUESTS": "0",
    "ENGINE__SYNTHETIC__VOCAB_SIZE": str(1 << 24),
    "TRANSFER__MOONCAKE": "false",
    "SERVER__LOG_LEVEL": "warning",
}
"""A rollout instance whose every request fails at once (INTERNAL) while its server stays up, as
one whose engine core died under it; its vocabulary takes any prompt, so the failure is the engine's."""
"""How long an instance whose link came back may take to be in the manager's pool again."""
WARMUP_STEPS = 3
TAIL_STEPS = 10
"""Steps trained after the last fault, before the run's end."""


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    """time.time() when it was applied."""
    mid_push: bool = False
    seconds_lost: float = 0.0
    lasted: float = 0.0
    """A stop's or a cut's length; for a manager kill, the wait before the launcher restarted it."""
    rejoined_after: float | None = None
    """A cut: seconds from the link's return until the instance was in the manager's pool again (None: never)."""
    outlasted_run: bool = False
    """A cut that training ended during: the link came back with the mesh already stopping."""
    quarantined_after: float | None = None
    """A broken engine: seconds from its instance joining the pool until the manager quarantined it (None: never)."""


def mesh_state(output_dir: Path) -> dict:
    try:
        return json.loads((output_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def rollouts(output_dir: Path) -> dict[str, int]:
    state = mesh_state(output_dir)
    return {r["name"]: r["pid"] for r in state["rollout_instances"]["running"]} if state else {}


def rollout_links(output_dir: Path) -> dict[str, str]:
    """The host-side veth of each rollout instance that runs in its own network namespace."""
    state = mesh_state(output_dir)
    return {r["name"]: r["link"] for r in state["rollout_instances"]["running"] if "link" in r} if state else {}


def draw_faults(count: int, kinds: dict[str, int], rng: random.Random) -> list[str]:
    """`count` fault kinds drawn by weight, every kind at least once when `count` allows, in random order."""
    drawn = list(kinds) if count >= len(kinds) else []
    drawn += rng.choices(list(kinds), list(kinds.values()), k=count - len(drawn))
    rng.shuffle(drawn)
    return drawn


def trained_steps(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if '"reward"' in line), default=0)


class Injector:
    """Applies faults to the mesh of one output folder; SIGSTOPped processes are continued on time."""

    def __init__(self, output_dir: Path, weights_address: str, stop_seconds: float, rng: random.Random) -> None:
        self.output_dir = output_dir
        # Plain (blocking) channels: the injector runs on the suite's own threads, not an event loop.
        self.weights = weights_pb2_grpc.WeightsServiceStub(
            grpc.insecure_channel(weights_address, options=channel_options())
        )
        self._manager: manager_pb2_grpc.ManagerServiceStub | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self.stop_seconds = stop_seconds
        self.rng = rng
        self.stopped: dict[int, threading.Timer] = {}
        self.cut: dict[str, tuple[threading.Timer, Fault]] = {}
        """Host-side veth devices cut and not yet seen back in the pool, with the timers that bring
        them up and their faults: a device is cut again only once its instance rejoined."""
        self.cuts_made = 0
        self._reconnections: list[threading.Timer] = []
        self._manager_killed_at_step = -MANAGER_RECOVERY_STEPS
        self._run_ended = threading.Event()
        self.broken: list[Child] = []
        """Broken instances joined to the mesh, stopped when the run ends."""
        self._watchers: list[threading.Thread] = []

    @property
    def manager(self) -> manager_pb2_grpc.ManagerServiceStub:
        """Known once `rlmesh up` wrote mesh.json (the manager's address depends on the namespaces)."""
        if self._manager is None:
            address = mesh_state(self.output_dir)["manager"]
            self._manager = manager_pb2_grpc.ManagerServiceStub(
                grpc.insecure_channel(address, options=channel_options())
            )
        return self._manager

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The run's observer secret, which every call here (status only) carries: `rlmesh up` writes
        it before any service serves, so it is read when first needed."""
        if self._metadata is None:
            path = run_secret(self.output_dir, "observer")
            if path is None:
                return ()
            self._metadata = ((AUTHORIZATION_KEY, f"Bearer {read_secret(path)}"),)
        return self._metadata

    def _pushing(self) -> bool:
        try:
            status = self.weights.GetStatus(weights_pb2.GetStatusRequest(), timeout=1.0, metadata=self.metadata)
        except grpc.RpcError:
            return False
        return any(i.pushing_version > 0 for i in status.instances)

    def _continue(self, pid: int) -> None:
        self.stopped.pop(pid, None)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _manager_serves(self) -> bool:
        try:
            self.manager.GetStatus(manager_pb2.GetStatusRequest(), timeout=1.0, metadata=self.metadata)
        except grpc.RpcError:
            return False
        return True

    def _in_pool(self, name: str) -> bool:
        try:
            reply = self.manager.ListInstances(manager_pb2.ListInstancesRequest(), timeout=2.0, metadata=self.metadata)
        except grpc.RpcError:
            return False
        return any(i.instance_id == name and not i.draining for i in reply.instances)

    def _reconnect(self, device: str, name: str, fault: Fault) -> None:
        """Brings the link up, then times the instance's return to the pool."""
        # Unchecked: after the run the launcher has deleted the device, and a link that stays down shows as no rejoin.
        subprocess.run(["ip", "link", "set", device, "up"], check=False)
        back = time.monotonic()
        while time.monotonic() - back < REJOIN_TIMEOUT_SECONDS:
            if self._run_ended.is_set():
                fault.outlasted_run = True
                break
            if self._in_pool(name):
                fault.rejoined_after = time.monotonic() - back
                break
            time.sleep(0.2)
        self.cut.pop(device, None)

    def _cut_network(self) -> Fault | None:
        links = {name: device for name, device in rollout_links(self.output_dir).items() if device not in self.cut}
        if not links:
            return None
        name = self.rng.choice(sorted(links))
        device = links[name]
        fault = Fault(
            "cut_network", name, time.time(), lasted=SHORT_CUT_SECONDS if self.cuts_made % 2 else self.stop_seconds
        )
        self.cuts_made += 1
        subprocess.run(["ip", "link", "set", device, "down"], check=True)
        timer = threading.Timer(fault.lasted, self._reconnect, (device, name, fault))
        self.cut[device] = (timer, fault)
        self._reconnections.append(timer)
        timer.start()
        return fault

    def _broken_engine(self) -> Fault | None:
        """Joins an instance with a broken engine to the pool, with the run's instance secret, and
        watches (on a thread) how long the manager takes to quarantine it."""
        state, secret = mesh_state(self.output_dir), run_secret(self.output_dir, "instance")
        if not state or secret is None:
            return None
        name = f"broken-{len(self.broken)}"
        address = f"127.0.0.1:{free_port()}"
        # The run's model: the instance takes the weights pushed to it, so it serves the version asked for.
        model_dir = json.loads((self.output_dir / "trainer.json").read_text())["model_dir"]
        settings = {
            "SERVER__HOST": "127.0.0.1",
            "SERVER__PORT": address.rsplit(":", 1)[1],
            "INSTANCE_ID": name,
            "MANAGER_ADDRESS": state["manager"],
            "ENGINE__MODEL_DIR": model_dir,
            **BROKEN_ENGINE,
            **service_auth_settings("", secret.parent, "instance"),
        }
        child = spawn_service(
            name,
            "services.rollout",
            address,
            {f"RLMESH_ROLLOUT_{k}": v for k, v in settings.items()},
            self.output_dir / "logs",
            f"{self.output_dir}-chaos",
        )
        self.broken.append(child)
        fault = Fault("broken_engine", name, time.time())
        watcher = threading.Thread(target=self._watch_quarantine, args=(fault,), daemon=True)
        self._watchers.append(watcher)
        watcher.start()
        return fault

    def _watch_quarantine(self, fault: Fault) -> None:
        joined = None
        deadline = time.monotonic() + QUARANTINE_TIMEOUT_SECONDS + 60.0
        while not self._run_ended.is_set() and time.monotonic() < deadline:
            try:
                reply = self.manager.ListInstances(
                    manager_pb2.ListInstancesRequest(), timeout=2.0, metadata=self.metadata
                )
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            instance = next((i for i in reply.instances if i.instance_id == fault.target), None)
            if instance is not None and joined is None:
                joined = time.monotonic()
            if instance is not None and instance.quarantines > 0:
                fault.quarantined_after = time.monotonic() - joined
                return
            time.sleep(0.2)

    def apply(self, kind: str) -> Fault | None:
        if kind == "cut_network":
            return self._cut_network()
        if kind == "broken_engine":
            return self._broken_engine()
        if kind == "kill_manager":
            # Only a manager that serves a mesh that trains again: killing one still starting from its
            # journal, or again before training recovered, is not a kill mid-run; it only grows the
            # restart backoff until the trainer stops waiting (a suite behind schedule applies faults
            # back to back).
            step = trained_steps(self.output_dir)
            if step < self._manager_killed_at_step + MANAGER_RECOVERY_STEPS:
                return None
            pids = mesh_processes(self.output_dir, "manager")
            if not pids or not self._manager_serves():
                return None
            os.kill(pids[0], signal.SIGKILL)
            self._manager_killed_at_step = step
            return Fault(kind, "manager", time.time())
        if kind == "kill_relay":
            pids = mesh_processes(self.output_dir, "relay")
            if not pids:
                return None
            target = self.rng.choice(sorted(pids))
            os.kill(target, signal.SIGKILL)
            return Fault(kind, "relay", time.time())
        if kind == "kill_weights_mid_push":
            deadline = time.monotonic() + 3.0
            mid_push = False
            while time.monotonic() < deadline and not (mid_push := self._pushing()):
                time.sleep(0.005)
            pids = mesh_processes(self.output_dir, "weights")
            if not pids:
                return None
            os.kill(pids[0], signal.SIGKILL)
            return Fault(kind, "weights", time.time(), mid_push=mid_push)
        candidates = {name: pid for name, pid in rollouts(self.output_dir).items() if pid not in self.stopped}
        if not candidates:
            return None
        name = self.rng.choice(sorted(candidates))
        pid = candidates[name]
        try:
            if kind == "kill_rollout":
                os.kill(pid, signal.SIGKILL)
            elif kind == "term_rollout":
                os.kill(pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGSTOP)
                timer = threading.Timer(self.stop_seconds, self._continue, (pid,))
                self.stopped[pid] = timer
                timer.start()
        except ProcessLookupError:
            return None
        return Fault(kind, name, time.time(), lasted=self.stop_seconds if kind == "stop_rollout" else 0.0)

    def release(self) -> None:
        """Continues what is stopped and brings cut links up (marking the cuts the run outlasted);
        waits for the reconnections under way."""
        self._run_ended.set()
        for pid, timer in list(self.stopped.items()):
            timer.cancel()
            self._continue(pid)
        for device, (timer, fault) in list(self.cut.items()):
            timer.cancel()
            fault.outlasted_run = fault.rejoined_after is None
            subprocess.run(["ip", "link", "set", device, "up"], check=False)
        for timer in self._reconnections:
            timer.join()
        for watcher in self._watchers:
            watcher.join()
        stop_children(self.broken)


def ledger_check(output_dir: Path, steps: int, group_size: int) -> dict[str, int]:
    """Prompts accepted for the trained steps that never came back, came back twice, or came back
    short; for a multi-turn job, also the episodes that did not end `done` (an episode a fault cut
    would end otherwise: every one must survive its instance's or the manager's death)."""
    ledger = [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]
    submitted = {
        (r["batch_id"], p) for r in ledger if r["event"] == "submitted" and r["step"] < steps for p in r["prompts"]
    }
    received = collections.Counter((r["batch_id"], r["prompt_id"]) for r in ledger if r["event"] == "accepted")
    accepted = [r for r in ledger if r["event"] == "accepted"]
    # A multi-turn group's trained samples leave its failed episodes out: its size is its episodes'.
    short = sum(1 for r in accepted if len(r["episodes"] if "episodes" in r else range(r["samples"])) != group_size)
    return {
        "prompts_accepted": len(submitted),
        "samples_lost": sum(group_size for key in submitted if key not in received),
        "samples_duplicated": sum((n - 1) * group_size for n in received.values() if n > 1),
        "groups_short": short,
        "episodes": sum(len(r.get("episodes", [])) for r in accepted),
        "episodes_not_done": sum(status != "done" for r in accepted for status in r.get("episodes", [])),
    }


def note_manager_waits(console: str, faults: list[Fault]) -> None:
    """Sets each manager kill's `lasted` to the wait the launcher announced before restarting it
    (it grows with restarts in a row), so the steps its outage stretched fall in its window."""
    waits = [
        float(wait) for wait in re.findall(r"^manager exited \(.*?\); restarting in (\d+) s", console, re.MULTILINE)
    ]
    for fault, wait in zip((f for f in faults if f.kind == "kill_manager"), waits):
        fault.lasted = wait


def time_lost(output_dir: Path, faults: list[Fault]) -> float:
    """Charges each fault the excess over the median step time of the steps ending in its
    recovery window (overlapping windows charge a step to each fault); returns the median."""
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if '"reward"' in line]
    median = statistics.median(s["step_seconds"] for s in steps)
    for fault in faults:
        if fault.kind in ("stop_rollout", "cut_network"):
            window = fault.lasted + 5.0
        else:
            window = fault.lasted + RECOVERY_WINDOW_SECONDS[fault.kind]
        fault.seconds_lost = sum(
            max(0.0, s["step_seconds"] - median) for s in steps if fault.at <= s["time"] <= fault.at + window
        )
    return median


def run_chaos(
    faults: int,
    seed: int,
    stop_seconds: float,
    steps_between_faults: int,
    output_dir: Path,
    model_dir: Path | None = None,
    instances: int = 3,
    job: Path | None = None,
) -> dict:
    """Runs the mesh and applies a fault every `steps_between_faults` training steps (at a random
    moment within the step), lets training finish, and checks the ledger. Faults are paced by
    steps rather than seconds, so they all land before the run's last step however slow it gets.
    Network cuts need network namespaces; without them (not root) that kind is left out, and why
    is returned in `left_out`. `job`: a job file to run instead of the default job (the multi-turn
    job: examples/feedback)."""
    rng = random.Random(seed)
    steps = WARMUP_STEPS + faults * steps_between_faults + TAIL_STEPS
    base_port = free_port()
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--steps",
        str(steps),
        "--rollout-instances",
        str(instances),
        "--base-port",
        str(base_port),
        "--output-dir",
        str(output_dir),
        "--set",
        "algorithm.eval_every=100000",
        "--set",
        "algorithm.checkpoint_every=100000",
        "--set",
        "tasks.0.eval.prompts=16",
    ]
    kinds = dict(FAULT_WEIGHTS)
    left_out = {}
    problem = netns_problem()
    if problem:
        del kinds["cut_network"]
        left_out["cut_network"] = f"no network namespaces: {problem}"
        print(f"cut_network left out: {left_out['cut_network']}", flush=True)
    else:
        command += ["--rollout-netns", "2"]
    if job is None or not tomllib.loads(job.read_text()).get("mesh", {}).get("relay_shards"):
        del kinds["kill_relay"]
        left_out["kill_relay"] = "the job runs no relay shards"
    if model_dir is not None:
        command += ["--model-dir", str(model_dir)]
    if job is not None:
        command += ["--job", str(job)]
    log_path = output_dir.parent / f"{output_dir.name}-console.log"
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    applied: list[Fault] = []
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        injector = Injector(output_dir, f"127.0.0.1:{base_port + 1}", stop_seconds, rng)
        try:
            planned = draw_faults(faults, kinds, rng)
            while len(applied) < faults and process.poll() is None:
                due = WARMUP_STEPS + len(applied) * steps_between_faults
                while trained_steps(output_dir) < due and process.poll() is None:
                    if time.monotonic() - started > 1800:
                        raise RuntimeError(f"training stalled before step {due}; see {log_path}")
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.5))
                fault = injector.apply(planned[len(applied)])
                if fault is None:
                    # No target now (the manager not recovered yet, the namespaced instance not back
                    # from its last cut): the next planned fault goes first, this one is tried after it.
                    if len(applied) + 1 < len(planned):
                        planned.insert(len(applied) + 1, planned.pop(len(applied)))
                else:
                    applied.append(fault)
                    print(
                        f"fault {len(applied)}/{faults}: {fault.kind} {fault.target}"
                        + (" (mid-push)" if fault.mid_push else "")
                        + (f" for {fault.lasted:.0f} s" if fault.lasted else ""),
                        flush=True,
                    )
            code = process.wait(timeout=3600)
        finally:
            injector.release()
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(120)
    wall = time.monotonic() - started
    console = log_path.read_text()
    if code != 0:
        raise RuntimeError(f"training did not finish (exit {code}); see {log_path}:\n{console[-2000:]}")
    checked = ledger_check(output_dir, steps, 8)
    note_manager_waits(console, applied)
    median_step = time_lost(output_dir, applied)
    by_kind = {}
    for kind in kinds:
        of_kind = [f for f in applied if f.kind == kind]
        if of_kind:
            by_kind[kind] = {
                "faults": len(of_kind),
                "mean_seconds_lost": statistics.mean(f.seconds_lost for f in of_kind),
                "max_seconds_lost": max(f.seconds_lost for f in of_kind),
            }
    return {
        "faults_survived": len(applied),
        "faults_mid_push": sum(f.mid_push for f in applied),
        "steps": steps,
        "wall_seconds": wall,
        "median_step_seconds": median_step,
        "restarts_reported": console.count(" restarted (pid "),
        "manager_restarts_reported": console.count("manager restarted (pid "),
        "cuts_not_rejoined": sum(
            1 for f in applied if f.kind == "cut_network" and f.rejoined_after is None and not f.outlasted_run
        ),
        "max_rejoin_seconds": max((f.rejoined_after or 0.0 for f in applied if f.kind == "cut_network"), default=0.0),
        "broken_not_quarantined": sum(1 for f in applied if f.kind == "broken_engine" and f.quarantined_after is None),
        "max_quarantine_seconds": max(
            (f.quarantined_after or 0.0 for f in applied if f.kind == "broken_engine"), default=0.0
        ),
        **checked,
        "by_kind": by_kind,
        "left_out": left_out,
        "faults": [asdict(f) for f in applied],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-seconds",
        type=float,
        default=30.0,
        help="how long a SIGSTOPped instance stays stopped, and a long network cut lasts",
    )
    parser.add_argument("--steps-between-faults", type=int, default=4)
    parser.add_argument("--output-dir", default="runs/chaos")
    parser.add_argument(
        "--job", type=Path, help="a job to run instead of the default one (examples/feedback/job.toml: multi-turn)"
    )
    args = parser.parse_args()
    output_dir = Path(args.output_dir).resolve()
    if output_dir.exists():
        raise SystemExit(f"{output_dir} exists: the suite needs a fresh run (no checkpoint to resume from)")
    result = run_chaos(args.faults, args.seed, args.stop_seconds, args.steps_between_faults, output_dir, job=args.job)
    figures = {k: v for k, v in result.items() if k not in ("by_kind", "left_out", "faults")}
    for kind, values in result["by_kind"].items():
        figures[f"{kind}/faults"] = values["faults"]
        figures[f"{kind}/mean_seconds_lost"] = values["mean_seconds_lost"]
    write_result(
        "chaos-multi-turn" if args.job else "chaos",
        figures,
        {"median_step_seconds": result["median_step_seconds"]},
        {
            f"{kind}/mean_lost_over_median_step": v["mean_seconds_lost"] / result["median_step_seconds"]
            for kind, v in result["by_kind"].items()
        },
        {
            "samples_lost": 0,
            "samples_duplicated": 0,
            "cuts_not_rejoined": 0,
            "broken_not_quarantined": 0,
            "faults_survived": f">= {args.faults}",
        },
        {
            "faults": args.faults,
            "seed": args.seed,
            "stop_seconds": args.stop_seconds,
            "short_cut_seconds": SHORT_CUT_SECONDS,
            "instances": 3,
            "steps_between_faults": args.steps_between_faults,
            "fault_weights": FAULT_WEIGHTS,
            "left_out": result["left_out"],
            "job": str(args.job or "the default job"),
            "fault_list": result["faults"],
        },
    )


if __name__ == "__main__":
    main()
