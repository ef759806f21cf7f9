"""The authorization matrix on real servers, with bearer secrets and with mutual TLS: for every RPC
of every mesh contract (the contracts users serve are in no role's table), no credential gets
UNAUTHENTICATED, each role the table does not name gets PERMISSION_DENIED, and the roles it names
get through; no refused call changed any state. With authorization turned off a service serves
anyone and says so; without a way to learn roles, none starts."""

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.message import Message

from rlmesh.config import AuthSettings, ConfigError, ServerConfig, TlsFiles
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc, relay_pb2
from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.rpc.authz import AUTHORIZED, ROLES, Role, allowed_roles
from rlmesh.rpc.channels import use_tls
from rlmesh.rpc.servers import GrpcServer
from rlmesh.rpc.tls import ROLE_OF_NAME, create_certificates
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.trainer.loop import TrainingStatus
from services.trainer.server import TrainerServicer
from tests.support.clients import upload_requests
from tests.support.credentials import loopback, role_secret, roleless_certificate
from tests.support.meshes import Mesh, build_mesh, stop_mesh
from tests.support.tensors import scaled_weights
from tests.support.waiting import wait_for

CONTRACTS = (manager_pb2, relay_pb2, rollout_pb2, weights_pb2, trainer_pb2)
CALL_TIMEOUT = 2.0
"""An authorized call may wait for more (a bidirectional stream given one message): running into
the deadline shows it got past authorization."""
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
LAST = "/rlmesh.rollout.v1.RolloutService/Drain"
"""Called last by its allowed roles: it takes the instance out of the pool."""


@dataclass(frozen=True, slots=True)
class Rpc:
    service: str
    path: str
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool


def contract_rpcs() -> list[Rpc]:
    rpcs = []
    for module in CONTRACTS:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rpcs.append(
                    Rpc(
                        service.full_name,
                        f"/{service.full_name}/{method.name}",
                        message_factory.GetMessageClass(method.input_type),
                        message_factory.GetMessageClass(method.output_type),
                        method.client_streaming,
                        method.server_streaming,
                    )
                )
    return sorted(rpcs, key=lambda rpc: rpc.path == LAST)


def call(channel: grpc.Channel, rpc: Rpc, metadata: tuple = ()) -> tuple[grpc.StatusCode, str]:
    """One call from the synchronous client (run it on a thread): the asyncio one reports INTERNAL
    instead of the server's status when the server ends a client stream before the client finished
    writing it (grpc/grpc#36066), as a refusal does."""
    kind = ("stream" if rpc.client_streaming else "unary") + "_" + ("stream" if rpc.server_streaming else "unary")
    invoke = getattr(channel, kind)(
        rpc.path, request_serializer=rpc.request.SerializeToString, response_deserializer=rpc.response.FromString
    )
    argument = iter([rpc.request()]) if rpc.client_streaming else rpc.request()
    try:
        answer = invoke(argument, timeout=CALL_TIMEOUT, metadata=metadata)
        if rpc.server_streaming:
            for _ in answer:
                pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def state_of(mesh: Mesh) -> dict:
    """What a call could change: the registry, the batches, the published and stored versions, the
    instance's served version and whether it serves, and the manager's counters."""
    manager, weights, rollout = mesh.manager.state, mesh.weights.store, mesh.rollouts[0]
    return {
        "instances": {i.instance_id: (i.address, i.weight_version, i.draining) for i in manager.instances.values()},
        "batches": sorted(manager.batches),
        "published": manager.published_version,
        "generated_tokens": manager.request_table.generated_tokens,
        "requeued": manager.request_table.requeued_samples,
        "stored": weights.latest.version if weights.latest else None,
        "served": rollout.engine.weight_version,
        "paused": rollout.engine.paused,
        "draining": rollout.servicer.membership.draining,
    }


@dataclass
class Servers:
    mesh: Mesh
    others: list[GrpcServer]
    addresses: dict[str, str]
    """Each contract's service full name: the address that serves it."""


async def start_servers(model_dir, tls: dict[str, TlsFiles] | None) -> Servers:
    mesh = await build_mesh(model_dir, "grpc", tls=tls, relay_shards=1)
    trainer = GrpcServer(
        loopback(tls and tls["trainer"]), [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name]
    )
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
        TrainerServicer(TrainingStatus(total_steps=1, output_dir="runs/x")), trainer.server
    )
    await trainer.start()
    addresses = {
        "rlmesh.manager.v1.ManagerService": mesh.manager.server.address,
        "rlmesh.manager.v1.RelayService": mesh.relays[0].server.address,
        "rlmesh.weights.v1.WeightsService": mesh.weights.server.address,
        "rlmesh.rollout.v1.RolloutService": mesh.rollouts[0].server.address,
        "rlmesh.trainer.v1.TrainerService": trainer.address,
    }
    return Servers(mesh, [trainer], addresses)


async def stop_servers(servers: Servers) -> None:
    for server in servers.others:
        await server.stop()
    await stop_mesh(servers.mesh)


def bearer(role: Role | None, secret: str | None = None) -> tuple:
    if role is None and secret is None:
        return ()
    return (("authorization", f"Bearer {secret if secret is not None else role_secret(role)}"),)


@dataclass
class Caller:
    """How a test call presents an identity: a channel per (service, identity) and the metadata."""

    open_channel: object
    metadata: tuple


async def run_matrix(servers: Servers, callers: dict[str, Caller]) -> None:
    """`callers`: "none" (no credential), "stranger" (a credential of no role) and one per role."""
    rpcs = contract_rpcs()
    assert {rpc.path for rpc in rpcs} == set(AUTHORIZED)
    before = state_of(servers.mesh)
    channels: dict[tuple[str, str], grpc.Channel] = {}

    def channel(service: str, who: str) -> grpc.Channel:
        if (service, who) not in channels:
            channels[(service, who)] = callers[who].open_channel(servers.addresses[service])
        return channels[(service, who)]

    try:
        for rpc in rpcs:
            for who in ("none", "stranger"):
                code, details = await asyncio.to_thread(call, channel(rpc.service, who), rpc, callers[who].metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (rpc.path, who, code, details)
                assert "needs a credential" in details
            for role in sorted(set(ROLES) - allowed_roles(rpc.path)):
                code, details = await asyncio.to_thread(call, channel(rpc.service, role), rpc, callers[role].metadata)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (rpc.path, role, code, details)
                assert f"not open to the {role} role" in details
        assert state_of(servers.mesh) == before
        for rpc in rpcs:
            for role in sorted(allowed_roles(rpc.path)):
                code, details = await asyncio.to_thread(call, channel(rpc.service, role), rpc, callers[role].metadata)
                assert code not in REFUSALS, (rpc.path, role, code, details)
    finally:
        for opened in channels.values():
            opened.close()


async def test_every_rpc_with_bearer_secrets(model_dir):
    servers = await start_servers(model_dir, None)
    plain = grpc.insecure_channel
    callers = {
        "none": Caller(plain, bearer(None)),
        "stranger": Caller(plain, bearer(None, "rlmesh-trainer-guessed")),
        **{role: Caller(plain, bearer(role)) for role in ROLES},
    }
    try:
        await run_matrix(servers, callers)
    finally:
        await stop_servers(servers)


@pytest.fixture
def certificates(tmp_path) -> Iterator[dict[str, TlsFiles]]:
    files = create_certificates(tmp_path / "tls")
    files["no-role"] = roleless_certificate(tmp_path / "tls")
    # The mesh in this process calls itself with a certificate that names no role, so each of its
    # calls goes by the bearer secret of the role it plays.
    use_tls(files["no-role"])
    yield files
    use_tls(None)


def tls_channel(files: TlsFiles):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(files.ca_file).read_bytes(),
        private_key=Path(files.key_file).read_bytes(),
        certificate_chain=Path(files.cert_file).read_bytes(),
    )
    return lambda address: grpc.secure_channel(address, credentials)


async def test_every_rpc_with_mutual_tls(model_dir, certificates):
    servers = await start_servers(model_dir, certificates)
    name_of_role = {role: name for name, role in ROLE_OF_NAME.items()}
    callers = {
        "none": Caller(tls_channel(certificates["no-role"]), ()),
        "stranger": Caller(tls_channel(certificates["no-role"]), bearer(None, "rlmesh-trainer-guessed")),
        **{role: Caller(tls_channel(certificates[name_of_role[role]]), ()) for role in ROLES},
    }
    try:
        await run_matrix(servers, callers)
        # Without a certificate of the mesh's CA there is not even a connection to answer on.
        ca_only = grpc.ssl_channel_credentials(root_certificates=Path(certificates["client"].ca_file).read_bytes())
        with grpc.secure_channel(servers.addresses["rlmesh.manager.v1.ManagerService"], ca_only) as channel:
            code, _ = await asyncio.to_thread(
                call, channel, next(r for r in contract_rpcs() if r.path.endswith("/PublishVersion"))
            )
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_servers(servers)


def upload_whole_version(address: str, version: int, tensors: dict, metadata: tuple) -> grpc.StatusCode:
    """UploadWeights of a whole version from the synchronous client (run it on a thread), for the
    reason `call` gives."""
    with grpc.insecure_channel(address) as channel:
        try:
            weights_pb2_grpc.WeightsServiceStub(channel).UploadWeights(
                iter(upload_requests(version, tensors)), timeout=60, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_strangers_whole_valid_version_never_becomes_a_served_one(model_dir):
    """A real model's weights, well formed, uploaded with no credential or an operator's: refused;
    the weights service still holds nothing and the instance serves what it served. The same
    upload from the trainer's role is stored and pushed."""
    mesh = await build_mesh(model_dir, "grpc")
    tensors = scaled_weights(model_dir, 0.5)
    address = mesh.weights.server.address
    try:
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (bearer("operator"), grpc.StatusCode.PERMISSION_DENIED),
            (bearer("instance"), grpc.StatusCode.PERMISSION_DENIED),
        ):
            assert await asyncio.to_thread(upload_whole_version, address, 7, tensors, metadata) == code
        assert mesh.weights.store.latest is None and mesh.rollouts[0].engine.weight_version == 0
        assert (
            await asyncio.to_thread(upload_whole_version, address, 7, tensors, bearer("trainer")) == grpc.StatusCode.OK
        )
        await wait_for(lambda: mesh.rollouts[0].engine.weight_version == 7, timeout=60)
    finally:
        await stop_mesh(mesh)


async def test_insecure_serves_anyone_and_says_so_and_nothing_else_starts_without_a_way_to_authorize():
    manager = await start_manager(
        ManagerConfig(
            server=ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5, auth=AuthSettings(insecure=True))
        )
    )
    try:
        async with grpc.aio.insecure_channel(manager.server.address) as channel:
            status = await manager_pb2_grpc.ManagerServiceStub(channel).GetStatus(
                manager_pb2.GetStatusRequest(), timeout=5
            )
        assert status.authorization == "off"
    finally:
        await manager.stop()
    with pytest.raises(ConfigError, match="neither mutual TLS .* nor a verifiers file"):
        GrpcServer(ServerConfig(host="127.0.0.1", port=0), [])
