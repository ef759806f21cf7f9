"""How the journal learns what changed: assigning a journaled field marks its record, a record
entering or leaving its collection marks it added or removed, and nothing else marks."""

from rlmesh.common.v1 import common_pb2
from services.manager.domain.journaled import BATCH, INSTANCE, REQUEST, ChangeTracker, Records
from services.manager.domain.records import Batch, Instance, SampleRequest


def request(request_id: str = "b/p/0") -> SampleRequest:
    return SampleRequest(request_id, "b", "p", [1], common_pb2.SamplingParams(max_tokens=4), 0)


def test_a_journaled_field_marks_its_record_when_its_value_changes():
    tracker = ChangeTracker()
    requests: Records[SampleRequest] = Records(tracker, REQUEST)
    sample = request()
    requests[sample.request_id] = sample
    assert tracker.take().added[REQUEST] == {"b/p/0"}
    sample.attempt = 0  # unchanged
    sample.charged = 3.0  # not journaled
    sample.migrate_to = "x"  # not journaled
    assert not tracker.take()
    sample.attempt += 1
    assert tracker.take().written[REQUEST] == {"b/p/0"}
    # A list grows in place before `+=` assigns it back: that assignment marks.
    sample.token_ids += [5]
    changed = tracker.take()
    assert changed.written[REQUEST] == {"b/p/0"} and not changed.added[REQUEST]
    sample.instance_ids = list(sample.instance_ids)  # the same values
    assert not tracker.take()


def test_records_leaving_their_collection_are_marked_removed_and_mark_nothing_after():
    tracker = ChangeTracker()
    instances: Records[Instance] = Records(tracker, INSTANCE)
    instance = Instance("a", "h:1", 0, 4, lease_expires=10, min_version=0)
    instances["a"] = instance
    tracker.take()
    instance.lease_expires = 20  # not journaled
    instance.draining = True
    assert tracker.take().written[INSTANCE] == {"a"}
    del instances["a"]
    instance.weight_version = 3
    changed = tracker.take()
    assert changed.removed[INSTANCE] == {"a"} and not changed.written[INSTANCE]
    assert instances.pop("a", None) is None and not tracker.take()


def test_restored_records_are_attached_but_not_marked():
    tracker = ChangeTracker()
    batches: Records[Batch] = Records(tracker, BATCH)
    batch = Batch("b", 0, {"p": [request()]})
    batches.restore([batch])
    assert batches["b"] is batch and not tracker.take()
    batch.sent += ["p"]
    assert tracker.take().written[BATCH] == {"b"}


def test_a_failed_write_puts_its_changes_back():
    tracker = ChangeTracker()
    tracker.added(REQUEST, "r")
    taken = tracker.take()
    tracker.written(BATCH, "b")
    tracker.put_back(taken)
    changed = tracker.take()
    assert changed.added[REQUEST] == {"r"} and changed.written[REQUEST] == {"r"} and changed.written[BATCH] == {"b"}
