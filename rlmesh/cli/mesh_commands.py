"""The commands that look after a running mesh and its credentials: `rlmesh status`, `health`,
`drain`, `certs` and `secrets`, with the credential flags they share."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from rlmesh.rpc.authz import ROLES

SECRET_FILE_VARIABLE = "RLMESH_SECRET_FILE"


def call_with_credentials(args: argparse.Namespace, run: Path | None = None) -> bool:
    """Makes this process's calls present the client certificate of --tls-dir and the bearer
    secret of --secret-file, else of $RLMESH_SECRET_FILE, else the operator's secret of the
    `rlmesh up` run `run`; False (after saying why) when a file is unusable."""
    from rlmesh.config import ConfigError, TlsFiles
    from rlmesh.launch.state import run_secret
    from rlmesh.rpc.channels import use_secret, use_tls
    from rlmesh.rpc.credentials import read_secret

    secret_file = getattr(args, "secret_file", None) or os.environ.get(SECRET_FILE_VARIABLE)
    if not secret_file and run is not None:
        secret_file = run_secret(run, "operator")
    try:
        if args.tls_dir:
            use_tls(TlsFiles.in_directory(args.tls_dir, args.tls_name))
        if secret_file:
            use_secret(read_secret(secret_file))
    except ConfigError as exc:
        print(f"rlmesh {args.command}: {exc}", file=sys.stderr)
        return False
    return True


def add_credential_arguments(parser: argparse.ArgumentParser, secret: bool = True) -> None:
    parser.add_argument(
        "--tls-dir", metavar="DIR", help="call with mutual TLS: DIR holds ca.pem and the certificate to present"
    )
    parser.add_argument(
        "--tls-name",
        default="client",
        metavar="NAME",
        help="present DIR/NAME.pem with DIR/NAME-key.pem (default client, the operator's)",
    )
    if secret:
        parser.add_argument(
            "--secret-file",
            metavar="FILE",
            help=f"present the bearer secret in FILE (default ${SECRET_FILE_VARIABLE}, else the operator's "
            "secret of the `rlmesh up` run, found through its mesh.json)",
        )


def status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rlmesh.cli.status import MeshAddresses, read_once, render, watch
    from rlmesh.launch.state import STATE_FILE, find_running_mesh

    if args.interval <= 0:
        print("rlmesh status: --interval must be above 0", file=sys.stderr)
        return 2
    run = Path(args.run) if args.run else None
    if args.manager:
        addresses = MeshAddresses(args.manager, args.weights, args.trainer)
    else:
        run = run or find_running_mesh(Path("runs"))
        if run is None or not (run / STATE_FILE).is_file():
            print(
                f"rlmesh status: no running mesh found in {args.run or 'runs/'} (rlmesh up writes {STATE_FILE} in its "
                "output folder); or name the services with --manager, --weights and --trainer",
                file=sys.stderr,
            )
            return 2
        addresses = MeshAddresses.of_run(run)
    if not call_with_credentials(args, run):
        return 2
    # Piped output is not cut to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.once:
        snapshot = asyncio.run(read_once(addresses))
        if not snapshot.reachable:
            print(
                "rlmesh status: no service answered: "
                + "; ".join(f"{k} {v}" for k, v in sorted(snapshot.errors.items())),
                file=sys.stderr,
            )
            return 1
        console.print(render(snapshot))
        return 0
    try:
        asyncio.run(watch(addresses, args.interval, console))
    except KeyboardInterrupt:
        pass
    return 0


def health(args: argparse.Namespace) -> int:
    from rlmesh.rpc.channels import check_health

    if not call_with_credentials(args):
        return 2
    healthy = asyncio.run(check_health(args.address, timeout=args.timeout))
    print("SERVING" if healthy else "NOT SERVING")
    return 0 if healthy else 1


async def drain_instance(address: str, reason: str, timeout: float) -> int:
    from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from rlmesh.rpc.channels import call_options, open_channel

    async with open_channel(address) as channel:
        reply = await rollout_pb2_grpc.RolloutServiceStub(channel).Drain(
            rollout_pb2.DrainRequest(reason=reason), **call_options(timeout)
        )
    return reply.handed_back_requests


def drain(args: argparse.Namespace) -> int:
    import grpc

    from rlmesh.launch.state import find_running_mesh

    if not call_with_credentials(args, Path(args.run) if args.run else find_running_mesh(Path("runs"))):
        return 2
    try:
        handed_back = asyncio.run(drain_instance(args.address, args.reason, args.timeout))
    except grpc.aio.AioRpcError as exc:
        print(f"rlmesh drain: {args.address} did not drain: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{args.address} drained: {handed_back} requests handed back to the manager with their tokens")
    return 0


def autoscale(args: argparse.Namespace) -> int:
    from rlmesh.config import ConfigError
    from rlmesh.launch.autoscale import Autoscaler, follow_recommendations, manager_recommendation
    from rlmesh.launch.kubernetes_scale import DeploymentReplicas, api_client, default_namespace
    from rlmesh.logging import configure_logging
    from rlmesh.rpc.channels import open_channel

    configure_logging(args.log_level)
    if not call_with_credentials(args):
        return 2
    try:
        scaler = Autoscaler(args.min, args.max, args.patience, args.cooldown)
        target = DeploymentReplicas(api_client(args.kubeconfig), args.deployment, args.namespace or default_namespace())

        async def follow() -> None:
            # A target the credentials cannot read or scale stops here, before the first poll.
            replicas = await target.current()
            print(
                f"autoscaling deployment {target.namespace}/{target.name} ({replicas} replicas) within "
                f"{args.min}:{args.max} on the recommendations of {args.manager}",
                flush=True,
            )
            async with open_channel(args.manager) as channel:
                await follow_recommendations(scaler, target, manager_recommendation(channel))

        asyncio.run(follow())
    except (ConfigError, ValueError) as exc:
        print(f"rlmesh autoscale: {exc}", file=sys.stderr)
        return 2
    return 0


def certs(args: argparse.Namespace) -> int:
    from rlmesh.config import ConfigError
    from rlmesh.logging import configure_logging
    from rlmesh.rpc.tls import create_certificates

    configure_logging("warning")
    try:
        files = create_certificates(args.dir, args.host or [])
    except ConfigError as exc:
        print(f"rlmesh certs: {exc}", file=sys.stderr)
        return 2
    directory = Path(args.dir)
    print(f"CA: {directory / 'ca.pem'} (its key ca-key.pem signs more; keep it off the machines that run services)")
    for name, tls in files.items():
        print(f"{name}: {tls.cert_file} {tls.key_file}")
    print(
        f"a service NAME takes its files from RLMESH_NAME_SERVER__TLS__CA_FILE, __CERT_FILE and __KEY_FILE;\n"
        f"rlmesh health HOST:PORT --tls-dir {directory}; grpcurl -cacert {directory / 'ca.pem'} "
        f"-cert {files['client'].cert_file} -key {files['client'].key_file} HOST:PORT list"
    )
    return 0


def secrets(args: argparse.Namespace) -> int:
    from rlmesh.config import ConfigError
    from rlmesh.rpc.credentials import VERIFIERS_FILE, create_secrets, rotate_secret, secret_path

    directory = Path(args.dir)
    try:
        if args.rotate:
            print(
                f"{args.rotate}: new secret in {rotate_secret(directory, args.rotate)}; "
                "servers refuse the old one within a second: restart the processes of that role with the new one"
            )
            return 0
        create_secrets(directory)
    except (ConfigError, OSError) as exc:
        print(f"rlmesh secrets: {exc}", file=sys.stderr)
        return 2
    print(f"verifiers (digests only, for every service): {directory / VERIFIERS_FILE}")
    for role in ROLES:
        print(f"{role}: {secret_path(directory, role)}")
    print(
        f"a service NAME takes them from RLMESH_NAME_SERVER__AUTH__VERIFIERS_FILE and __SECRET_FILE (its role's);\n"
        f"rlmesh status --secret-file {secret_path(directory, 'operator')}; grpcurl -plaintext "
        f'-H "authorization: Bearer $(cat {secret_path(directory, "operator")})" HOST:PORT '
        "rlmesh.manager.v1.ManagerService/GetStatus"
    )
    return 0
