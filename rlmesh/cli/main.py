"""The `rlmesh` command: `up` runs a training job on the whole mesh locally, `scale` changes its number
of rollout instances, `status` shows a running mesh live, `<service>` runs one service, `init-model`
creates a built-in model, `health` checks a service, `drain` takes a rollout instance out of the pool,
`certs` makes mTLS certificates, `secrets` makes or rotates the role secrets, `fork-server` keeps the
services' imports warm for `up`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

from rlmesh.cli import mesh_commands
from rlmesh.forking.helpers import WARM_FORK_SERVER_ENV
from rlmesh.rpc.authz import ROLES

SERVICES = ("manager", "rollout", "weights", "trainer")
FLAG_FIELDS = {
    "steps": "algorithm.steps",
    "max_staleness": "algorithm.max_staleness",
    "autoscale": "mesh.autoscale",
    "trainer_ranks": "mesh.trainer_ranks",
    "rollout_tp": "rollout.engine.tensor_parallel_size",
    "rollout_netns": "mesh.rollout_netns",
    "transfer_backend": "weights.backend",
    "compression": "weights.compression",
    "engine": "rollout.engine.kind",
    "update_mode": "rollout.engine.update_mode",
    "host": "mesh.host",
    "base_port": "mesh.base_port",
    "tls": "mesh.tls",
    "tls_dir": "mesh.tls_dir",
    "insecure": "mesh.insecure",
    "secrets_dir": "mesh.secrets_dir",
    "model_dir": "model.path",
    "output_dir": "output.dir",
}
"""`rlmesh up` flags and the job fields they override."""
PATH_FLAGS = ("model_dir", "output_dir", "tls_dir", "secrets_dir")
"""Flags naming a folder: relative to the working directory, as a shell user means them (a job
file's own relative paths are its folder's)."""


def _builtin_builder(name: str):
    """The function that creates the built-in model `name` in a folder."""
    # Imported only here: the builders import torch and transformers (seconds of CPU).
    if name == "tiny-chat":
        from rlmesh.models.chat_tiny import create_chat_model

        return create_chat_model
    from rlmesh.models.qwen2_tiny import create_default_model, create_feedback_model

    return create_feedback_model if name == "tiny-feedback" else create_default_model


def _ensure_builtin_model(name: str) -> Path:
    from rlmesh.job import DEFAULT_MODELS
    from rlmesh.models.builtin import ensure_model

    return ensure_model(DEFAULT_MODELS[name].resolve(), lambda folder: _builtin_builder(name)(folder), name)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    from rlmesh.config import ConfigError
    from rlmesh.job import parse_value

    overrides: dict[str, object] = {
        field: getattr(args, flag) for flag, field in FLAG_FIELDS.items() if getattr(args, flag) is not None
    }
    for flag in PATH_FLAGS:
        if getattr(args, flag) is not None:
            overrides[FLAG_FIELDS[flag]] = str(Path(getattr(args, flag)).resolve())
    if args.rollout_instances is not None:
        overrides["mesh.rollout_instances"], overrides["mesh.max_rollout_instances"] = args.rollout_instances
    if args.tls_dir is not None:
        overrides["mesh.tls"] = True
    for assignment in args.set or []:
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {assignment!r}: write it FIELD=VALUE, e.g. algorithm.learning_rate=1e-4")
        overrides[key.strip()] = parse_value(value.strip())
    return overrides


def prepare_job(args: argparse.Namespace):
    """The job of `--job` (or the default job) with the flags applied, its network namespaces
    possible and its model folder ready (its tasks are checked against the model's tokenizer
    once the fork server can do it: `rlmesh.tasks.check`). Raises ConfigError."""
    from rlmesh.config import ConfigError
    from rlmesh.job import load_job
    from rlmesh.launch.netns import netns_problem
    from rlmesh.models.families import check_model_dir

    job, base = load_job(args.job, _overrides(args))
    if job.mesh.rollout_netns and (problem := netns_problem()):
        raise ConfigError(
            f"mesh.rollout_netns = {job.mesh.rollout_netns} runs rollout instances in network namespaces, "
            f"which this process cannot create: {problem}"
        )
    model_dir = Path(job.model.path) if job.model.path else _ensure_builtin_model(job.model.builtin)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} is not a HF-format model folder (no config.json)")
    check_model_dir(model_dir)
    return job, base, model_dir


def _up(args: argparse.Namespace) -> int:
    # Every process this one starts is a fork followed at once by an exec, or a fork of the fork
    # server, which imports gRPC but never uses it: gRPC's fork handlers have nothing to protect,
    # and they log a line per restarted service when they skip.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from rlmesh.config import ConfigError
    from rlmesh.launch.netns import plan_netns
    from rlmesh.launch.plan import LaunchPlan
    from rlmesh.launch.run import run_mesh
    from rlmesh.logging import configure_logging
    from rlmesh.settings.handover import hand_settings_to_services, trainer_settings
    from rlmesh.tasks.check import CHECK_FAILED

    configure_logging("warning")
    try:
        job, base, model_dir = prepare_job(args)
        mesh = job.mesh
        if job.rollout.engine.kind == "vllm":
            import torch

            from rlmesh.launch.services import VLLM_PYTHON
            from rlmesh.models.engine_fit import vllm_cpu_refusal

            if not VLLM_PYTHON.exists():
                raise ConfigError(f"rollout.engine.kind = vllm needs {VLLM_PYTHON}: run `make setup-vllm` first")
            # vLLM runs on a GPU where one is visible; on CPU its attention takes some head sizes only.
            if not torch.cuda.is_available() and (refusal := vllm_cpu_refusal(model_dir)):
                raise ConfigError(f"rollout.engine.kind = vllm: {refusal}")
        if missing := job.missing_file() or job.missing_gpu() or job.tracking.missing_package():
            raise ConfigError(missing)
        netns = None
        output_dir = Path(job.output.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        created = not output_dir.exists()
        output_dir.mkdir(parents=True, exist_ok=True)
        if mesh.rollout_netns:
            try:
                netns = plan_netns(output_dir, mesh.rollout_netns)
            except RuntimeError as exc:
                raise ConfigError(f"mesh.rollout_netns: {exc}") from exc
        tls_dir = None
        if mesh.tls:
            from rlmesh.rpc.tls import create_certificates

            tls_dir = Path(mesh.tls_dir).resolve() if mesh.tls_dir else output_dir / "tls"
            create_certificates(tls_dir, [mesh.host, *(netns.hosts if netns is not None else [])])
        secrets_dir = None
        if not mesh.insecure:
            from rlmesh.rpc.credentials import create_secrets

            secrets_dir = create_secrets(
                Path(mesh.secrets_dir).resolve() if mesh.secrets_dir else output_dir / "secrets"
            )
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"rlmesh up: {exc}", file=sys.stderr)
        return 2
    (output_dir / "job.json").write_text(json.dumps(job.model_dump(mode="json"), indent=2))
    trainer_config = output_dir / "trainer.json"
    trainer_config.write_text(json.dumps(trainer_settings(job, base, model_dir, output_dir), indent=2))
    plan = LaunchPlan(
        job=job,
        output_dir=output_dir,
        model_dir=model_dir,
        trainer_config=trainer_config,
        tls_dir=tls_dir,
        secrets_dir=secrets_dir,
        netns=netns,
        job_dir=base,
        warm_fork_server=Path(args.fork_server) if args.fork_server else None,
    )
    handed = hand_settings_to_services(job, output_dir)
    try:
        code = asyncio.run(run_mesh(plan))
    finally:
        for variable in handed:
            os.environ.pop(variable, None)
    if code == 130:
        print("\ninterrupted: every process of the mesh was stopped", file=sys.stderr)
    if code == CHECK_FAILED and created:
        # A job refused before any service started leaves no run folder behind.
        shutil.rmtree(output_dir, ignore_errors=True)
    return code


def _fork_server(args: argparse.Namespace) -> int:
    from rlmesh.forking.warm_forkserver import warm_environment

    socket_path = Path(args.socket).resolve()
    if not socket_path.parent.is_dir():
        print(f"rlmesh fork-server: --socket {args.socket}: no folder {socket_path.parent}", file=sys.stderr)
        return 2
    # sockaddr_un holds 108 bytes.
    if len(str(socket_path).encode()) > 107:
        print(f"rlmesh fork-server: --socket {args.socket}: a Unix socket path is at most 107 bytes", file=sys.stderr)
        return 2
    os.execve(
        sys.executable,
        [sys.executable, "-m", "rlmesh.forking.warm_forkserver", "--socket", str(socket_path)],
        warm_environment(dict(os.environ)),
    )


def _init_model(args: argparse.Namespace) -> int:
    from rlmesh.logging import configure_logging

    configure_logging("info")
    if args.warmup_iterations is not None:
        if args.kind != "tiny-chat" or args.model_dir is None:
            print(
                "error: --warmup-iterations applies to --kind tiny-chat written to a --model-dir of your own",
                file=sys.stderr,
            )
            return 2
        from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model

        create_chat_model(Path(args.model_dir), ChatModelSpec(warmup_iterations=args.warmup_iterations))
    elif args.model_dir is None:
        _ensure_builtin_model(args.kind)
    else:
        _builtin_builder(args.kind)(Path(args.model_dir))
    return 0


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


def _scale(args: argparse.Namespace) -> int:
    from rlmesh.launch.scale import request_scale
    from rlmesh.launch.state import STATE_FILE, find_running_mesh

    run = Path(args.run) if args.run else find_running_mesh(Path("runs"))
    if run is None or not (run / STATE_FILE).is_file():
        where = args.run or "runs/"
        print(
            f"rlmesh scale: no running mesh found in {where} (rlmesh up writes {STATE_FILE} in its output folder)",
            file=sys.stderr,
        )
        return 2
    state = json.loads((run / STATE_FILE).read_text())
    bounds = state["rollout_instances"]
    if not bounds["min"] <= args.rollout_instances <= bounds["max"]:
        print(
            f"rlmesh scale: this mesh runs {bounds['min']} to {bounds['max']} rollout instances "
            f"(rlmesh up --rollout-instances MIN:MAX); {args.rollout_instances} is outside",
            file=sys.stderr,
        )
        return 2
    request_scale(run, args.rollout_instances)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            current = json.loads((run / STATE_FILE).read_text())["rollout_instances"]
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        # Done once the new instances run and the drained ones have handed their work back and left.
        if (
            current["target"] == args.rollout_instances
            and len(current["running"]) == args.rollout_instances
            and not current["leaving"]
        ):
            print(f"rollout instances: {len(current['running'])} ({', '.join(r['name'] for r in current['running'])})")
            return 0
    print(
        f"rlmesh scale: the mesh in {run} did not reach {args.rollout_instances} instances in {args.timeout:.0f} s",
        file=sys.stderr,
    )
    return 1


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
    up.set_defaults(handler=_up)
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
    warm.set_defaults(handler=_fork_server)
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
    init.set_defaults(handler=_init_model)
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
    scale.set_defaults(handler=_scale)
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
