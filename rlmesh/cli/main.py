"""The `rlmesh` command: `up` runs a training job on the whole mesh locally, `scale` changes its number
of rollout instances, `status` shows a running mesh live, `<service>` runs one service, `init-model`
creates a built-in model, `health` checks a service, `drain` takes a rollout instance out of the pool,
`autoscale` scales a Kubernetes rollout Deployment,
`certs` makes mTLS certificates, `secrets` makes or rotates the role secrets, `fork-server` keeps the
services' imports warm for `up`."""

from __future__ import annotations

import argparse
import os
import sys

from rlmesh.cli import mesh_commands, run_commands
from rlmesh.forking.helpers import WARM_FORK_SERVER_ENV
from rlmesh.rpc.authz import ROLES

SERVICES = ("manager", "rollout", "weights", "trainer")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _instance_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    bounds = (_positive(low), _positive(high)) if sep else (_positive(low),) * 2
    if bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"MIN:MAX needs MIN <= MAX, got {text}")
    return bounds


def build_parser() -> argparse.ArgumentParser:
    from rlmesh.config import METRICS_PORT_OFFSET

    parser = argparse.ArgumentParser(prog="rlmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up",
        help="run a training job on the whole mesh locally (default: the built-in job)",
        description="Run a job (--job job.toml; without it the built-in default job) on local "
        "processes. Each flag overrides the job field named in its help.",
    )
    up.add_argument("--job", help="the job file (model, tasks, algorithm, mesh, output); see examples/")
    up.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override any job field, e.g. --set algorithm.learning_rate=1e-4 --set tasks.0.weight=2",
    )
    up.add_argument("--steps", type=_positive, help="algorithm.steps (default 600)")
    up.add_argument(
        "--rollout-instances",
        type=_instance_range,
        metavar="N|MIN:MAX",
        help="mesh.rollout_instances (and mesh.max_rollout_instances): rollout processes at start, and "
        "the range `rlmesh scale` and --autoscale move in (default 1)",
    )
    up.add_argument(
        "--autoscale",
        action="store_true",
        default=None,
        help="mesh.autoscale: follow the manager's recommended instance count within MIN:MAX",
    )
    up.add_argument(
        "--trainer-ranks",
        type=_positive,
        metavar="N",
        help="mesh.trainer_ranks: FSDP ranks of the trainer; more than 1 runs it under torchrun (default 1)",
    )
    up.add_argument("--host", help="mesh.host (default 127.0.0.1)")
    up.add_argument(
        "--base-port",
        type=int,
        help="mesh.base_port: manager port; weights +1, trainer +2, the manager's OpenAI gateway +3, "
        "rollout instances +10..; "
        f"each service's /metrics on its port +{METRICS_PORT_OFFSET} (default 50151)",
    )
    up.add_argument(
        "--max-staleness",
        type=int,
        choices=range(0, 9),
        metavar="K",
        help="algorithm.max_staleness: trainer versions a rollout may lag behind (0 = synchronous; default 1)",
    )
    up.add_argument(
        "--rollout-tp",
        type=_positive,
        metavar="T",
        help="rollout.engine.tensor_parallel_size: tensor-parallel processes per rollout instance (default 1)",
    )
    up.add_argument(
        "--rollout-netns",
        type=int,
        metavar="N",
        help="mesh.rollout_netns: the first N rollout instances each run in their own network namespace, "
        "linked by a veth pair (needs root; default 0)",
    )
    up.add_argument(
        "--relay-shards",
        type=int,
        metavar="N",
        help="mesh.relay_shards: relay shards beside the manager; training tokens go through them to the "
        "trainer and the manager keeps only their counts (default 0: the manager relays every token)",
    )
    up.add_argument("--engine", choices=("torch", "vllm"), help="rollout.engine.kind: rollout engine (default torch)")
    up.add_argument(
        "--update-mode",
        choices=("continue", "pause", "abort-continue"),
        help="rollout.engine.update_mode: what requests in flight do when new weights arrive: continue on them, "
        "pause from the push's start to its commit, or recompute their KV cache at the switch "
        "(default continue)",
    )
    up.add_argument(
        "--transfer-backend",
        choices=("tcp", "mooncake", "grpc"),
        help="weights.backend: data plane of weight pushes (default tcp)",
    )
    up.add_argument(
        "--compression",
        choices=("none", "zstd", "delta"),
        help="weights.compression: link compression of weight pushes (default none; delta needs tcp or grpc)",
    )
    up.add_argument(
        "--model-dir", help="model.path: a HF model folder (default: the built-in tiny model, created on first use)"
    )
    up.add_argument("--output-dir", help="output.dir: metrics, plot, checkpoints and logs (default runs/<time>)")
    up.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="mesh.tls: mutual TLS between every service and client, with a local CA and certificates "
        "created in <output-dir>/tls (or --tls-dir)",
    )
    up.add_argument(
        "--tls-dir",
        metavar="DIR",
        help="mesh.tls_dir: use (and complete) the certificates in DIR, as `rlmesh certs` writes them; implies --tls",
    )
    up.add_argument(
        "--secrets-dir",
        metavar="DIR",
        help="mesh.secrets_dir: use (and complete) the role secrets in DIR, as `rlmesh secrets` writes them "
        "(default: new ones in <output-dir>/secrets)",
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="mesh.insecure: turn authorization off, so that anyone who reaches a port may call every RPC "
        "(a mesh on one trusted machine only)",
    )
    up.set_defaults(handler=run_commands.up)
    up.add_argument(
        "--fork-server",
        metavar="SOCKET",
        default=os.environ.get(WARM_FORK_SERVER_ENV) or None,
        help=f"fork the services from the warm fork server listening at SOCKET (`rlmesh fork-server`), "
        f"which has imported what they import (default: ${WARM_FORK_SERVER_ENV}; none: the run "
        f"starts its own)",
    )
    warm = commands.add_parser(
        "fork-server",
        help="keep the services' imports warm for the `rlmesh up` runs of this machine",
        description="Import what the services import once, then fork each `rlmesh up` that "
        "connects to SOCKET its own fork server, already warm: a run's services "
        "start without seconds of imports. Runs in the foreground until SIGTERM or "
        "Ctrl-C; runs it started live on.",
    )
    warm.add_argument(
        "--socket",
        required=True,
        help=f"the Unix socket to listen on (point `rlmesh up --fork-server` or {WARM_FORK_SERVER_ENV} at it)",
    )
    warm.set_defaults(handler=run_commands.fork_server)
    init = commands.add_parser("init-model", help="create a built-in tiny model")
    init.add_argument(
        "--kind",
        choices=("tiny-increment", "tiny-chat", "tiny-feedback"),
        default="tiny-increment",
        help="tiny-increment: digit tokenizer (default task); tiny-chat: ASCII tokenizer with a chat "
        "template; tiny-feedback: tiny-increment also warmed up on the feedback environment's format",
    )
    init.add_argument("--model-dir", help="where to write it (default: where jobs look for the built-in model)")
    init.add_argument(
        "--warmup-iterations",
        type=_positive,
        metavar="N",
        help="tiny-chat only: N supervised warm-up iterations instead of 1,200 (minutes of CPU): a model "
        "that only has to hold a conversation, for trying out agents and environments",
    )
    init.set_defaults(handler=run_commands.init_model)
    scale = commands.add_parser("scale", help="change the number of rollout instances of a running `rlmesh up`")
    scale.add_argument(
        "--rollout-instances",
        type=_positive,
        required=True,
        metavar="N",
        help="within the MIN:MAX the mesh was started with",
    )
    scale.add_argument("--run", help="the mesh's output folder (default: the newest running one under runs/)")
    scale.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the instances (default 120)")
    scale.set_defaults(handler=run_commands.scale)
    status = commands.add_parser(
        "status",
        help="a live view of a running mesh: instances, queue, staleness, pushes, the trainer",
        description="Reads the manager's, the weights service's and the trainer's status RPCs "
        "and refreshes the view in place; q or Ctrl-C quits. Addresses come from "
        "--manager/--weights/--trainer, else from the mesh.json of a running "
        "`rlmesh up` (--run, default the newest under runs/).",
    )
    status.add_argument("--run", help="a running `rlmesh up`'s output folder")
    status.add_argument("--manager", metavar="HOST:PORT", help="the manager (compose: localhost:50151)")
    status.add_argument("--weights", metavar="HOST:PORT", help="the weights service (compose: localhost:50152)")
    status.add_argument("--trainer", metavar="HOST:PORT", help="the trainer (compose: localhost:50153)")
    status.add_argument("--once", action="store_true", help="print the view once and exit (1 if no service answered)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    mesh_commands.add_credential_arguments(status)
    status.set_defaults(handler=mesh_commands.status)
    health = commands.add_parser("health", help="check a service's health (exit 0 when SERVING)")
    health.add_argument("address", help="host:port")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    mesh_commands.add_credential_arguments(health, secret=False)
    health.set_defaults(handler=mesh_commands.health)
    autoscale = commands.add_parser(
        "autoscale",
        help="scale a Kubernetes Deployment of rollout instances on the manager's recommendations",
        description="Follows GetStatus.stage_balance.recommended_rollout_instances with the same rule as "
        "`rlmesh up --autoscale` (a recommendation holds for --patience seconds, then --cooldown between "
        "changes, one instance at a time, within --min:--max), setting the Deployment's replicas through "
        "its scale subresource. In a pod it uses the pod's ServiceAccount (deploy/k8s/base/autoscaler.yaml).",
    )
    autoscale.add_argument("--manager", required=True, help="the manager's host:port")
    autoscale.add_argument("--deployment", default="rollout", help="the rollout Deployment (default rollout)")
    autoscale.add_argument("--namespace", help="its namespace (default: the pod's own, else default)")
    autoscale.add_argument("--min", type=_positive, required=True, help="the fewest replicas it leaves")
    autoscale.add_argument("--max", type=_positive, required=True, help="the most replicas it sets")
    autoscale.add_argument("--patience", type=float, default=30.0, help="seconds a recommendation must hold (30)")
    autoscale.add_argument("--cooldown", type=float, default=60.0, help="seconds between two changes (60)")
    autoscale.add_argument("--kubeconfig", help="a kubeconfig to use instead of the pod's ServiceAccount")
    autoscale.add_argument("--log-level", default="info", help="info (default), warning, debug")
    mesh_commands.add_credential_arguments(autoscale)
    autoscale.set_defaults(handler=mesh_commands.autoscale)

    drain = commands.add_parser(
        "drain",
        help="take a rollout instance out of the pool: it hands its requests back "
        "to the manager with their tokens, deregisters and exits",
        description="Call Drain on a rollout instance and wait until it has handed its "
        "requests back (exit 0), or say why not (exit 1). A Kubernetes preStop "
        "hook runs it before a preempted pod stops.",
    )
    drain.add_argument("address", help="the instance's host:port")
    drain.add_argument("--reason", default="drain requested", help="logged by the instance (default: drain requested)")
    drain.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the drain; longer than the instance's drain_timeout_seconds (default 30)",
    )
    drain.add_argument(
        "--run",
        help="the `rlmesh up` output folder whose operator secret to present (default: the newest "
        "running one under runs/)",
    )
    mesh_commands.add_credential_arguments(drain)
    drain.set_defaults(handler=mesh_commands.drain)
    certs = commands.add_parser(
        "certs",
        help="create a local CA and a mutual-TLS certificate for each service",
        description="Write ca.pem, ca-key.pem and, for manager, weights, rollout, trainer, "
        "client (the operator's) and observer (read-only), NAME.pem and "
        "NAME-key.pem (keys mode 0600). Valid ones already there are kept. Each "
        "names 127.0.0.1, localhost, NAME and every --host.",
    )
    certs.add_argument("--dir", required=True, help="where to write them")
    certs.add_argument(
        "--host",
        action="append",
        metavar="H",
        help="another host name or IP address the services are reached at (repeatable)",
    )
    certs.set_defaults(handler=mesh_commands.certs)
    secrets = commands.add_parser(
        "secrets",
        help="create a bearer secret for each role, or rotate one",
        description="Write ROLE.secret (mode 0600) for each role that has none yet, and "
        "verifiers.json with their SHA-256 digests, which servers check callers "
        "against. Roles: " + ", ".join(ROLES) + ".",
    )
    secrets.add_argument("--dir", required=True, help="where to write them")
    secrets.add_argument("--rotate", choices=ROLES, metavar="ROLE", help="replace ROLE's secret (and its digest)")
    secrets.set_defaults(handler=mesh_commands.secrets)
    for service in SERVICES:
        sub = commands.add_parser(service, help=f"run the {service} service", add_help=False)
        sub.set_defaults(handler=None, service=service)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        # Services run as their own module so this package never imports service code.
        os.execv(sys.executable, [sys.executable, "-m", f"services.{argv[0]}", *argv[1:]])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
