"""Balanced dispatch at fleet scale: plain training requests find their instance through a heap
per version and expected length; whatever the fleet's rates, load, saturation and the queue, each
goes exactly where the scan over every open instance sends it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from tests.support.manager_parts import DomainParts

fleets = st.lists(
    st.tuples(
        st.floats(min_value=50.0, max_value=4000.0),  # tokens/s while busy
        st.floats(min_value=0.2, max_value=1.0),  # share of it one sequence gets
        st.integers(min_value=1, max_value=6),  # max batch
        st.integers(min_value=0, max_value=6),  # saturation batch (0: not known)
        st.integers(min_value=0, max_value=4),  # running already, of the oldest step
    ),
    min_size=1,
    max_size=12,
)
queues = st.lists(
    st.tuples(st.integers(min_value=0, max_value=2), st.integers(min_value=1, max_value=3), st.integers(16, 400)),
    min_size=1,
    max_size=8,
)


def build(fleet, queue, mean_length, scan: bool) -> DomainParts:
    parts = DomainParts({f"i{n}": 0 for n in range(len(fleet))}, max_staleness=2)
    for index, (rate, share, batch, saturation, _) in enumerate(fleet):
        instance = parts.instances[f"i{index}"]
        instance.tokens_per_second, instance.sequence_tokens_per_second = rate, rate * share
        instance.max_batch_size, instance.saturation_batch_size = batch, min(saturation, batch)
    # The instances' running work: samples of the oldest step, started on them as dispatch would.
    parts.submit(
        "old", 0, [("o", [1], 1 + sum(r for *_, r in fleet))], common_pb2.SamplingParams(temperature=1.0, max_tokens=64)
    )
    for index, (*_, running) in enumerate(fleet):
        for _ in range(min(running, parts.instances[f"i{index}"].max_batch_size)):
            request = parts.request_table.queue.popleft()
            parts.request_table.start(request, parts.instances[f"i{index}"])
    parts.request_table.queue.clear()
    parts.request_table.mean_length = mean_length
    for number, (version, prompts, max_tokens) in enumerate(queue):
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens)
        parts.submit(f"b{number}", version, [(f"p{p}", [1, 2], 2) for p in range(prompts)], sampling)
    if scan:
        # A failure on an instance that is not there changes no choice, and takes the scan.
        for request in parts.request_table.queue:
            request.failed_on = {"nowhere"}
    return parts


@settings(max_examples=300, deadline=None)
@given(fleets, queues, st.one_of(st.none(), st.floats(min_value=1.0, max_value=300.0)))
def test_the_heap_sends_every_plain_request_where_the_scan_would(fleet, queue, mean_length):
    by_heap = build(fleet, queue, mean_length, scan=False).scheduler.assign()
    by_scan = build(fleet, queue, mean_length, scan=True).scheduler.assign()
    assert [(a.request.request_id, a.instance.instance_id) for a in by_heap] == [
        (a.request.request_id, a.instance.instance_id) for a in by_scan
    ]
