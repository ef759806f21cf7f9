"""The manager's journal: what a flush wrote is what a restarted manager restores, and a restored
state goes on (unfinished requests continue from their tokens, sent groups resend, tokens hold,
exact-version batches stay exact, background ones background); a journal of an earlier format is migrated."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from rlmesh.config import ConfigError
from rlmesh.errors import DomainError, OutOfRange
from services.manager.domain.state import ManagerState
from services.manager.journal import FORMAT, Journal

STOP = common_pb2.FINISH_REASON_STOP
NONE = common_pb2.FINISH_REASON_UNSPECIFIED


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=8, **fields)


def snapshot(state: ManagerState) -> dict:
    """What must survive a restart, in comparable form."""
    return {
        "published": state.published_version,
        "registrations": state.registrations,
        "instances": {
            i.instance_id: (
                i.address,
                i.weight_version,
                i.max_batch_size,
                i.min_version,
                i.incarnation,
                i.token,
                i.preemptible,
                i.draining,
                i.saturation_batch_size,
            )
            for i in state.instances.values()
        },
        "batches": {
            b.batch_id: (
                b.policy_version,
                list(b.groups),
                list(b.sent),
                b.error,
                b.exact_version,
                b.version_gone,
                b.background,
            )
            for b in state.batches.values()
        },
        "requests": {
            r.request_id: (
                r.prompt_token_ids,
                r.sampling.SerializeToString(deterministic=True),
                r.token_ids,
                r.logprobs,
                r.weight_versions,
                r.instance_ids,
                r.finish_reason,
                r.attempt,
                r.exact_version,
                r.background,
            )
            for r in state.requests.values()
        },
    }


def restarted(path, lease_seconds: float = 10.0) -> ManagerState:
    state = ManagerState(lease_seconds=lease_seconds, max_staleness=1)
    journal = Journal(path)
    journal.restore(state, now=100.0)
    journal.close()
    return state


def test_a_restarted_manager_goes_on_from_the_journal(tmp_path):
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=1)
    state.publish(3)
    a, _ = state.register("a", "127.0.0.1:1", 3, 4, now=0, saturation_batch_size=3)
    state.submit("b1", 3, [("p0", [5, 6], 2), ("p1", [7], 2, sampling(seed=9))], sampling())
    journal.flush(state)
    assignments = state.assign()
    assert len(assignments) == 4
    first, second = assignments[0], assignments[1]
    state.record_chunk(first.request.request_id, first.attempt, [1, 2], [-0.5, -0.25], [3, 3], STOP)
    state.record_chunk(second.request.request_id, second.attempt, [4], [-1.0], [3], STOP)
    state.record_chunk(
        assignments[2].request.request_id, assignments[2].attempt, [8, 9], [-0.125, -0.375], [3, 3], NONE
    )
    sent, remaining = state.take_micro_batch("b1", 1)
    assert remaining == 1
    journal.flush(state)
    before = snapshot(state)
    journal.close()

    after = restarted(path)
    assert snapshot(after) == before
    # The live incarnation keeps its token and gets a fresh lease; nothing runs anywhere.
    assert after.instances["a"].token == a.token and after.instances["a"].lease_expires == 110.0
    assert after.instances["a"].running == set()
    # The group sent before resends from position 0; the unfinished requests continue from their tokens.
    again, remaining = after.take_micro_batch("b1", 1, position=0)
    assert [g[0].prompt_id for g in again] == [g[0].prompt_id for g in sent] and remaining == 1
    queued = {r.request_id: r.token_ids for r in after.queue}
    assert queued == {"b1/p1/0": [8, 9], "b1/p1/1": []}
    resumed = after.assign()
    assert {x.request.request_id for x in resumed} == set(queued)
    assert all(x.attempt == before["requests"][x.request.request_id][7] + 1 for x in resumed)


def test_forgotten_batches_and_dropped_instances_leave_the_journal(tmp_path):
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=1)
    state.register("a", "127.0.0.1:1", 0, 4, now=0)
    state.register("b", "127.0.0.1:2", 0, 4, now=0)
    state.submit("done", 0, [("p", [1], 1)], sampling())
    state.submit("cancelled", 0, [("p", [1], 1)], sampling())
    journal.flush(state)
    for assignment in state.assign():
        state.record_chunk(assignment.request.request_id, assignment.attempt, [1], [0.0], [0], STOP)
    state.take_micro_batch("done", 1)
    assert state.acknowledge("done")
    state.cancel_batch("cancelled")
    state.remove("b")
    journal.flush(state)
    journal.close()
    after = restarted(path)
    assert after.batches == {} and after.requests == {} and list(after.instances) == ["a"]
    rows = sqlite3.connect(path).execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    assert rows == 0


@settings(max_examples=40)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["chunk", "finish", "take", "flush", "expire"]), st.integers(0, 7)), max_size=30
    )
)
def test_any_flushed_state_restores_exactly(tmp_path_factory, steps):
    path = tmp_path_factory.mktemp("journal") / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=1)
    state.register("a", "127.0.0.1:1", 0, 2, now=0)
    state.register("b", "127.0.0.1:2", 0, 2, now=0)
    state.submit("b1", 0, [(f"p{i}", [i + 1], 2) for i in range(4)], sampling())
    now = 0.0
    for kind, pick in steps:
        state.assign()
        running = [state.requests[r] for i in state.instances.values() for r in sorted(i.running)]
        if kind in ("chunk", "finish") and running:
            request = running[pick % len(running)]
            state.record_chunk(
                request.request_id, request.attempt, [pick], [-0.5], [0], STOP if kind == "finish" else NONE
            )
        elif kind == "take" and "b1" in state.batches:
            state.take_micro_batch("b1", 1, min_groups=1)
        elif kind == "flush":
            journal.flush(state)
        elif kind == "expire":
            # Instance "a" renews its lease on odd picks; whoever did not is dropped.
            now += 11
            if "a" in state.instances and pick % 2:
                state.heartbeat("a", 0, now, token=state.instances["a"].token)
            state.expire(now)
    journal.flush(state)
    journal.close()
    assert snapshot(restarted(path)) == snapshot(state)


def test_a_journal_of_another_format_or_not_sqlite_is_refused(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ConfigError, match="cannot use it as a SQLite journal"):
        Journal(garbage)
    other = tmp_path / "other.sqlite"
    Journal(other).close()
    with sqlite3.connect(other) as db:
        db.execute("UPDATE counters SET value = 99 WHERE name = 'format'")
    with pytest.raises(ConfigError, match="journal format 99"):
        Journal(other)


def test_exact_version_batches_survive_a_restart_exact_or_failed_and_background(tmp_path):
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=0)
    state.publish(2)
    state.register("old", "127.0.0.1:1", 1, 4, now=0)
    state.register("new", "127.0.0.1:2", 2, 4, now=0)
    state.submit("eval2", 2, [("p", [5], 2)], sampling(), exact_version=True, background=True)
    state.submit("eval0", 0, [("p", [5], 1)], sampling(), exact_version=True)
    running = next(a for a in state.assign() if a.request.batch_id == "eval2")
    state.record_chunk(running.request.request_id, running.attempt, [7], [-0.5], [2], NONE)
    assert state.batches["eval0"].version_gone
    journal.flush(state)
    journal.close()

    after = restarted(path)
    assert snapshot(after) == snapshot(state)
    assert after.batches["eval2"].exact_version and all(r.exact_version for r in after.batches["eval2"].groups["p"])
    assert after.batches["eval2"].background and all(r.background for r in after.batches["eval2"].groups["p"])
    assert not after.batches["eval0"].background
    # The failed batch queues nothing again; the other still runs only on its version's instance.
    assert {r.batch_id for r in after.queue} == {"eval2"}
    assert {a.instance.instance_id for a in after.assign()} == {"new"}
    with pytest.raises(OutOfRange, match="version 0 is no longer served"):
        after.take_micro_batch("eval0", 1)


FORMAT_2_BATCHES = """CREATE TABLE batches (
    batch_id TEXT PRIMARY KEY, policy_version INTEGER NOT NULL, prompt_ids TEXT NOT NULL,
    sent TEXT NOT NULL, error TEXT NOT NULL, submitted INTEGER NOT NULL)"""
FORMAT_2_INSTANCES = """CREATE TABLE instances (
    instance_id TEXT PRIMARY KEY, address TEXT NOT NULL, weight_version INTEGER NOT NULL,
    max_batch_size INTEGER NOT NULL, min_version INTEGER NOT NULL, incarnation INTEGER NOT NULL, token TEXT NOT NULL,
    preemptible INTEGER NOT NULL, draining INTEGER NOT NULL)"""


def test_a_journal_of_the_previous_format_is_migrated(tmp_path):
    path = tmp_path / "journal.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        db.execute("INSERT INTO counters VALUES ('format', 2), ('published_version', 4)")
        db.execute(FORMAT_2_BATCHES)
        db.execute("""INSERT INTO batches VALUES ('b1', 4, '["p"]', '[]', '', 1)""")
        db.execute(FORMAT_2_INSTANCES)
        db.execute("INSERT INTO instances VALUES ('a', '127.0.0.1:1', 4, 8, 4, 1, 'secret', 0, 0)")
    db.close()
    state = restarted(path)
    batch = state.batches["b1"]
    assert (
        state.published_version == 4
        and batch.policy_version == 4
        and not batch.exact_version
        and not batch.version_gone
    )
    assert not batch.background
    instance = state.instances["a"]
    assert (instance.max_batch_size, instance.saturation_batch_size, instance.token) == (8, 0, "secret")
    assert sqlite3.connect(path).execute("SELECT value FROM counters WHERE name = 'format'").fetchone() == (FORMAT,)


def test_a_batch_submitted_again_under_its_id_is_journaled_from_its_new_requests(tmp_path):
    """The journal encodes a request's tokens once and then only what it gained; a batch forgotten
    and submitted again reuses the request ids, and its new requests must not extend the old ones."""
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=1)
    state.register("a", "127.0.0.1:1", 0, 4, now=0)
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    (first,) = state.assign()
    state.record_chunk(first.request.request_id, first.attempt, [1, 2, 3], [-0.5] * 3, [0] * 3, NONE)
    journal.flush(state)
    state.cancel_batch("b1")
    state.submit("b1", 0, [("p", [1], 1)], sampling())
    (again,) = state.assign()
    assert again.request.request_id == first.request.request_id and again.request is not first.request
    state.record_chunk(again.request.request_id, again.attempt, [7, 8, 9, 10], [-0.25] * 4, [0] * 4, NONE)
    journal.flush(state)
    journal.close()
    assert snapshot(restarted(path)) == snapshot(state)
    assert restarted(path).requests["b1/p/0"].token_ids == [7, 8, 9, 10]


KINDS_OF_CHANGE = [
    "chunk",
    "finish",
    "take",
    "publish",
    "drain",
    "renew",
    "refuse",
    "reject",
    "migrate",
    "cancel",
    "expire",
]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(KINDS_OF_CHANGE), st.integers(0, 7)), max_size=30))
def test_every_kind_of_change_reaches_the_journal(tmp_path_factory, steps):
    """Whatever the state went through, what each flush wrote restores it: no mutation is missed."""
    path = tmp_path_factory.mktemp("journal") / "journal.sqlite"
    journal = Journal(path)
    state = ManagerState(lease_seconds=10, max_staleness=1, clock=lambda: 0.0)
    for name in ("a", "b"):
        state.register(name, f"127.0.0.1:{ord(name)}", 0, 2, now=0)
    state.submit("train", 0, [(f"p{i}", [i + 1], 1) for i in range(3)], sampling())
    state.submit("eval", 0, [("q", [9], 2)], sampling(), exact_version=True)
    journal.flush(state)
    now = 0.0
    for kind, pick in steps:
        state.assign()
        running = [state.requests[r] for i in state.instances.values() for r in sorted(i.running)]
        chosen = running[pick % len(running)] if running else None
        names = sorted(state.instances)
        instance = state.instances[names[pick % len(names)]] if names else None
        try:
            if kind in ("chunk", "finish") and chosen:
                state.record_chunk(
                    chosen.request_id,
                    chosen.attempt,
                    [pick],
                    [-0.5],
                    [chosen.policy_version],
                    STOP if kind == "finish" else NONE,
                )
            elif kind == "take" and "train" in state.batches:
                state.take_micro_batch("train", 1, min_groups=1)
            elif kind == "publish" and instance:
                state.heartbeat(instance.instance_id, state.published_version + 1, now, token=instance.token)
                state.publish(state.published_version + 1)
            elif kind == "drain" and instance:
                state.heartbeat(instance.instance_id, instance.weight_version, now, draining=True, token=instance.token)
            elif kind == "renew" and instance:
                state.register(
                    instance.instance_id,
                    instance.address,
                    instance.weight_version,
                    1 + pick % 3,
                    now,
                    token=instance.token,
                )
            elif kind == "refuse" and chosen and chosen.exact_version:
                state.version_refused(chosen.request_id, chosen.attempt)
            elif kind == "reject" and chosen:
                state.reject(chosen.request_id, chosen.attempt, "refused")
            elif kind == "migrate" and instance:
                for other in state.instances.values():
                    other.sequence_tokens_per_second = other.tokens_per_second = 100.0 if other is instance else 1.0
                state.plan_migrations()
            elif kind == "cancel" and "eval" in state.batches:
                state.cancel_batch("eval")
            elif kind == "expire":
                now += 11
                state.expire(now)
                state.register("c", "127.0.0.1:99", state.published_version, 2, now)
        except DomainError:
            pass  # a failed batch read and forgotten, a refused call: changes all the same
        # Checked after every step, so a change that marks nothing shows at once.
        journal.flush(state)
        after = restarted(path)
        assert snapshot(after) == snapshot(state)
        assert {r.request_id: r.migrations for r in after.requests.values()} == {
            r.request_id: r.migrations for r in state.requests.values()
        }
    journal.close()
