"""Fuzzing every RPC of the mesh's services with requests generated from the contracts, plus oversize,
NaN, negative, unknown-id and wrong-incarnation cases: each is answered with a status and a message,
none crashes a server or hangs. A bounded run here; RLMESH_FUZZ_REQUESTS=10000 is `make fuzz`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from rlmesh.manager.v1 import manager_pb2
from rlmesh.rollout.v1 import rollout_pb2
from tests.fuzz.cases import (
    DELIVERED_BATCH,
    PARKED_BATCH,
    Expected,
    bad_sampling_cases,
    begin_request,
    declared_size_cases,
    delivered_batch,
    delivery_cases,
    hints,
    oversize,
    parked_batch,
    seeds,
    unknown_id_cases,
    wires,
    wrong_incarnation_cases,
)
from tests.fuzz.harness import Harness, Outcome, Rpc, Wire, contract_rpcs
from tests.fuzz.messages import MessageStrategies

REQUESTS = int(os.environ.get("RLMESH_FUZZ_REQUESTS", "0"))
"""Generated requests in all (spread evenly over the RPCs); 0 is the bounded run of `make test`."""
RESULTS = os.environ.get("RLMESH_FUZZ_RESULTS", "")
"""Where to write the run's figures as JSON (`make fuzz`: bench/results/fuzz.json)."""
BOUNDED_EXAMPLES = 12

# Drain takes the instance out of the pool for good, so it goes last; versions only grow, so the
# legacy upload, whose variants store any version up to 2^63 - 1, goes after the sharded one.
LAST = ("weights.UploadWeights", "rollout.Drain")
RPCS = sorted(contract_rpcs(), key=lambda rpc: LAST.index(rpc.key) + 1 if rpc.key in LAST else 0)
BY_KEY = {rpc.key: rpc for rpc in RPCS}
EXAMPLES = max(BOUNDED_EXAMPLES, math.ceil(REQUESTS / len(RPCS)))


def fuzz_settings(examples: int) -> settings:
    # The bounded run is derandomized so `make test` is repeatable; the full run draws afresh.
    return settings(
        max_examples=examples,
        database=None,
        derandomize=not REQUESTS,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


@pytest.fixture(scope="module")
def harness(model_dir):
    harness = Harness(model_dir)
    harness.start()
    try:
        submit, stream = BY_KEY["manager.SubmitPrompts"], BY_KEY["manager.StreamRollouts"]
        assert harness.call(submit, Wire(delivered_batch()), setup=True).code == grpc.StatusCode.OK
        streamed = harness.call(
            stream, Wire(manager_pb2.StreamRolloutsRequest(batch_id=DELIVERED_BATCH, micro_batch_groups=2)), setup=True
        )
        assert streamed.code == grpc.StatusCode.OK and streamed.responses, streamed
        assert harness.call(submit, Wire(parked_batch()), setup=True).code == grpc.StatusCode.OK
        yield harness
    finally:
        if RESULTS:
            path = Path(RESULTS)
            path.parent.mkdir(parents=True, exist_ok=True)
            # The gateway fuzz's section stays (test_gateway_fuzz.py writes it).
            earlier = json.loads(path.read_text()) if path.is_file() else {}
            report = harness.stats.report()
            if "gateway" in earlier:
                report["gateway"] = earlier["gateway"]
            path.write_text(json.dumps(report, indent=2) + "\n")
        harness.stop()


def assert_serving(harness: Harness, rollout: str = "SERVING") -> None:
    assert harness.health() == {
        "manager": "SERVING",
        "relay": "SERVING",
        "rollout": rollout,
        "weights": "SERVING",
        "trainer": "SERVING",
    }


def check(harness: Harness, case: Expected) -> None:
    for rpc, request in case.before:
        harness.call(BY_KEY[rpc], Wire(request), setup=True)
    request = [Wire(m) for m in case.request] if isinstance(case.request, list) else Wire(case.request)
    outcome = harness.call(BY_KEY[case.rpc], request)
    assert outcome.ok, outcome
    assert outcome.code in case.codes, outcome
    assert case.fragment in outcome.details, outcome


@pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: rpc.key)
def test_a_request_over_the_size_limit_is_refused(harness, rpc: Rpc):
    request = oversize(rpc, harness.max_receive_bytes(rpc.service))
    outcome = harness.call(rpc, [request] if rpc.client_streaming else request)
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in outcome.details, outcome


TARGETED = {**bad_sampling_cases(), **unknown_id_cases(), **declared_size_cases(), **delivery_cases()}


@pytest.mark.parametrize("name", list(TARGETED))
def test_nan_negative_out_of_range_and_unknown_values_are_refused(harness, name: str):
    check(harness, TARGETED[name])


INCARNATION_CASES = wrong_incarnation_cases()


@pytest.mark.parametrize("name", list(INCARNATION_CASES))
def test_a_wrong_incarnation_token_is_refused(harness, name: str):
    check(harness, INCARNATION_CASES[name])
    assert_serving(harness)


# Calls the fuzzer makes around a generated request so that the next one starts from a known
# state; they are counted as setup, not as fuzz requests.
def arrange(harness: Harness, rpc: Rpc) -> None:
    if rpc.key in (
        "manager.StreamRollouts",
        "manager.TakeReadyGroups",
        "manager.CancelBatch",
        "manager.AcknowledgeRollouts",
    ):
        harness.call(BY_KEY["manager.SubmitPrompts"], Wire(parked_batch()), setup=True)
    elif rpc.key in ("rollout.PushWeightChunks", "rollout.CommitWeightUpdate"):
        harness.call(BY_KEY["rollout.BeginWeightUpdate"], Wire(begin_request(harness)), setup=True)


def tidy(harness: Harness, rpc: Rpc, request, outcome: Outcome) -> None:
    if (
        rpc.key == "manager.SubmitPrompts"
        and outcome.code == grpc.StatusCode.OK
        and request.message.batch_id != PARKED_BATCH
    ):
        # Accepted batches would keep the instance generating; only the parked one stays.
        harness.call(
            BY_KEY["manager.CancelBatch"],
            Wire(manager_pb2.CancelBatchRequest(batch_id=request.message.batch_id)),
            setup=True,
        )
    elif rpc.key == "rollout.PauseGeneration":
        harness.call(BY_KEY["rollout.ResumeGeneration"], Wire(rollout_pb2.ResumeGenerationRequest()), setup=True)


def may_wait(harness: Harness, rpc: Rpc, request) -> bool:
    """A rollout stream of a batch the manager holds waits for its groups (the parked batch's are
    never generated), and a watch of opening sessions or of a relay shard's progress streams until
    its deadline: that is their
    contract. Every other call must be answered at once."""
    if rpc.key in ("manager.WatchSessions", "relay.WatchRelay"):
        return True
    return rpc.key == "manager.StreamRollouts" and request.message.batch_id in harness.mesh.manager.state.batches


@pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: rpc.key)
def test_every_rpc_answers_generated_requests(harness, rpc: Rpc):
    strategies = MessageStrategies(hints(harness))

    @fuzz_settings(EXAMPLES)
    @given(wires(strategies, rpc, seeds(harness).get(rpc.key)))
    def fuzz(request):
        arrange(harness, rpc)
        outcome = harness.call(rpc, request, may_wait=may_wait(harness, rpc, request))
        tidy(harness, rpc, request, outcome)
        assert outcome.ok, outcome

    fuzz()
    assert_serving(harness, rollout="NOT_SERVING" if rpc.key == "rollout.Drain" else "SERVING")
