"""Micro-batches are packed by one rule (rlmesh.micro_batch): groups whole, in order, within the
group count and the token budget; the manager's StreamRollouts and the trainer's pipeline both
pack by it, so for the same groups they make the same micro-batches. A multi-turn trajectory
weighs every part it trains as (a broken history's included), on both sides."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh import micro_batch
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.micro_batch import group_tokens, pack, trajectory_tokens
from rlmesh.rewards.base import RewardResult
from rlmesh.tasks.base import TaskPrompt
from services.manager.domain import delivery
from services.manager.domain.records import DONE, ENVIRONMENT, Limits, Segment
from services.manager.domain.state import ManagerState
from services.manager.domain.trajectories import trajectory
from services.trainer import pipeline
from services.trainer.pipeline import PromptRecord, ScoredGroup, StepPlan
from services.trainer.ranks.batching import TrainingSample
from services.trainer.trajectories import parts_of

STOP = common_pb2.FINISH_REASON_STOP
PROMPT = [1, 2]


def test_groups_are_packed_whole_in_order_and_one_over_budget_travels_alone():
    sizes = [5, 5, 12, 3]
    micro_batches = []
    while sizes:
        taken = pack(sizes, 4, 10, lambda size: size)
        micro_batches.append(taken)
        sizes = sizes[len(taken) :]
    assert micro_batches == [[5, 5], [12], [3]]
    assert pack([5, 5, 12, 3], 3, 0, lambda size: size) == [5, 5, 12]  # no budget: the count alone
    assert group_tokens(2, [3, 4]) == 2 + 3 + 2 + 4


def test_both_services_pack_with_the_one_rule():
    assert delivery.pack is micro_batch.pack and pipeline.pack is micro_batch.pack
    assert delivery.group_tokens is micro_batch.group_tokens and pipeline.group_tokens is micro_batch.group_tokens


def manager_micro_batches(responses: list[list[int]], most: int, max_tokens: int) -> list[list[int]]:
    """Groups (prompt PROMPT, one response length per sample) all complete, taken from StreamRollouts' state."""
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: 0.0)
    state.register("a", "127.0.0.1:1", 0, 10_000, now=0)
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=100)
    state.submit("b", 0, [(f"p{i}", PROMPT, len(lengths)) for i, lengths in enumerate(responses)], sampling)
    # Complete in prompt order, so the stream order is the prompt order the trainer trains in.
    for assignment in sorted(state.assign(), key=lambda a: (int(a.request.prompt_id[1:]), a.request.request_id)):
        index = int(assignment.request.request_id.rsplit("/", 1)[1])
        size = responses[int(assignment.request.prompt_id[1:])][index]
        state.record_chunk(
            assignment.request.request_id, assignment.attempt, [1] * size, [0.0] * size, [0] * size, STOP
        )
    packed = []
    while True:
        groups, remaining = state.take_micro_batch("b", most, min_groups=1, max_tokens=max_tokens)
        packed.append([int(g[0].prompt_id[1:]) for g in groups])
        if remaining == 0:
            return packed


def trainer_micro_batches(responses: list[list[int]], most: int, max_tokens: int) -> list[list[int]]:
    """The same groups accepted into a step of the trainer's pipeline, taken in prompt order."""
    plan = StepPlan(0, len(responses))
    for index, lengths in enumerate(responses):
        record = PromptRecord(0, f"p{index}", index, "task", TaskPrompt(uid=f"u{index}", text="x"), "x", PROMPT)
        plan.add(record)
        samples = [TrainingSample(PROMPT, [2] * length, [0.0] * length, 0.0) for length in lengths]
        plan.accept(
            ScoredGroup(record, "b", samples, [RewardResult(0.0)] * len(lengths), [[0] * length for length in lengths])
        )
    packed = []
    while plan.trained < plan.expected:
        packed.append([g.record.index for g in plan.take_micro_batch(True, most, 1, max_tokens)])
    return packed


@settings(max_examples=60, deadline=None)
@given(
    responses=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=3), min_size=1, max_size=8),
    most=st.integers(1, 4),
    max_tokens=st.integers(0, 40),
)
def test_the_manager_and_the_trainer_pack_the_same_groups_into_the_same_micro_batches(responses, most, max_tokens):
    sizes = [group_tokens(len(PROMPT), lengths) for lengths in responses]
    expected, start = [], 0
    while start < len(sizes):
        count = len(pack(sizes[start:], most, max_tokens, lambda size: size))
        expected.append(list(range(start, start + count)))
        start += count
    assert manager_micro_batches(responses, most, max_tokens) == expected
    assert trainer_micro_batches(responses, most, max_tokens) == expected


# Multi-turn trajectories: a broken history trains as several parts, each of which weighs. ---------

SESSION_PROMPT = [1, 2, 3]

# A turn: (environment tokens appended before it, tokens kept of the stream when the harness edited
# its history (None: not edited), model tokens it generated).
turns = st.lists(
    st.tuples(st.integers(1, 6), st.none() | st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=4
)


def run_session(state: ManagerState, session, session_turns) -> None:
    for turn, (appended, keep, generated) in enumerate(session_turns):
        stream = len(session.part_tokens())
        keep = None if keep is None or keep > stream else keep
        state.run_turn(session.session_id, turn, [Segment(ENVIRONMENT, [7] * appended)], keep, None)
        [assignment] = state.assign()
        state.record_chunk(
            assignment.request.request_id,
            assignment.attempt,
            [5] * generated,
            [-0.5] * generated,
            [0] * generated,
            STOP,
        )
    state.close_session(session.session_id, DONE, "")


def trained_tokens(trajectories: list[manager_pb2.SessionTrajectory]) -> int:
    """What the trainer trains of a group's trajectories: every part's context and response."""
    return sum(len(p.prompt_ids) + len(p.response_ids) for t in trajectories for p in parts_of(t))


def session_groups(groups) -> tuple[ManagerState, list]:
    """A manager holding batch "b": a group of sessions per entry of `groups`, one per turns list."""
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=lambda: 0.0)
    state.register("a", "127.0.0.1:1", 0, 10_000, now=0)
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=100)
    return state, state.open_sessions(
        "b", 0, [(f"p{i}", SESSION_PROMPT, len(g)) for i, g in enumerate(groups)], sampling, Limits()
    )


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(turns, min_size=1, max_size=3), min_size=1, max_size=5))
def test_a_trajectory_weighs_what_the_trainer_trains_of_every_part(groups):
    state, sessions = session_groups(groups)
    by_prompt = iter(sessions)
    for group in groups:
        for session_turns in group:
            session = next(by_prompt)
            run_session(state, session, session_turns)
            # The manager's segments and the trainer's copy of them weigh alike, exactly what is trained.
            assert (
                trajectory_tokens(session.segments)
                == trajectory_tokens(trajectory(session).segments)
                == trained_tokens([trajectory(session)])
            )


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(st.lists(turns, min_size=1, max_size=3), min_size=1, max_size=6),
    most=st.integers(1, 4),
    max_tokens=st.integers(1, 200),
)
def test_no_micro_batch_of_broken_trajectories_exceeds_its_budget_on_either_side(groups, most, max_tokens):
    state, sessions = session_groups(groups)
    by_prompt = iter(sessions)
    for group in groups:
        for session_turns in group:
            run_session(state, next(by_prompt), session_turns)
    delivered = []
    while True:
        taken, remaining = state.take_micro_batch("b", most, min_groups=1, max_tokens=max_tokens)
        micro_batch = [[trajectory(state.sessions.get(r.request_id)) for r in group] for group in taken]
        # A group over the budget alone travels alone (groups are never split); no other goes over.
        assert len(micro_batch) == 1 or sum(trained_tokens(g) for g in micro_batch) <= max_tokens
        delivered += micro_batch
        if remaining == 0:
            break
    assert len(delivered) == len(groups)
    # The trainer packs the same trajectories' parts, as it trains them, by the same rule.
    plan = StepPlan(0, len(delivered))
    for index, group in enumerate(delivered):
        record = PromptRecord(0, f"p{index}", index, "task", TaskPrompt(uid=f"u{index}", text="x"), "x", SESSION_PROMPT)
        plan.add(record)
        samples, owners = [], []
        for owner, trajectory_message in enumerate(group):
            for part in parts_of(trajectory_message):
                samples.append(
                    TrainingSample(part.prompt_ids, part.response_ids, part.logprobs, 0.0, response_mask=part.mask)
                )
                owners.append(owner)
        plan.accept(ScoredGroup(record, "b", samples, [RewardResult(0.0)] * len(group), [[0]] * len(samples), owners))
    while plan.trained < plan.expected:
        taken = plan.take_micro_batch(True, most, 1, max_tokens)
        rows = sum(len(s.prompt_ids) + len(s.response_ids) for g in taken for s in g.samples)
        assert len(taken) == 1 or rows <= max_tokens
