"""The `rlmesh` command: `up` runs the whole mesh locally, `<service>` runs one service,
`init-model` creates the default model, `health` checks a service."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

SERVICES = ("manager", "rollout", "weights", "trainer")
DEFAULT_MODEL_DIR = Path(".rlmesh/models/tiny-qwen2-increment")


def _ensure_model(model_dir: Path) -> None:
    from rlmesh.models.qwen2_tiny import create_default_model, is_model_dir

    if is_model_dir(model_dir):
        return
    print(f"creating the default model in {model_dir} (random init + supervised warm-up)...", flush=True)
    started = time.perf_counter()
    create_default_model(model_dir)
    print(f"model ready in {time.perf_counter() - started:.0f} s", flush=True)


def _up(args: argparse.Namespace) -> int:
    from rlmesh.launcher import MeshPlan, run_mesh
    from rlmesh.logging import configure_logging

    configure_logging("warning")
    if args.rollout_instances < 1:
        print("rlmesh up: --rollout-instances must be at least 1", file=sys.stderr)
        return 2
    if args.transfer_backend == "mooncake" and args.compression != "none":
        print("rlmesh up: the mooncake backend writes raw bytes; --compression needs --transfer-backend tcp or grpc", file=sys.stderr)
        return 2
    if not 1024 <= args.base_port <= 65535 - 10 - args.rollout_instances:
        print("rlmesh up: --base-port must leave room for every service's port below 65536", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir).resolve()
    _ensure_model(model_dir)
    output_dir = Path(args.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    plan = MeshPlan(
        output_dir=output_dir,
        model_dir=model_dir,
        steps=args.steps,
        rollout_instances=args.rollout_instances,
        host=args.host,
        base_port=args.base_port,
        max_staleness=args.max_staleness,
        transfer_backend=args.transfer_backend,
        trainer_ranks=args.trainer_ranks,
        rollout_tp=args.rollout_tp,
        compression=args.compression,
    )
    code = asyncio.run(run_mesh(plan))
    if code == 130:
        print("\ninterrupted: every process of the mesh was stopped", file=sys.stderr)
    return code


def _init_model(args: argparse.Namespace) -> int:
    from rlmesh.logging import configure_logging

    configure_logging("info")
    _ensure_model(Path(args.model_dir))
    return 0


def _health(args: argparse.Namespace) -> int:
    from rlmesh.rpc import check_health

    healthy = asyncio.run(check_health(args.address, timeout=args.timeout))
    print("SERVING" if healthy else "NOT SERVING")
    return 0 if healthy else 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="run the whole mesh locally and train the default task")
    up.add_argument("--steps", type=_positive, default=600, help="training steps (default 600)")
    up.add_argument("--rollout-instances", type=int, default=1, help="rollout processes (default 1)")
    up.add_argument("--trainer-ranks", type=_positive, default=1, metavar="N",
                    help="FSDP ranks of the trainer on this machine; more than 1 runs it under torchrun (default 1)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--base-port", type=int, default=50151,
                    help="manager port; weights +1, trainer +2, rollout instances +10.. (default 50151)")
    up.add_argument("--max-staleness", type=int, default=1, choices=range(0, 9), metavar="K",
                    help="trainer versions a rollout may lag behind (0 = synchronous; default 1)")
    up.add_argument("--rollout-tp", type=_positive, default=1, metavar="T",
                    help="tensor-parallel processes per rollout instance (default 1)")
    up.add_argument("--transfer-backend", choices=("tcp", "mooncake", "grpc"), default="tcp",
                    help="data plane of weight pushes (default tcp)")
    up.add_argument("--compression", choices=("none", "zstd", "delta"), default="none",
                    help="link compression of weight pushes (default none; delta needs tcp or grpc)")
    up.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), help="created on first use")
    up.add_argument("--output-dir", help="metrics, plot, checkpoints and logs (default runs/<time>)")
    up.set_defaults(run=_up)
    init = commands.add_parser("init-model", help="create the default tiny model")
    init.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    init.set_defaults(run=_init_model)
    health = commands.add_parser("health", help="check a service's health (exit 0 when SERVING)")
    health.add_argument("address", help="host:port")
    health.add_argument("--timeout", type=float, default=2.0)
    health.set_defaults(run=_health)
    for service in SERVICES:
        sub = commands.add_parser(service, help=f"run the {service} service", add_help=False)
        sub.set_defaults(run=None, service=service)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        # Services run as their own module so this package never imports service code.
        os.execv(sys.executable, [sys.executable, "-m", f"services.{argv[0]}", *argv[1:]])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
