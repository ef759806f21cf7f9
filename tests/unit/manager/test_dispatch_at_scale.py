"""Balanced dispatch at fleet scale: plain training requests find their instance through a heap
per version and expected length, and stragglers their new instance without weighing every pair;
whatever the fleet's rates, load, saturation and the queue, each goes exactly where the scan over
every open instance (every pair) sends it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from services.manager.domain.dispatch_policy import MIGRATION_SPEEDUP
from services.manager.domain.scheduling import MAX_MIGRATIONS, MIGRATION_MIN_SECONDS
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


def migrations_by_definition(parts: DomainParts) -> list[tuple[str, str]]:
    """Straggler migration as scheduling.py defines it, target by target over every request in flight:
    the slow, plain statement that plan_migrations must agree with."""
    instances, table = parts.instances, parts.request_table
    in_flight = [table.requests[r] for i in instances.values() for r in i.running]
    incoming: dict[str, int] = {}
    for request in in_flight:
        if request.migrate_to is not None:
            incoming[request.migrate_to] = incoming.get(request.migrate_to, 0) + 1
    targets = sorted(
        (i for i in instances.values() if i.schedulable and i.sequence_tokens_per_second > 0),
        key=lambda i: -i.sequence_tokens_per_second,
    )
    planned = []
    for target in targets:
        free = target.free_slots - incoming.get(target.instance_id, 0)
        choices = []
        for request in in_flight:
            source = instances[request.instance_id]
            if (
                source is target
                or request.migrate_to is not None
                or request.migrations >= MAX_MIGRATIONS
                or not parts.admission.may_run(target, request)
                or len(source.running) <= len(target.running)
                or source.sequence_tokens_per_second <= 0
                or target.sequence_tokens_per_second < MIGRATION_SPEEDUP * source.sequence_tokens_per_second
            ):
                continue
            seconds_left = request.expected_remaining(table.mean_length) / source.sequence_tokens_per_second
            if seconds_left >= MIGRATION_MIN_SECONDS:
                choices.append((seconds_left, request.request_id, request))
        for _, _, request in sorted(choices, key=lambda c: (c[0], c[1]), reverse=True)[: max(0, free)]:
            request.migrate_to = target.instance_id
            request.migrations += 1
            planned.append((request.request_id, target.instance_id))
    return planned


@settings(max_examples=300, deadline=None)
@given(fleets, st.one_of(st.none(), st.floats(min_value=1.0, max_value=300.0)), st.integers(0, 3))
def test_stragglers_move_where_the_definition_moves_them(fleet, mean_length, generated):
    plans = []
    for by_definition in (False, True):
        parts = build(fleet, [], mean_length, scan=False)
        for request in parts.request_table.requests.values():
            request.token_ids = [1] * generated
        plans.append(
            migrations_by_definition(parts)
            if by_definition
            else [(r.request_id, r.migrate_to) for r in parts.scheduler.plan_migrations()]
        )
    assert plans[0] == plans[1]


def scanned_work(parts: DomainParts) -> tuple[dict[int, set[str]], set[str], dict[str, int]]:
    """What the instances run, by the definition: a pass over every running request."""
    holders: dict[int, set[str]] = {}
    background: set[str] = set()
    oldest: dict[str, int] = {}
    for instance in parts.instances.values():
        for request_id in instance.running:
            request = parts.request_table.requests[request_id]
            if request.exact_version:
                holders.setdefault(request.policy_version, set()).add(instance.instance_id)
            else:
                oldest[instance.instance_id] = min(oldest.get(instance.instance_id, 99), request.policy_version)
            if request.background:
                background.add(instance.instance_id)
    return holders, background, oldest


work_batches = st.lists(
    st.tuples(st.integers(0, 3), st.booleans(), st.booleans(), st.integers(1, 4)),  # version, exact, background, n
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), work_batches, st.lists(st.integers(0, 10_000), max_size=30), st.integers(0, 30))
def test_the_running_work_a_pass_reads_lazily_is_the_scan_of_every_running_request(
    instances, batches, placements, asked_after
):
    parts = DomainParts({f"i{n}": 3 for n in range(instances)}, max_staleness=3)
    for number, (version, exact, background, count) in enumerate(batches):
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=8)
        parts.submit(f"b{number}", version, [(f"p{number}", [1], count)], sampling, exact, background and exact)
    queue = list(parts.request_table.queue)
    instance_ids = sorted(parts.instances)
    # Some requests run before the pass; the rest start during it, the work asked about in between.
    before, during = placements[: len(placements) // 2], placements[len(placements) // 2 :]
    started = 0
    for placement in before:
        if started < len(queue):
            parts.request_table.start(queue[started], parts.instances[instance_ids[placement % instances]])
            started += 1
    work = parts.scheduler.running_work()
    for step, placement in enumerate(during):
        if step == asked_after:
            for instance in parts.instances.values():
                work.oldest_version(instance)
        if started < len(queue):
            instance = parts.instances[instance_ids[placement % instances]]
            parts.request_table.start(queue[started], instance)
            work.started(queue[started], instance.instance_id)
            started += 1
    holders, background, oldest = scanned_work(parts)
    assert (work.holders, work.background) == (holders, background)
    for instance in parts.instances.values():
        assert work.oldest_version(instance) == oldest.get(instance.instance_id)
