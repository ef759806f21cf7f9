"""Environments and harnesses that fail, against a real manager and torch instance: one that hangs past
its step deadline ends `deadline`, one that raises or returns garbage ends `environment_error`, all
closed once and delivered once beside a healthy one; a session nobody closes is reaped at its
deadline and its group delivered; past the error rate the driver stops the job saying why."""

import asyncio
import time

import pytest

from rlmesh.chat.turns import ChatTurns
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.config import EnvironmentConfig
from services.trainer.episodes.driver import EpisodeDriver, EpisodeErrors, TooManyEpisodeErrors
from services.trainer.episodes.spec import EpisodeSpec
from services.trainer.trajectories import MASKED_STATUSES

STATUS = manager_pb2.SessionStatus.Name


class Healthy:
    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        return None, 1.0, True


class Hangs(Healthy):
    def step(self, action):
        time.sleep(3)
        return None, 1.0, True


class Raises(Healthy):
    async def step(self, action):
        raise ValueError("the simulator crashed")


class Garbage(Healthy):
    def step(self, action):
        return {"observation": 42, "reward": "lots", "done": "maybe"}


def spec_for(chat_model_dir, environment) -> EpisodeSpec:
    tokenizer = load_hf_tokenizer(chat_model_dir)
    config = EnvironmentConfig(python="unused:Unused", step_deadline_seconds=0.5, max_turns=3)
    return EpisodeSpec(
        "faults",
        config,
        lambda episode_id: environment(),
        ChatTurns(tokenizer),
        tokenizer,
        [tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        512,
    )


async def open_group(client, chat_model_dir, batch_id: str, n: int, limits=None) -> list[manager_pb2.SessionHandle]:
    tokenizer = load_hf_tokenizer(chat_model_dir)
    params = common_pb2.SamplingParams(
        temperature=1.0, max_tokens=6, stop_token_ids=[tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    )
    return await client.open_sessions(
        batch_id, 0, [("p", [], params)], n, params, limits or manager_pb2.SessionLimits(max_turns=3), "faults"
    )


async def delivered(client, batch_id: str) -> list[manager_pb2.SessionTrajectory]:
    groups = []
    async for micro_batch in client.rollouts(batch_id, 1, 1, 0, timeout=30):
        groups += micro_batch
    assert len(groups) == 1
    return [s.session for s in groups[0].samples]


async def test_failing_environments_end_their_episodes_masked_and_delivered_once(chat_mesh, chat_model_dir):
    _, client = chat_mesh
    failures: list[BaseException] = []

    async def failed(exc):
        failures.append(exc)

    driver = EpisodeDriver(client, threads=4, on_failure=failed)
    handles = await open_group(client, chat_model_dir, "faults", 4)
    prompt = TaskPrompt("row-0", text="Say hi.")
    try:
        outcomes = await asyncio.gather(
            *(
                driver.run_episode(spec_for(chat_model_dir, environment), handle, prompt)
                for environment, handle in zip((Healthy, Hangs, Raises, Garbage), handles)
            )
        )
    finally:
        await driver.close()
    statuses = [STATUS(status) for status, _ in outcomes]
    assert statuses == [
        "SESSION_STATUS_DONE",
        "SESSION_STATUS_DEADLINE",
        "SESSION_STATUS_ENVIRONMENT_ERROR",
        "SESSION_STATUS_ENVIRONMENT_ERROR",
    ]
    reasons = [reason for _, reason in outcomes]
    assert "step_deadline_seconds (0.5)" in reasons[1] and "ValueError: the simulator crashed" in reasons[2]
    assert "not a bool" in reasons[3]
    trajectories = await delivered(client, "faults")
    assert [STATUS(t.status) for t in trajectories] == statuses
    assert [t.status in MASKED_STATUSES for t in trajectories] == [False, True, True, True]
    assert trajectories[0].turn_rewards == {0: 1.0} and "simulator crashed" in trajectories[2].detail
    assert not failures


async def test_a_session_nobody_closes_is_reaped_at_its_deadline(chat_mesh, chat_model_dir):
    built, client = chat_mesh
    [handle] = await open_group(
        client, chat_model_dir, "forgotten", 1, manager_pb2.SessionLimits(max_turns=3, session_deadline_seconds=1.0)
    )
    tokenizer = load_hf_tokenizer(chat_model_dir)
    await client.run_turn(
        manager_pb2.RunTurnRequest(
            session_id=handle.session_id,
            turn=0,
            append=[
                manager_pb2.Segment(
                    source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT,
                    token_ids=tokenizer.encode("Hi", add_special_tokens=False),
                )
            ],
        ),
        wait_seconds=10,
    )
    # The harness vanishes here: no more turns, no close.
    [trajectory] = await asyncio.wait_for(delivered(client, "forgotten"), 15)
    assert STATUS(trajectory.status) == "SESSION_STATUS_DEADLINE" and "session_deadline_seconds" in trajectory.detail
    assert trajectory.turns == 1
    assert built.manager.state.sessions.open_count == 0


def test_past_the_error_rate_the_job_stops_saying_why():
    errors = EpisodeErrors("faults", max_rate=0.2, window=8)
    for failed in [False] * 6 + [True]:
        errors.record(failed, "the simulator crashed")
    with pytest.raises(
        TooManyEpisodeErrors, match=r"task 'faults': 2 of the last 8 episodes failed .* the simulator crashed"
    ):
        errors.record(True, "the simulator crashed")
