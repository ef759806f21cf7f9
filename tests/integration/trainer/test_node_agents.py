"""Agents and environments in Node against a real manager and torch instance: the Node harness (the
official `openai` npm package) run as a task's agent command through the gateway, its trajectory
holding exactly the tokens the engine sampled with their logprobs and versions and the reward it
reported; and the Node environment serving the environment contract, called with the token its
task configures (no mesh role's secret), driving episodes to their end."""

import asyncio
import json
import shutil
import subprocess

import pytest

from rlmesh.chat.turns import ChatTurns
from rlmesh.common.v1 import common_pb2
from rlmesh.environments.remote import EnvironmentChannel
from rlmesh.launch.ports import free_port
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.config import EnvironmentConfig
from services.trainer.episodes.driver import EpisodeDriver
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.trajectories import parts_of, trajectory_reward
from tests.support.paths import REPO_ROOT

NODE_HARNESS = REPO_ROOT / "examples" / "node-harness"
NODE_ENVIRONMENT = REPO_ROOT / "examples" / "node-environment"
MODEL = manager_pb2.SEGMENT_SOURCE_MODEL


def spec_for(chat_model_dir, config: EnvironmentConfig, make_environment=None) -> EpisodeSpec:
    tokenizer = load_hf_tokenizer(chat_model_dir)
    return EpisodeSpec(
        "agents",
        config,
        make_environment,
        ChatTurns(tokenizer),
        tokenizer,
        [tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        512,
        str(REPO_ROOT),
    )


async def open_group(client, chat_model_dir, batch_id: str, n: int) -> list[manager_pb2.SessionHandle]:
    stop = load_hf_tokenizer(chat_model_dir).convert_tokens_to_ids(IM_END_TOKEN)
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=[stop])
    return await client.open_sessions(
        batch_id, 0, [("p", [], params)], n, params, manager_pb2.SessionLimits(max_turns=6), "agents"
    )


async def delivered(client, batch_id: str) -> list[manager_pb2.SessionTrajectory]:
    groups = []
    async for micro_batch in client.rollouts(batch_id, 1, 1, 0, timeout=60):
        groups += micro_batch
    return [s.session for g in groups for s in g.samples]


async def test_the_node_harness_as_an_agent_command_trains_exactly_the_tokens_it_was_served(
    chat_mesh, chat_model_dir, monkeypatch
):
    assert shutil.which("node"), "node is needed for the Node harness"
    built, client = chat_mesh
    reports = []
    # The harness's JSON report, kept as well as parsed by the driver: the test compares it with the trajectory.
    monkeypatch.setattr(
        "services.trainer.episodes.agents.reported_reward",
        lambda stdout: reports.append(json.loads(stdout.strip().splitlines()[-1])) or reports[-1]["reward"],
    )
    config = EnvironmentConfig(command=f"node {NODE_HARNESS / 'harness.js'}", episode_deadline_seconds=120)
    driver = EpisodeDriver(
        client, threads=2, on_failure=lambda exc: asyncio.sleep(0), gateway_address=built.manager.gateway_address
    )
    handles = await open_group(client, chat_model_dir, "node-agents", 2)
    try:
        outcomes = await asyncio.gather(
            *(driver.run_episode(spec_for(chat_model_dir, config), h, TaskPrompt("r", text="Count.")) for h in handles)
        )
    finally:
        await driver.close()
    assert [manager_pb2.SessionStatus.Name(status) for status, _ in outcomes] == ["SESSION_STATUS_DONE"] * 2, outcomes
    trajectories = {t.session_id: t for t in await delivered(client, "node-agents")}
    by_session = {}
    for report in reports:
        by_session[report["turns"][0]["rlmesh"]["session_id"]] = report
    assert set(by_session) == set(trajectories)
    for session_id, report in by_session.items():
        trajectory = trajectories[session_id]
        models = [s for s in trajectory.segments if s.source == MODEL]
        served = [turn["rlmesh"] for turn in report["turns"]]
        assert len(served) == 3 and trajectory.turns == 3
        assert [list(m.token_ids) for m in models] == [s["token_ids"] for s in served]
        assert [list(m.logprobs) for m in models] == [pytest.approx(s["logprobs"]) for s in served]
        assert [list(m.weight_versions) for m in models] == [s["weight_versions"] for s in served]
        [part] = parts_of(trajectory)
        assert [t for t, m in zip(part.response_ids, part.mask) if m] == [t for s in served for t in s["token_ids"]]
        assert trajectory_reward(trajectory) == pytest.approx(report["reward"])


ENVIRONMENT_TOKEN = "the-node-environments-own-token"


@pytest.fixture
def node_environment(tmp_path):
    assert shutil.which("node"), "node is needed for the Node environment"
    port = free_port()
    (tmp_path / "environment.token").write_text(ENVIRONMENT_TOKEN + "\n")
    process = subprocess.Popen(
        [
            "node",
            "server.js",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(tmp_path / "environment.token"),
        ],
        cwd=NODE_ENVIRONMENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == f"listening on {port}"
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


async def test_the_node_environment_drives_episodes_over_the_environment_contract(
    chat_mesh, chat_model_dir, node_environment
):
    _, client = chat_mesh
    channel = EnvironmentChannel(node_environment, "agents", timeout_seconds=10, bearer_token=ENVIRONMENT_TOKEN)
    config = EnvironmentConfig(remote=node_environment, max_turns=3)
    driver = EpisodeDriver(client, threads=2, on_failure=lambda exc: asyncio.sleep(0))
    handles = await open_group(client, chat_model_dir, "node-environment", 2)
    row = TaskPrompt(
        "r",
        messages=[{"role": "user", "content": "Ana buys 3 bags of 4 apples. How many apples?"}],
        metadata={"answer": "12"},
    )
    try:
        outcomes = await asyncio.gather(
            *(driver.run_episode(spec_for(chat_model_dir, config, channel.episode), h, row) for h in handles)
        )
    finally:
        await driver.close()
        await channel.close()
    # The barely trained model answers (unboxed, or no tool call) or runs out of turns: the episodes end either way.
    assert {manager_pb2.SessionStatus.Name(s) for s, _ in outcomes} <= {
        "SESSION_STATUS_DONE",
        "SESSION_STATUS_TRUNCATED_TURNS",
    }, outcomes
    tokenizer = load_hf_tokenizer(chat_model_dir)
    for trajectory in await delivered(client, "node-environment"):
        opening = [
            tokenizer.decode(s.token_ids)
            for s in trajectory.segments[:4]
            if s.source == manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
        ]
        assert opening == [
            "Tool: calculator(expression). Answer as \\boxed{n}.",
            "Ana buys 3 bags of 4 apples. How many apples?",
        ]
