"""Rewards from another language: the Node example verifier (stubs generated from protos/) scored
through RemoteReward with the token the verifier was given (no mesh role's secret), and the
client's deadlines, retries and checks against scripted servers."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from rlmesh.launch.ports import free_port
from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.rewards.remote import RemoteReward, RemoteRewardError, RewardItem
from rlmesh.rpc.channels import check_health, open_user_channel
from tests.support.credentials import role_secret
from tests.support.paths import REPO_ROOT

NODE_VERIFIER = REPO_ROOT / "examples" / "node-verifier"
TOKEN = "the-node-verifiers-own-token"
"""The bearer token the Node verifier is started with, as a task's reward.remote_credential names it."""


def item(sample_id: str, completion: str, answer: str | float | None = None, tokens: int = 0) -> RewardItem:
    metadata = {} if answer is None else {"answer": answer}
    return RewardItem(sample_id, "What is 6 * 7?", completion, metadata, list(range(tokens)))


@pytest.fixture
async def start_node_verifier():
    """Starts `node server.js` on the given (or a free) port; stops each with SIGTERM and checks it
    exits cleanly."""
    node = shutil.which("node")
    assert node, "node is needed for the example verifier"
    assert (NODE_VERIFIER / "gen/rlmesh/reward/v1/reward.js").exists(), "stubs not generated: run `make node-verifier`"
    processes = []
    folder = tempfile.TemporaryDirectory()
    token_file = Path(folder.name) / "verifier.token"
    token_file.write_text(TOKEN + "\n")

    async def start(*args: str, port: int | None = None) -> str:
        port = port or free_port()
        process = await asyncio.create_subprocess_exec(
            node,
            "server.js",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
            *args,
            cwd=NODE_VERIFIER,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        processes.append(process)
        line = await asyncio.wait_for(process.stdout.readline(), 10)
        assert line.decode().strip() == f"listening on {port}", line
        return f"127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        assert await asyncio.wait_for(process.wait(), 10) == 0
    folder.cleanup()


async def test_node_verifier_scores_exact_numeric_and_partial_matches(start_node_verifier):
    address = await start_node_verifier()
    assert await check_health(address, service="rlmesh.reward.v1.RewardService")
    reward = RemoteReward(address, "arithmetic", timeout_seconds=5, attempts=1, backoff_seconds=0, bearer_token=TOKEN)
    items = [
        item("exact", "42", "42"),
        item("padded", "  42\n", "42"),
        item("numeric", "42.0", 42),
        item("one-off", "43", "42"),
        item("short", "4", "42"),
        item("empty", "", "abc"),
    ]
    results = await reward.score(items)
    await reward.close()
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.0]
    assert [r.components["exact"] for r in results] == [1, 1, 1, 0, 0, 0]
    assert [r.components["char_match"] for r in results] == [1.0, 1.0, 0.5, 0.5, 0.5, 0.0]
    assert all(r.error == "" and r.token_rewards is None for r in results)


async def test_node_verifier_refuses_malformed_requests(start_node_verifier):
    address = await start_node_verifier("--tasks", "arithmetic")
    reward = RemoteReward(address, "arithmetic", timeout_seconds=5, attempts=3, backoff_seconds=0, bearer_token=TOKEN)
    with pytest.raises(RemoteRewardError) as caught:
        await reward.score([item("a", "42", "42"), item("b", "42")])
    message = str(caught.value)
    assert address in message and "'arithmetic'" in message and "INVALID_ARGUMENT" in message
    assert 'items[1] (sample b): metadata_json needs an "answer"' in message
    await reward.close()

    other = RemoteReward(address, "poetry", timeout_seconds=5, attempts=1, backoff_seconds=0, bearer_token=TOKEN)
    with pytest.raises(RemoteRewardError, match='INVALID_ARGUMENT: unknown task "poetry"'):
        await other.score([item("a", "42", "42")])
    await other.close()

    async with open_user_channel(address, TOKEN) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for metadata_json, fragment in [("not json", "is not valid JSON"), ("[42]", "must be a JSON object")]:
            request = reward_pb2.ScoreRequest(
                task="arithmetic", items=[reward_pb2.ScoreItem(sample_id="x", metadata_json=metadata_json)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"items[0] (sample x): metadata_json {fragment}" in refused.value.details()


async def test_node_verifier_scores_for_holders_of_its_token_only(start_node_verifier):
    address = await start_node_verifier()
    request = reward_pb2.ScoreRequest(
        task="arithmetic",
        items=[reward_pb2.ScoreItem(sample_id="a", completion="42", metadata_json='{"answer": "42"}')],
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for metadata in [
            (),
            (("authorization", "Bearer guessed"),),
            (("authorization", f"Bearer {role_secret('trainer')}"),),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(request, timeout=5, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Score needs a credential" in refused.value.details()
        reply = await stub.Score(request, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert reply.results[0].reward == 1.0
    node = await asyncio.create_subprocess_exec(
        shutil.which("node"),
        "server.js",
        "--port",
        "0",
        cwd=NODE_VERIFIER,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(node.communicate(), 10)
    assert node.returncode == 2 and "no --token-file FILE" in out.decode()


async def test_a_verifier_down_at_first_is_reached_through_retries(start_node_verifier):
    port = free_port()
    reward = RemoteReward(
        f"127.0.0.1:{port}", "arithmetic", timeout_seconds=2, attempts=8, backoff_seconds=0.1, bearer_token=TOKEN
    )
    scoring = asyncio.create_task(reward.score([item("a", "42", "42")]))
    await asyncio.sleep(0.5)
    assert not scoring.done()
    await start_node_verifier(port=port)
    assert [r.reward for r in await asyncio.wait_for(scoring, 15)] == [1.0]
    await reward.close()


class ScriptedVerifier(reward_pb2_grpc.RewardServiceServicer):
    """A Python RewardService whose answer to the n-th call (from 1) is `answer(n, request, context)`."""

    def __init__(
        self,
        answer: Callable[[int, reward_pb2.ScoreRequest, grpc.aio.ServicerContext], Awaitable[reward_pb2.ScoreResponse]],
    ):
        self.answer = answer
        self.batch_sizes: list[int] = []

    async def Score(self, request, context):
        self.batch_sizes.append(len(request.items))
        return await self.answer(len(self.batch_sizes), request, context)


def scored_by_index(request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
    """Rewards each item with the number in its sample id and one reward per token."""
    return reward_pb2.ScoreResponse(
        results=[
            reward_pb2.ScoreResult(
                sample_id=i.sample_id,
                reward=float(i.sample_id),
                components={"index": float(i.sample_id)},
                token_rewards=[0.5] * len(i.completion_token_ids),
            )
            for i in request.items
        ]
    )


@pytest.fixture
async def scripted():
    servers = []

    async def start(answer) -> tuple[str, ScriptedVerifier]:
        servicer = ScriptedVerifier(answer)
        server = grpc.aio.server()
        reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        await server.stop(0)


async def test_a_hung_verifier_times_out_on_every_attempt(scripted):
    async def hang(n, request, context):
        await asyncio.sleep(30)

    address, servicer = await scripted(hang)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=0.2, attempts=3, backoff_seconds=0.05)
    started = asyncio.get_running_loop().time()
    with pytest.raises(RemoteRewardError, match="DEADLINE_EXCEEDED on all 3 attempts") as caught:
        await reward.score([item("1", "42", "42")])
    assert address in str(caught.value) and "'arithmetic'" in str(caught.value)
    assert servicer.batch_sizes == [1, 1, 1]
    # Each attempt ended at its 0.2 s deadline: one that waited for the 30 s hang would take longer.
    assert asyncio.get_running_loop().time() - started < 10
    await reward.close()


async def test_overload_is_retried_and_other_errors_are_not(scripted):
    async def overloaded_once(n, request, context):
        if n == 1:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        return scored_by_index(request)

    address, servicer = await scripted(overloaded_once)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=2, attempts=3, backoff_seconds=0.05)
    assert [r.reward for r in await reward.score([item("7", "x")])] == [7.0]
    assert servicer.batch_sizes == [1, 1]
    await reward.close()

    async def broken(n, request, context):
        await context.abort(grpc.StatusCode.INTERNAL, "verifier bug")

    address, servicer = await scripted(broken)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=2, attempts=3, backoff_seconds=0.05)
    with pytest.raises(RemoteRewardError, match="INTERNAL: verifier bug"):
        await reward.score([item("7", "x")])
    assert servicer.batch_sizes == [1]
    await reward.close()


async def test_wrong_answers_are_errors(scripted):
    async def one_short(n, request, context):
        return reward_pb2.ScoreResponse(results=scored_by_index(request).results[1:])

    address, _ = await scripted(one_short)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=2, attempts=1, backoff_seconds=0)
    with pytest.raises(RemoteRewardError, match="OK with 1 results for 2 items"):
        await reward.score([item("1", "x"), item("2", "x")])
    await reward.close()

    async def too_many_token_rewards(n, request, context):
        response = scored_by_index(request)
        response.results[0].token_rewards.append(1.0)
        return response

    address, _ = await scripted(too_many_token_rewards)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=2, attempts=1, backoff_seconds=0)
    with pytest.raises(RemoteRewardError, match="3 token rewards for sample '1' of 2 tokens"):
        await reward.score([item("1", "x", tokens=2)])
    await reward.close()


async def test_big_batches_are_split_and_results_keep_their_order(scripted):
    async def answer(n, request, context):
        return scored_by_index(request)

    address, servicer = await scripted(answer)
    reward = RemoteReward(address, "arithmetic", timeout_seconds=2, attempts=1, backoff_seconds=0, max_batch_size=2)
    results = await reward.score([item(str(i), "x", tokens=i) for i in range(5)])
    assert sorted(servicer.batch_sizes) == [1, 2, 2]
    assert [r.reward for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [r.components for r in results] == [{"index": float(i)} for i in range(5)]
    assert [r.token_rewards for r in results] == [None, [0.5], [0.5] * 2, [0.5] * 3, [0.5] * 4]
    await reward.close()
