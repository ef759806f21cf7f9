"""Admission: what a submission's samples are (their sampling, their seeds, a batch id used once), and
when a sample may enter generation (the staleness gate and the capacity rule), seen in what the
scheduler starts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists
from rlmesh.sampling import MAX_SEED
from services.manager.domain.admission import Admission
from services.manager.domain.journaled import ChangeTracker
from tests.support.manager_parts import DomainParts

STOP = common_pb2.FINISH_REASON_STOP


def sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def test_staleness_gate_holds_samples_until_a_fresh_enough_instance():
    parts = DomainParts({"a": 0}, max_staleness=0)
    parts.submit("step1", 1, [("p", [1], 2)], sampling())
    parts.admission.publish(1)
    assert parts.scheduler.assign() == []
    parts.instances["a"].weight_version = 1
    assert len(parts.scheduler.assign()) == 2


def test_staleness_one_lets_a_version_lag_by_one():
    parts = DomainParts({"a": 0}, max_staleness=1)
    parts.submit("step1", 1, [("p", [1], 1)], sampling())
    parts.submit("step2", 2, [("p", [1], 1)], sampling())
    parts.admission.publish(1)
    assigned = parts.scheduler.assign()
    assert [a.request.batch_id for a in assigned] == ["step1"]


def test_the_capacity_rule_holds_a_step_until_the_trainer_is_within_staleness_of_it():
    parts = DomainParts({"a": 0}, max_staleness=1)
    parts.submit("step2", 2, [("p", [1], 1)], sampling())
    parts.instances["a"].weight_version = 1
    # The instance is fresh enough (1 >= 2 - 1) but the trainer has published only 0.
    assert parts.scheduler.assign() == []
    parts.admission.publish(1)
    assert [a.request.batch_id for a in parts.scheduler.assign()] == ["step2"]


@settings(max_examples=60)
@given(
    staleness=st.integers(0, 3),
    batch_size=st.integers(1, 4),
    events=st.lists(st.sampled_from(["submit", "push", "publish", "finish", "drop"]), min_size=1, max_size=60),
)
def test_accepted_plus_running_never_exceeds_the_capacity(staleness, batch_size, events):
    """accepted + running <= (eta + v + 1) * B at every dispatch, every refill of a dropped group
    is dispatched once the trainer reaches it, and everything submitted is dispatched in the end."""
    parts = DomainParts({"a": 0}, max_staleness=staleness)
    admission, instance = parts.admission, parts.instances["a"]
    instance.max_batch_size = 10_000
    submitted_steps, started, dropped, finished = 0, [], 0, set()

    def dispatch() -> None:
        for assignment in parts.scheduler.assign():
            started.append(assignment.request)
            accepted_or_running = len(started) - dropped
            assert accepted_or_running <= (staleness + admission.published_version + 1) * batch_size
            assert assignment.request.policy_version <= admission.published_version + staleness

    for event in events:
        if event == "submit":
            parts.submit(
                f"step{submitted_steps}", submitted_steps, [(f"p{i}", [1], 1) for i in range(batch_size)], sampling(1)
            )
            submitted_steps += 1
        elif event == "push" and instance.weight_version == admission.published_version:
            # The weights service pushes a version before the trainer announces it to the manager.
            instance.weight_version = admission.published_version + 1
        elif event == "publish" and instance.weight_version > admission.published_version:
            admission.publish(instance.weight_version)
        elif event in ("finish", "drop"):
            running = [r for r in started if r.request_id not in finished]
            if running:
                request = running[0]
                finished.add(request.request_id)
                parts.request_table.record_chunk(
                    request.request_id, request.attempt, [1], [0.0], [instance.weight_version], STOP
                )
                if event == "drop":
                    # The trainer drops the group (all rewards equal) and refills it for the same step.
                    dropped += 1
                    parts.submit(f"refill{dropped}", request.policy_version, [("r", [1], 1)], sampling(1))
        dispatch()
    while admission.published_version + 1 < submitted_steps:
        instance.weight_version = admission.published_version + 1
        admission.publish(admission.published_version + 1)
        dispatch()
    assert not parts.request_table.queue


def test_an_exact_version_batch_is_outside_the_capacity_rule():
    parts = DomainParts({"a": 3}, max_staleness=0)
    parts.admission.publish(1)
    parts.submit("train", 3, [("p", [1], 1)], sampling())
    parts.submit("eval", 3, [("p", [1], 1)], sampling(), exact_version=True)
    # Version 3 is beyond the published 1 + max_staleness 0: a training step waits, an evaluation does not.
    assert [a.request.batch_id for a in parts.scheduler.assign()] == ["eval"]


def test_a_prompt_with_its_own_sampling_keeps_it_and_the_others_take_the_batchs():
    own = common_pb2.SamplingParams(temperature=0.5, max_tokens=40)
    batch = Admission(ChangeTracker(), max_staleness=0).admit(
        "b", 0, [("task1", [1], 2, own), ("task2", [1], 2, None), ("task3", [1], 2)], sampling(8), False, False, {}, 0
    )
    by_prompt = {r.prompt_id: r.sampling for group in batch.groups.values() for r in group}
    assert (by_prompt["task1"].temperature, by_prompt["task1"].max_tokens) == (0.5, 40)
    assert by_prompt["task2"].max_tokens == by_prompt["task3"].max_tokens == 8


def test_a_batch_id_is_used_once():
    admission, batches = Admission(ChangeTracker(), max_staleness=0), {}
    batches["b"] = admission.admit("b", 0, [("p", [1], 1)], sampling(), False, False, batches, 0)
    with pytest.raises(AlreadyExists):
        admission.admit("b", 0, [("p", [1], 1)], sampling(), False, False, batches, 0)


def test_a_seeded_batch_gives_every_sample_its_own_stable_seed():
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=7)
    first, second = (
        Admission(ChangeTracker(), max_staleness=0).admit("b", 0, [("p", [1], 4)], params, False, False, {}, 0)
        for _ in range(2)
    )
    seeds = [r.sampling.seed for r in first.groups["p"]]
    assert len(set(seeds)) == 4 and 0 not in seeds
    # Seeds the rollout service takes: below 2^62 (torch adds a continuation's length to them).
    assert all(seed < MAX_SEED for seed in seeds)
    assert seeds == [r.sampling.seed for r in second.groups["p"]]
