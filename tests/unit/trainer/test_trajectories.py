"""A session's trajectory as training samples: the loss covers model tokens only, each part of an
edited history is a sample of its own whose reused prefix is context, per-turn credit gives each
turn's tokens that turn's advantage within the group, and the micro-batch masks follow."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.manager.v1 import manager_pb2
from services.trainer.algorithms import ADVANTAGE_ESTIMATORS
from services.trainer.ranks.batching import TrainingSample, build_micro_batch
from services.trainer.trajectories import figures_of, parts_of, trajectory_reward, turn_credit

ENV, TEMPLATE, MODEL = (
    manager_pb2.SEGMENT_SOURCE_ENVIRONMENT,
    manager_pb2.SEGMENT_SOURCE_TEMPLATE,
    manager_pb2.SEGMENT_SOURCE_MODEL,
)


def model(tokens, turn, version=3):
    return manager_pb2.Segment(
        source=MODEL,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        weight_versions=[version] * len(tokens),
        turn=turn,
    )


def context(tokens, source=ENV, **fields):
    return manager_pb2.Segment(source=source, token_ids=tokens, **fields)


def test_one_part_trains_the_model_tokens_and_masks_the_rest():
    trajectory = manager_pb2.SessionTrajectory(
        segments=[
            context([1, 2]),
            context([9], TEMPLATE),
            model([10, 11], 0),
            context([3]),
            model([12], 1, version=4),
            context([5]),
        ]
    )
    [part] = parts_of(trajectory)
    assert part.prompt_ids == [1, 2, 9]
    assert part.response_ids == [10, 11, 3, 12] and part.mask == [1, 1, 0, 1] and part.turns == [0, 0, -1, 1]
    assert part.logprobs == [-0.5, -0.5, 0.0, -0.5] and part.weight_versions == [3, 3, 4]
    figures = figures_of(trajectory)
    assert figures.tokens == {"model": 3, "environment": 4, "template": 1} and figures.parts == 1


def test_an_edited_history_trains_each_part_once():
    trajectory = manager_pb2.SessionTrajectory(
        segments=[
            context([1, 2]),
            model([10, 11], 0),
            context([3]),
            model([12], 1),
            context([7, 8], starts_part=True, reused_prefix_tokens=3, break_cause="content_mismatch"),
            model([13], 2),
        ]
    )
    assert figures_of(trajectory).parts == 2 and figures_of(trajectory).breaks == {"content_mismatch": 1}
    first, second = parts_of(trajectory)
    assert first.response_ids == [10, 11, 3, 12] and first.mask == [1, 1, 0, 1]
    # The kept prefix (1, 2, 10) is context in the new part: 10 is not trained twice.
    assert second.prompt_ids == [1, 2, 10, 7, 8] and second.response_ids == [13] and second.mask == [1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([ENV, MODEL]), st.integers(1, 4), st.booleans()), min_size=1, max_size=8))
def test_every_model_token_is_trained_exactly_once(shape):
    segments, turn, expected = [], 0, []
    for index, (source, length, breaks) in enumerate(shape):
        tokens = [100 * index + k for k in range(length)]
        if source == MODEL:
            segments.append(model(tokens, turn))
            expected += tokens
            turn += 1
        else:
            segments.append(
                context(tokens, starts_part=breaks and index > 0, reused_prefix_tokens=1 if breaks and index > 0 else 0)
            )
    trained = [
        t
        for part in parts_of(manager_pb2.SessionTrajectory(segments=segments))
        for t, m in zip(part.response_ids, part.mask)
        if m
    ]
    assert trained == expected


def test_the_reward_is_the_final_one_or_the_sum_of_the_turns():
    assert trajectory_reward(manager_pb2.SessionTrajectory(turn_rewards={0: 0.5, 1: 0.25})) == 0.75
    assert trajectory_reward(manager_pb2.SessionTrajectory(reward=2.0, turn_rewards={0: 0.5})) == 2.0
    assert trajectory_reward(manager_pb2.SessionTrajectory()) == 0.0


def test_per_turn_credit_normalizes_each_turn_within_its_group():
    grpo = ADVANTAGE_ESTIMATORS.get("grpo").compute
    [credit] = turn_credit([[{0: 1.0, 1: 0.0}, {0: 0.0, 1: 1.0}, {0: 1.0}]], grpo)
    assert credit[0][0] > 0 and credit[1][0] < 0 and credit[0][1] < 0 and credit[1][1] > 0
    # A turn a trajectory never reached counts 0 for it.
    assert credit[2][1] == pytest.approx(credit[0][1])


def test_the_micro_batch_trains_the_masked_tokens_with_their_own_advantages():
    sample = TrainingSample(
        [1, 2],
        [10, 3, 12],
        [-0.5, 0.0, -0.5],
        0.7,
        response_mask=[1.0, 0.0, 1.0],
        token_turns=[0, -1, 1],
        token_advantages=[0.2, 0.0, -0.4],
        reward=1.0,
    )
    batch = build_micro_batch([sample, TrainingSample([1], [4, 5], [-1.0, -1.0], 0.3)], pad_id=0)
    assert batch.response_mask[0].tolist() == [0, 1, 0, 1] and batch.response_mask[1].tolist() == [1, 1, 0, 0]
    assert batch.advantages[0].tolist() == pytest.approx([0, 0.2, 0, -0.4])
    assert batch.advantages[1].tolist() == pytest.approx([0.3, 0.3, 0, 0])
    # The trajectory's reward lands on its last trained token.
    assert batch.rewards[0].tolist() == [0, 0, 0, 1.0]
    assert torch.equal(batch.behaviour_logprobs[0], torch.tensor([0, -0.5, 0.0, -0.5]))
