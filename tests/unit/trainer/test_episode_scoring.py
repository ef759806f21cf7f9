"""What a multi-turn task's reward sees: the whole trajectory's model output, every part of a broken
history in order, in training and in held-out evaluation alike (never the prompt, never only the
last part), and a held-out episode that failed counts 0 in the held-out figures. Every trained
sample carries the id an error names it by."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rlmesh.manager.v1 import manager_pb2
from rlmesh.rewards.base import RewardResult
from rlmesh.tasks.base import TaskPrompt
from services.trainer.pipeline import PromptRecord, StepPlan
from services.trainer.scoring import GroupScorer
from services.trainer.trajectories import transcript_ids
from services.trainer.validation import HeldOut, PinnedBatch, score_held_out

ENV, MODEL = manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, manager_pb2.SEGMENT_SOURCE_MODEL
DONE, DEADLINE, ENVIRONMENT_ERROR = (
    manager_pb2.SESSION_STATUS_DONE,
    manager_pb2.SESSION_STATUS_DEADLINE,
    manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR,
)
STOP = 99


def model(tokens, turn):
    return manager_pb2.Segment(
        source=MODEL, token_ids=tokens, logprobs=[-0.5] * len(tokens), weight_versions=[0] * len(tokens), turn=turn
    )


def context(tokens, **fields):
    return manager_pb2.Segment(source=ENV, token_ids=tokens, **fields)


def broken(status=DONE, session_id="s0") -> manager_pb2.SessionTrajectory:
    """Prompt 1 2; turns 10 11 and 12 answered by 3; then the harness edits its history (keeps
    1 2 10, re-renders 7 8) and the model answers 13 and ends with its stop token."""
    return manager_pb2.SessionTrajectory(
        session_id=session_id,
        status=status,
        segments=[
            context([1, 2]),
            model([10, 11], 0),
            context([3]),
            model([12], 1),
            context([7, 8], starts_part=True, reused_prefix_tokens=3),
            model([13, STOP], 2),
            context([5]),
        ],
    )


class Tokens:
    """A tokenizer whose text is the token ids, the stop token a special one."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(t) for t in ids if not (skip_special_tokens and t == STOP))


class RecordingReward:
    def __init__(self) -> None:
        self.items = []

    async def score(self, items):
        self.items += items
        return [RewardResult(1.0) for _ in items]


def task(reward) -> SimpleNamespace:
    return SimpleNamespace(
        name="agent",
        reward=reward,
        config=SimpleNamespace(
            sampling=SimpleNamespace(temperature=1.0), environment=SimpleNamespace(credit="trajectory")
        ),
    )


def test_the_transcript_is_every_parts_model_output_in_order():
    assert transcript_ids(broken()) == [10, 11, 3, 12, 13, STOP]
    assert transcript_ids(manager_pb2.SessionTrajectory(segments=[context([1, 2])])) == []


def test_the_reward_of_a_broken_trajectory_sees_every_part():
    reward = RecordingReward()
    scorer = GroupScorer(SimpleNamespace(), SimpleNamespace(by_name={"agent": task(reward)}), Tokens(), [STOP])
    record = PromptRecord(0, "p", 0, "agent", TaskPrompt(uid="u", text="x"), "x", [1, 2])
    group = manager_pb2.Group(
        prompt_id="p",
        prompt_token_ids=[1, 2],
        samples=[manager_pb2.Sample(session=broken()), manager_pb2.Sample(session=broken(DEADLINE, "s1"))],
    )
    scored = asyncio.run(scorer._score_episodes("b", record, group))
    [item] = reward.items
    assert item.completion == "10 11 3 12 13" and item.completion_token_ids == [10, 11, 3, 12, 13, STOP]
    # Both parts train, each named after its trajectory.
    assert [s.sample_id for s in scored.samples] == ["s0 part 1", "s0 part 2"]


def held_out(reward) -> HeldOut:
    return HeldOut(
        task(reward), [TaskPrompt(uid="u0", text="x"), TaskPrompt(uid="u1", text="y")], ["x", "y"], [[1, 2], [1, 2]]
    )


def episode_groups(statuses) -> dict[str, manager_pb2.Group]:
    """One held-out episode per prompt, each ended with its status; each sample's token_ids are what
    the manager's group slot holds (the last part's stream past the prompt's length: its reused
    prefix, the re-rendered history and the environment's last tokens included)."""
    groups = {}
    for index, status in enumerate(statuses):
        trajectory = broken(status, f"s{index}")
        sample = manager_pb2.Sample(token_ids=[10, 7, 8, 13, STOP, 5], session=trajectory)
        groups[f"t0s{index}"] = manager_pb2.Group(prompt_id=f"t0s{index}", prompt_token_ids=[1, 2], samples=[sample])
    return groups


def completion(ids) -> str:
    return Tokens().decode(ids[:-1] if ids and ids[-1] == STOP else ids, skip_special_tokens=True)


def test_held_out_episodes_score_the_same_transcript_as_training():
    reward = RecordingReward()
    batch = PinnedBatch("eval", held_out(reward), ["t0s0", "t0s1"], 1, False)
    rewards = asyncio.run(score_held_out(batch, episode_groups([DONE, DONE]), completion))
    assert rewards == [1.0, 1.0]
    assert [item.completion for item in reward.items] == ["10 11 3 12 13"] * 2
    assert [item.completion_token_ids for item in reward.items] == [[10, 11, 3, 12, 13, STOP]] * 2


def test_a_failed_held_out_episode_counts_zero_with_or_without_a_task_reward():
    for reward in (RecordingReward(), None):
        batch = PinnedBatch("eval", held_out(reward), ["t0s0", "t0s1"], 1, False)
        groups = episode_groups([DEADLINE, DONE])
        groups["t0s1"].samples[0].session.reward = 1.0
        rewards = asyncio.run(score_held_out(batch, groups, completion))
        assert rewards == [0.0, 1.0]
        if reward is not None:
            assert len(reward.items) == 1, "a failed episode is not scored"
        assert [e.status for e in batch.episodes] == ["deadline", "done"]
    batch = PinnedBatch("eval", held_out(RecordingReward()), ["t0s0", "t0s1"], 1, False)
    assert asyncio.run(score_held_out(batch, episode_groups([ENVIRONMENT_ERROR, ENVIRONMENT_ERROR]), completion)) == [
        0.0,
        0.0,
    ]


def test_every_trained_sample_is_named_for_the_errors_that_must_name_it():
    """A single-turn sample by its reward item's id (batch/prompt/index)."""
    reward = RecordingReward()
    single = task(reward)
    single.config.max_tokens = 8
    scorer = GroupScorer(
        SimpleNamespace(overlong_buffer_tokens=0), SimpleNamespace(by_name={"agent": single}), Tokens(), [STOP]
    )
    record = PromptRecord(0, "p", 0, "agent", TaskPrompt(uid="u", text="x"), "x", [1, 2])
    plan = StepPlan(0, 1)
    plan.add(record)
    group = manager_pb2.Group(
        prompt_id="p",
        prompt_token_ids=[1, 2],
        samples=[
            manager_pb2.Sample(token_ids=[4, STOP], logprobs=[-0.1, -0.2], weight_versions=[0, 0]),
            manager_pb2.Sample(token_ids=[5], logprobs=[-0.3], weight_versions=[0]),
        ],
    )
    [scored] = asyncio.run(scorer.score("b", plan, [group]))
    assert [s.sample_id for s in scored.samples] == ["b/p/0", "b/p/1"]
    assert [item.completion for item in reward.items] == ["4", "5"]
