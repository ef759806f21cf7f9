"""`rlmesh autoscale`, the autoscaler that acts on Kubernetes: it reads the manager's recommendation
(a real gRPC server, called with the observer's secret) and sets the rollout Deployment's replicas
through the official client against an API server stand-in on loopback (no API server runs here),
one replica at a time within its bounds; RBAC refusals stop it naming the permission."""

import asyncio
import sys

import kubernetes_validate
import pytest
import yaml

from rlmesh.launch.autoscale import Autoscaler, follow_recommendations
from rlmesh.launch.kubernetes_scale import DeploymentReplicas, api_client
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.rpc.credentials import secret_path
from tests.support.credentials import TEST_SECRETS
from tests.support.kubernetes_api import NAMESPACE, KubernetesApiStandIn, ScaleApi, forbidden, scale_response
from tests.support.waiting import wait_for


class RecommendingManager(manager_pb2_grpc.ManagerServiceServicer):
    """GetStatus recommending `recommended` rollout instances."""

    def __init__(self, recommended: int) -> None:
        self.recommended = recommended
        self.calls = 0

    async def GetStatus(self, request, context):
        self.calls += 1
        return manager_pb2.GetStatusResponse(
            stage_balance=manager_pb2.StageBalance(recommended_rollout_instances=self.recommended)
        )


@pytest.fixture
def manager(scripted_server):
    async def start(servicer: RecommendingManager) -> str:
        return await scripted_server(
            servicer,
            manager_pb2_grpc.add_ManagerServiceServicer_to_server,
            manager_pb2.DESCRIPTOR.services_by_name["ManagerService"],
        )

    return start


async def start_autoscale(tmp_path, server: KubernetesApiStandIn, manager_address: str, *args: str, role="observer"):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "autoscale",
        "--manager",
        manager_address,
        "--kubeconfig",
        str(kubeconfig),
        "--namespace",
        NAMESPACE,
        "--secret-file",
        str(secret_path(TEST_SECRETS, role)),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def test_the_stand_ins_answers_are_the_apis_own_shapes():
    kubernetes_validate.validate(scale_response("rollout", NAMESPACE, 3, 1), "1.37", strict=True)
    assert forbidden("patch", "rollout")["code"] == 403


async def test_the_command_moves_the_replicas_one_at_a_time_to_the_recommendation_within_its_maximum(tmp_path, manager):
    address = await manager(RecommendingManager(recommended=9))
    api = ScaleApi(replicas=2)
    with KubernetesApiStandIn(api) as server:
        process = await start_autoscale(
            tmp_path, server, address, "--min", "1", "--max", "4", "--patience", "0", "--cooldown", "0"
        )
        try:
            await wait_for(lambda: api.replicas == 4, timeout=60, interval=0.2)
            await asyncio.sleep(4.5)  # two more polls: the maximum holds
        finally:
            process.terminate()
            stdout, stderr = await process.communicate()
    assert api.replicas == 4, stderr.decode()
    assert "autoscaling deployment rlmesh/rollout (2 replicas) within 1:4" in stdout.decode()
    patches = [r for r in api.received if r.method == "PATCH"]
    assert [p.body for p in patches] == [{"spec": {"replicas": 3}}, {"spec": {"replicas": 4}}]
    for request in api.received:
        assert request.path.split("?")[0] == "/apis/apps/v1/namespaces/rlmesh/deployments/rollout/scale"
        assert request.headers["authorization"] == "Bearer service-account-token-for-tests"
    assert all(p.headers["content-type"] == "application/merge-patch+json" for p in patches)
    assert all("fieldManager=rlmesh-autoscaler" in p.path for p in patches)


async def test_a_service_account_without_the_scale_permission_stops_the_command_naming_it(tmp_path, manager):
    address = await manager(RecommendingManager(recommended=3))
    api = ScaleApi(replicas=2, allowed_verbs=set())
    with KubernetesApiStandIn(api) as server:
        process = await start_autoscale(tmp_path, server, address, "--min", "1", "--max", "4")
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    message = stderr.decode()
    assert "rlmesh autoscale: deployment rlmesh/rollout could not be read" in message
    assert "needs get and patch on deployments/scale" in message and "HTTP 403" in message
    assert not [r for r in api.received if r.method == "PATCH"]


async def test_bounds_that_cannot_hold_are_refused_before_anything_is_called(tmp_path, manager):
    address = await manager(RecommendingManager(recommended=3))
    api = ScaleApi()
    with KubernetesApiStandIn(api) as server:
        process = await start_autoscale(tmp_path, server, address, "--min", "5", "--max", "2")
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert "1 <= minimum <= maximum, got 5:2" in stderr.decode()
    assert api.received == []


async def test_an_api_server_briefly_unavailable_is_asked_again_at_the_next_poll(tmp_path):
    api = ScaleApi(replicas=2, unavailable=2)
    with KubernetesApiStandIn(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
        target = DeploymentReplicas(api_client(str(kubeconfig)), "rollout", NAMESPACE)

        async def recommendation() -> int:
            return 3

        clock = iter(range(1000))
        task = asyncio.create_task(
            follow_recommendations(Autoscaler(1, 4, 0, 0), target, recommendation, lambda: next(clock), 0.05)
        )
        try:
            await wait_for(lambda: api.replicas == 3, timeout=30)
        finally:
            task.cancel()
    statuses = [r.method for r in api.received]
    assert statuses.count("PATCH") == 1 and len(statuses) >= 4
