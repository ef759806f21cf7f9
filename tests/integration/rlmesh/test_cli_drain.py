"""`rlmesh drain`, the command a Kubernetes preStop hook runs: it calls the rollout's Drain with a
deadline, exits 0 once the instance handed its requests back, and says why not otherwise."""

import asyncio
import sys

import grpc
import pytest

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.credentials import secret_path
from tests.support.credentials import TEST_SECRETS


class ScriptedRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers Drain as told: with a count, a refusal, or not before `delay` seconds."""

    def __init__(self, handed_back: int = 0, refusal: str = "", delay: float = 0.0) -> None:
        self.handed_back = handed_back
        self.refusal = refusal
        self.delay = delay
        self.reasons: list[str] = []

    async def Drain(self, request, context):
        self.reasons.append(request.reason)
        await asyncio.sleep(self.delay)
        if self.refusal:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refusal)
        return rollout_pb2.DrainResponse(handed_back_requests=self.handed_back)


@pytest.fixture
def serve(scripted_server):
    async def start(servicer: ScriptedRollout) -> str:
        return await scripted_server(
            servicer,
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
            rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        )

    return start


async def drain(*args: str, role: str = "operator") -> tuple[int, str, str]:
    """`rlmesh drain args...` presenting `role`'s secret ("": none)."""
    credential = ("--secret-file", str(secret_path(TEST_SECRETS, role))) if role else ()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "drain",
        *args,
        *credential,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def test_drain_reports_the_requests_handed_back(serve):
    rollout = ScriptedRollout(handed_back=3)
    address = await serve(rollout)
    code, out, _ = await drain(address, "--reason", "spot preemption notice")
    assert code == 0
    assert f"{address} drained: 3 requests handed back" in out
    assert rollout.reasons == ["spot preemption notice"]


async def test_a_drain_without_the_operator_credential_is_refused(serve, tmp_path):
    rollout = ScriptedRollout(handed_back=3)
    address = await serve(rollout)
    code, _, err = await drain(address, "--run", str(tmp_path), role="")
    assert code == 1 and f"rlmesh drain: {address} did not drain: UNAUTHENTICATED: Drain needs a credential" in err
    code, _, err = await drain(address, role="observer")
    assert (
        code == 1
        and "PERMISSION_DENIED: Drain is not open to the observer role (allowed: instance, manager, operator)" in err
    )
    assert rollout.reasons == []


async def test_a_refused_drain_exits_non_zero_with_the_reason(serve):
    address = await serve(ScriptedRollout(refusal="this instance cannot drain yet: it is still starting"))
    code, _, err = await drain(address)
    assert code == 1
    assert f"rlmesh drain: {address} did not drain: FAILED_PRECONDITION: this instance cannot drain yet" in err


async def test_a_drain_past_its_deadline_fails(serve):
    address = await serve(ScriptedRollout(delay=5.0))
    code, _, err = await drain(address, "--timeout", "0.5")
    assert code == 1 and "DEADLINE_EXCEEDED" in err


async def test_an_unreachable_instance_fails():
    code, _, err = await drain("127.0.0.1:1", "--timeout", "2")
    assert code == 1 and "rlmesh drain: 127.0.0.1:1 did not drain: UNAVAILABLE" in err


async def test_unusable_tls_files_are_named(tmp_path):
    code, _, err = await drain("127.0.0.1:1", "--tls-dir", str(tmp_path), "--tls-name", "rollout")
    assert code == 2 and f"TLS files of rollout in {tmp_path}" in err
