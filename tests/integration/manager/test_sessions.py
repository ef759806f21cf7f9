"""Multi-turn sessions through a real manager and a real torch instance: turns generated from the
canonical stream, the trajectory delivered once with exactly the sampled tokens (their logprobs
match a forward pass of the model over the stream), and bad calls answered with their status."""

import asyncio
import urllib.request

import grpc
import pytest
import structlog
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.rpc.channels import open_channel
from services.manager.config import ManagerConfig
from services.manager.domain.records import stream_of
from services.manager.domain.trajectories import segment_from_proto
from services.manager.main import start as start_manager
from tests.support.credentials import loopback
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.samples import sampling

ENV = manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
MODEL = manager_pb2.SEGMENT_SOURCE_MODEL


def env_segment(tokenizer, text: str) -> manager_pb2.Segment:
    return manager_pb2.Segment(source=ENV, token_ids=tokenizer.encode(text).ids)


def model_logprobs(model, context: list[int], tokens: list[int], temperature: float) -> list[float]:
    """What the policy gives each of `tokens` after `context`, at `temperature`."""
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


async def test_a_two_turn_episode_trains_exactly_the_tokens_the_engine_sampled(model_dir):
    mesh = await build_mesh(model_dir, "grpc")
    channel = open_channel(mesh.manager_address)
    manager = manager_pb2_grpc.ManagerServiceStub(channel)
    tokenizer = load_tokenizer(model_dir)
    try:
        opened = await manager.OpenSessions(
            manager_pb2.OpenSessionsRequest(
                batch_id="episodes",
                policy_version=0,
                sampling=sampling(model_dir, max_tokens=6),
                task="echo",
                prompts=[manager_pb2.Prompt(prompt_id="p0", token_ids=tokenizer.encode("12+3=").ids, n=2)],
                limits=manager_pb2.SessionLimits(max_turns=4, session_deadline_seconds=60),
            ),
            timeout=10,
        )
        assert [s.session_id for s in opened.sessions] == ["episodes/p0/0", "episodes/p0/1"]
        assert len({s.key for s in opened.sessions}) == 2

        async def episode(session_id: str) -> list[manager_pb2.Segment]:
            first = await manager.RunTurn(manager_pb2.RunTurnRequest(session_id=session_id, turn=0), timeout=30)
            observation = env_segment(tokenizer, "7=")
            second = await manager.RunTurn(
                manager_pb2.RunTurnRequest(session_id=session_id, turn=1, append=[observation]), timeout=30
            )
            # A retried call gets the same turn back, not a new one.
            again = await manager.RunTurn(
                manager_pb2.RunTurnRequest(session_id=session_id, turn=1, append=[observation]), timeout=30
            )
            assert again.generated == second.generated
            await manager.SetSessionReward(
                manager_pb2.SetSessionRewardRequest(session_id=session_id, reward=1.0), timeout=10
            )
            closed = await manager.CloseSession(
                manager_pb2.CloseSessionRequest(session_id=session_id, status=manager_pb2.SESSION_STATUS_DONE),
                timeout=10,
            )
            assert closed.status == manager_pb2.SESSION_STATUS_DONE
            return [first.generated, second.generated]

        generated = await asyncio.gather(*(episode(s.session_id) for s in opened.sessions))
        groups = []
        async for reply in manager.StreamRollouts(
            manager_pb2.StreamRolloutsRequest(batch_id="episodes", micro_batch_groups=1), timeout=30
        ):
            groups += reply.groups
        [group] = groups
        model = load_causal_lm(model_dir)
        for sample, turns in zip(group.samples, generated):
            trajectory = sample.session
            assert (
                trajectory.status == manager_pb2.SESSION_STATUS_DONE
                and trajectory.turns == 2
                and trajectory.reward == 1.0
            )
            sources = [s.source for s in trajectory.segments]
            assert sources == [ENV, MODEL, ENV, MODEL]
            models = [s for s in trajectory.segments if s.source == MODEL]
            assert [m.token_ids for m in models] == [t.token_ids for t in turns]
            segments = [segment_from_proto(s) for s in trajectory.segments]
            assert list(sample.token_ids) == stream_of(segments)[len(group.prompt_token_ids) :]
            for index, segment in enumerate(trajectory.segments):
                if segment.source != MODEL:
                    assert not segment.logprobs and not segment.weight_versions
                    continue
                assert segment.instance_ids == ["instance-0"] and set(segment.weight_versions) == {0}
                context = stream_of(segments[:index])
                expected = model_logprobs(model, context, list(segment.token_ids), 1.0)
                assert segment.logprobs == pytest.approx(expected, abs=2e-3)
    finally:
        await channel.close()
        await stop_mesh(mesh)


async def test_bad_session_calls_get_a_status_that_says_what_is_wrong(grpc_mesh, model_dir):
    channel = open_channel(grpc_mesh.manager_address)
    manager = manager_pb2_grpc.ManagerServiceStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await manager.RunTurn(manager_pb2.RunTurnRequest(session_id="no/such/0", turn=0), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "no/such/0" in unknown.value.details()
        opened = await manager.OpenSessions(
            manager_pb2.OpenSessionsRequest(
                batch_id="b",
                policy_version=0,
                sampling=sampling(model_dir),
                prompts=[manager_pb2.Prompt(prompt_id="p", n=1)],
            ),
            timeout=10,
        )
        session_id = opened.sessions[0].session_id
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await manager.RunTurn(manager_pb2.RunTurnRequest(session_id=session_id, turn=0), timeout=5)
        assert (
            empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "no tokens to generate from" in empty.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as status:
            await manager.CloseSession(manager_pb2.CloseSessionRequest(session_id=session_id), timeout=5)
        assert (
            status.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SESSION_STATUS_DONE" in status.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as model_tokens:
            await manager.RunTurn(
                manager_pb2.RunTurnRequest(
                    session_id=session_id, turn=0, append=[manager_pb2.Segment(source=MODEL, token_ids=[1])]
                ),
                timeout=5,
            )
        assert model_tokens.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as reward:
            await manager.SetSessionReward(
                manager_pb2.SetSessionRewardRequest(session_id=session_id, reward=float("nan")), timeout=5
            )
        assert reward.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "finite" in reward.value.details()
        session = await manager.GetSession(manager_pb2.GetSessionRequest(session_id=session_id), timeout=5)
        assert session.session.status == manager_pb2.SESSION_STATUS_OPEN and session.session.turns == 0
    finally:
        await channel.close()


async def test_closing_sessions_logs_no_line_per_episode_and_counts_them_in_the_metrics():
    server = loopback(role="manager")
    server.metrics_port = free_port()
    manager = await start_manager(ManagerConfig(server=server, max_staleness=0))
    channel = open_channel(manager.server.address)
    stub = manager_pb2_grpc.ManagerServiceStub(channel)
    try:
        opened = await stub.OpenSessions(
            manager_pb2.OpenSessionsRequest(
                batch_id="b",
                policy_version=0,
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=1.0),
                prompts=[manager_pb2.Prompt(prompt_id="p", token_ids=[1, 2], n=3)],
            ),
            timeout=10,
        )
        with structlog.testing.capture_logs() as logs:
            for handle, status in zip(
                opened.sessions,
                (
                    manager_pb2.SESSION_STATUS_DONE,
                    manager_pb2.SESSION_STATUS_DONE,
                    manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR,
                ),
            ):
                await stub.CloseSession(
                    manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=status), timeout=5
                )
        assert not [line for line in logs if line["log_level"] not in ("debug",)], logs
        scrape = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
            )
        )
        assert 'rlmesh_manager_closed_sessions_total{status="done"} 2.0' in scrape
        assert 'rlmesh_manager_closed_sessions_total{status="environment_error"} 1.0' in scrape
        assert "rlmesh_manager_open_sessions 0.0" in scrape
    finally:
        await channel.close()
        await manager.stop()
