"""A relay shard's payloads: a request's tokens only grow, in the order its attempts ran; a chunk of
an attempt a newer one superseded is dropped; an attempt continues after everything the shard holds;
and a shard restarted on its journal holds exactly what it reported, every unfinished attempt ended."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from services.manager.domain.records import FINISHED
from services.manager.relay.payload_journal import RESTARTED, PayloadJournal
from services.manager.relay.payloads import PayloadMissing, PayloadStore

STOP, ABORT, NONE = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_UNSPECIFIED


def chunk(tokens: list[int], version: int = 3, finish: int = NONE) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(
        token_ids=tokens,
        logprobs=[-0.5 - t / 8 for t in tokens],
        weight_versions=[version] * len(tokens),
        finish_reason=finish,
    )


def test_an_attempt_continues_after_every_token_held_and_a_superseded_one_is_dropped():
    store = PayloadStore()
    assert store.start("r", 1, 0, 10) == []
    assert store.record("r", 1, chunk([1, 2, 3]))
    # The manager requeued the request at 1 token (its last report), the instance handed back 3.
    assert store.start("r", 2, 1, 10) == [1, 2, 3]
    assert not store.record("r", 1, chunk([9], finish=ABORT)), "a superseded attempt's chunk is kept"
    assert store.record("r", 2, chunk([4, 5], finish=STOP))
    sample = store.fetch("r", 5)
    assert list(sample.token_ids) == [1, 2, 3, 4, 5] and list(sample.weight_versions) == [3] * 5
    [report] = store.take_reports(running_too=False)
    assert (report.attempt, report.token_count, report.finish_reason, report.continued_from) == (2, 5, STOP, 3)


def test_a_request_that_finished_before_the_manager_heard_is_not_continued_past_its_end():
    store = PayloadStore()
    store.start("r", 1, 0, 10)
    store.record("r", 1, chunk([1, 2], finish=STOP))
    store.take_reports(running_too=False)
    # A restarted manager's journal had the request at 1 token, running.
    assert store.start("r", 2, 1, 10) is None
    [report] = store.take_reports(running_too=False)
    assert (report.attempt, report.token_count, report.finish_reason) == (2, 2, STOP)


def test_the_ledger_counting_more_than_the_shard_holds_is_a_lost_payload():
    store = PayloadStore()
    with pytest.raises(PayloadMissing, match="does not hold"):
        store.start("r", 2, 4, 10)


def test_max_tokens_cut_a_chunk_and_finish_the_attempt():
    store = PayloadStore()
    store.start("r", 1, 0, 4)
    assert store.record("r", 1, chunk([1, 2, 3, 4, 5, 6]))
    assert list(store.fetch("r", 4).token_ids) == [1, 2, 3, 4]
    assert store.start("r", 2, 4, 4) is None, "an attempt with nothing left to generate"


def test_a_malformed_chunk_ends_the_attempt_and_keeps_nothing_of_it():
    store = PayloadStore()
    store.start("r", 1, 0, 10)
    bad = common_pb2.TokenChunk(token_ids=[1, 2], logprobs=[-1.0], weight_versions=[0, 0])
    assert not store.record("r", 1, bad)
    [report] = store.take_reports(running_too=False)
    assert report.ended and report.token_count == 0 and "malformed" in report.message


def test_running_counts_wait_for_the_progress_period_and_finishes_do_not():
    store = PayloadStore()
    store.start("a", 1, 0, 10)
    store.start("b", 1, 0, 10)
    store.record("a", 1, chunk([1]))
    store.record("b", 1, chunk([1], finish=STOP))
    assert [r.request_id for r in store.take_reports(running_too=False)] == ["b"]
    assert [r.request_id for r in store.take_reports(running_too=True)] == ["a"]


operations = st.lists(
    st.tuples(
        st.sampled_from(["start", "chunk", "finish", "release"]),
        st.integers(0, 2),
        st.lists(st.integers(0, 50_000), max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_a_shard_restarted_on_its_journal_holds_what_it_reported(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("journal") / "payloads.log"
    journal = PayloadJournal(path)
    store = PayloadStore(journal, journal.payloads)
    attempts: dict[str, int] = {}
    for op, index, tokens in ops:
        request_id = f"r{index}"
        if op == "start":
            attempts[request_id] = attempts.get(request_id, 0) + 1
            held = len(store.payloads[request_id].token_ids) if request_id in store.payloads else 0
            store.start(request_id, attempts[request_id], held, 12)
        elif op in ("chunk", "finish") and request_id in attempts:
            store.record(request_id, attempts[request_id], chunk(tokens, finish=STOP if op == "finish" else NONE))
        elif op == "release":
            store.release([request_id])
            attempts.pop(request_id, None)
    store.take_reports(running_too=True)
    reported = {
        name: (list(p.token_ids), list(p.logprobs), list(p.weight_versions), p.finish_reason)
        for name, p in store.payloads.items()
    }
    incarnation = journal.incarnation
    journal.close()

    restarted = PayloadJournal(path)
    assert restarted.incarnation == incarnation
    restored = {
        name: (p.token_ids, p.logprobs, p.weight_versions, p.finish_reason) for name, p in restarted.payloads.items()
    }
    assert {name: value[:3] for name, value in restored.items()} == {
        name: value[:3] for name, value in reported.items()
    }
    for name, payload in restarted.payloads.items():
        if reported[name][3] in FINISHED:
            assert payload.finish_reason == reported[name][3] and not payload.ended
        else:
            assert payload.ended and payload.message == RESTARTED
    restarted.close()
    # Compacted on start: a third start reads the same.
    third = PayloadJournal(path)
    assert third.payloads.keys() == restarted.payloads.keys()
    third.close()
