"""Dispatch around an instance's saturation batch: at its knee it takes no sample of a later step
than the oldest it runs, so the stragglers the trainer waits for decode at full speed, and it
never idles below the knee while it could run something."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import InvalidArgument
from services.manager.domain.state import ManagerState

STOP = common_pb2.FINISH_REASON_STOP


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=8)


def state_with(saturations: dict[str, int], max_batch_size: int = 8, max_staleness: int = 4) -> ManagerState:
    state = ManagerState(lease_seconds=10, max_staleness=max_staleness)
    for index, (instance_id, saturation) in enumerate(saturations.items()):
        state.register(
            instance_id, f"127.0.0.1:{1000 + index}", 0, max_batch_size, now=0, saturation_batch_size=saturation
        )
    return state


def submit_step(state: ManagerState, step: int, samples: int) -> None:
    state.submit(f"step{step}", step, [(f"p{i}", [1, 2], 1) for i in range(samples)], sampling())


def finish(state: ManagerState, request_id: str) -> None:
    request = state.requests[request_id]
    state.record_chunk(request_id, request.attempt, [3], [-0.5], [0], STOP)


def running_by_step(state: ManagerState, instance_id: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for request_id in state.instances[instance_id].running:
        version = state.requests[request_id].policy_version
        counts[version] = counts.get(version, 0) + 1
    return counts


def test_at_its_knee_an_instance_takes_no_later_step_while_an_earlier_one_runs():
    state = state_with({"a": 3})
    submit_step(state, 1, 4)
    submit_step(state, 2, 4)
    state.assign()
    # Step 1 fills the instance past its knee (the oldest step is never held); step 2 waits.
    assert running_by_step(state, "a") == {1: 4}
    finish(state, "step1/p0/0")
    finish(state, "step1/p1/0")
    state.assign()
    # Two step-1 stragglers: step 2 fills up to the knee, not to the max batch.
    assert running_by_step(state, "a") == {1: 2, 2: 1}
    finish(state, "step1/p2/0")
    finish(state, "step1/p3/0")
    state.assign()
    # Step 1 is done: step 2 is the oldest and may fill the instance.
    assert running_by_step(state, "a") == {2: 4}


def test_a_later_step_goes_to_an_instance_below_its_knee():
    state = state_with({"a": 2})
    submit_step(state, 1, 2)
    state.assign()
    state.register("b", "127.0.0.1:2000", 0, 8, now=0, saturation_batch_size=2)
    submit_step(state, 2, 4)
    state.assign()
    assert running_by_step(state, "a") == {1: 2}
    assert running_by_step(state, "b") == {2: 4}


def test_without_a_saturation_batch_an_instance_fills_its_max_batch_with_any_step():
    state = state_with({"a": 0})
    submit_step(state, 1, 3)
    submit_step(state, 2, 5)
    state.assign()
    assert running_by_step(state, "a") == {1: 3, 2: 5}


def test_exact_version_samples_are_not_held_at_the_knee():
    state = state_with({"a": 1})
    submit_step(state, 1, 2)
    state.assign()
    state.submit("eval0", 0, [("e", [1], 2)], sampling(), exact_version=True)
    started = state.assign()
    assert [a.request.batch_id for a in started] == ["eval0", "eval0"]


def test_a_saturation_batch_above_the_max_batch_is_refused():
    state = ManagerState(lease_seconds=10, max_staleness=1)
    with pytest.raises(InvalidArgument, match=r"saturation_batch_size \(9\) must not exceed max_batch_size \(8\)"):
        state.register("a", "127.0.0.1:1000", 0, 8, now=0, saturation_batch_size=9)


STEPS = st.lists(
    st.tuples(st.sampled_from(["submit", "finish", "assign"]), st.integers(0, 30)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(saturations=st.lists(st.integers(0, 8), min_size=1, max_size=3), script=STEPS)
def test_no_start_passes_the_knee_for_a_later_step_and_no_instance_idles_below_it(saturations, script):
    state = state_with({f"i{n}": s for n, s in enumerate(saturations)})
    step = 0
    for kind, pick in script:
        if kind == "submit":
            step += 1
            submit_step(state, step, 1 + pick % 6)
            continue
        if kind == "finish":
            running = sorted(r for i in state.instances.values() for r in i.running)
            if running:
                finish(state, running[pick % len(running)])
            continue
        before = {i: running_by_step(state, i) for i in state.instances}
        for assignment in state.assign():
            counts = before[assignment.instance.instance_id]
            version = assignment.request.policy_version
            saturation = assignment.instance.saturation_batch_size
            if saturation and sum(counts.values()) >= saturation:
                assert version <= min(counts), (counts, version)
            counts[version] = counts.get(version, 0) + 1
        # Work conservation: what is still queued could start nowhere without passing a knee.
        for request in state.queue:
            for instance in state.instances.values():
                below_knee = (
                    not instance.saturation_batch_size or len(instance.running) < instance.saturation_batch_size
                )
                oldest = min(running_by_step(state, instance.instance_id), default=request.policy_version)
                if instance.free_slots > 0 and state.admission.may_run(instance, request):
                    assert not below_knee and request.policy_version > oldest
