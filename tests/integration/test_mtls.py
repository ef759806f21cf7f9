"""Mutual TLS and the registration token on real servers: only a caller holding a certificate of
the mesh's CA gets through; without mTLS, the manager's instance calls need the token."""

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.config import ServerConfig, TlsFiles
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc import call_options, check_health, open_channel, use_tls, use_token
from rlmesh.tls import create_certificates
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.main import start as start_rollout
from tests.support import wait_for

TOKEN = "s3cret-registration-token"


@pytest.fixture(autouse=True)
def plain_process():
    """The services set the process's TLS and token at start: later tests get a plaintext process."""
    yield
    use_tls(None)
    use_token("")


@pytest.fixture
def certs(tmp_path) -> dict[str, TlsFiles]:
    return create_certificates(tmp_path / "tls")


def server(tls: TlsFiles | None = None) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5, tls=tls)


async def get_status(channel: grpc.aio.Channel) -> manager_pb2.GetStatusResponse:
    return await manager_pb2_grpc.ManagerServiceStub(channel).GetStatus(manager_pb2.GetStatusRequest(), **call_options(5.0))


async def test_with_tls_only_a_certificate_of_the_mesh_ca_gets_through(certs, tmp_path):
    manager = await start_manager(ManagerConfig(server=server(certs["manager"])))
    address = manager.server.address
    ca = Path(certs["client"].ca_file).read_bytes()
    other = create_certificates(tmp_path / "other-ca")["client"]
    strangers = {
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "a certificate of another CA": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=Path(other.key_file).read_bytes(),
            certificate_chain=Path(other.cert_file).read_bytes()),
    }
    try:
        use_tls(certs["client"])
        async with open_channel(address) as channel:
            assert (await get_status(channel)).instances == []
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), **call_options(5.0))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert await check_health(address)

        # The server refuses these in the TLS handshake, before any call exists to answer with
        # UNAUTHENTICATED: the client sees its connection fail, which gRPC reports as UNAVAILABLE.
        for why, credentials in strangers.items():
            async with grpc.aio.secure_channel(address, credentials) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await get_status(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (why, refused.value.details())
                print(f"{why}: {refused.value.code().name}: {refused.value.details()}")
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await get_status(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            print(f"plaintext: {refused.value.code().name}: {refused.value.details()}")
        use_tls(None)
        assert not await check_health(address)
    finally:
        await manager.stop()


async def test_without_the_registration_token_an_instance_is_refused(certs):
    manager = await start_manager(ManagerConfig(server=server(), registration_token=TOKEN))
    register = manager_pb2.RegisterInstanceRequest(instance_id="intruder", address="127.0.0.1:9", max_batch_size=4)
    try:
        async with open_channel(manager.server.address) as channel:
            stub = manager_pb2_grpc.ManagerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterInstance(register, **call_options(5.0))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details() == "RegisterInstance needs the registration token (authorization: Bearer ...)"
            print(refused.value.details())
            wrong = call_options(5.0)
            wrong["metadata"] += (("authorization", "Bearer guessed"),)
            for call, request in ((stub.RegisterInstance, register),
                                  (stub.Heartbeat, manager_pb2.HeartbeatRequest(instance_id="intruder")),
                                  (stub.DeregisterInstance, manager_pb2.DeregisterInstanceRequest(instance_id="intruder"))):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request, **wrong)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "needs the registration token" in refused.value.details()
                assert "the one presented is wrong" in refused.value.details()
            assert manager.state.instances == {}
            # Calls that are not an instance's need no token.
            assert (await get_status(channel)).instances == []

            use_token(TOKEN)
            reply = await stub.RegisterInstance(register, **call_options(5.0))
            assert reply.lease_seconds > 0 and "intruder" in manager.state.instances
    finally:
        await manager.stop()


async def test_a_rollout_instance_joins_over_mtls_with_the_token(certs):
    manager = await start_manager(ManagerConfig(server=server(certs["manager"]), registration_token=TOKEN))
    rollout = await start_rollout(RolloutConfig(
        server=server(certs["rollout"]), instance_id="rollout-tls", manager_address=manager.server.address,
        engine=EngineConfig(kind="synthetic"), transfer=TransferConfig(mooncake=False), registration_token=TOKEN,
        register_timeout_seconds=10))
    try:
        await wait_for(lambda: "rollout-tls" in manager.state.instances)
        # The manager reaches the instance back over mTLS at the address it advertised.
        use_tls(certs["manager"])
        assert await check_health(manager.state.instances["rollout-tls"].address)
    finally:
        await rollout.stop()
        await manager.stop()
