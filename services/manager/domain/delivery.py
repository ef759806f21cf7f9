"""Delivery: batches of groups in stream order, the micro-batches a reader takes (resent from any
position it resumes at), and acknowledgement; delivered batches' timings stay for the balance."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from rlmesh.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from rlmesh.micro_batch import group_tokens, pack, trajectory_tokens
from services.manager.domain.journaled import Records
from services.manager.domain.records import Batch, SampleRequest
from services.manager.domain.request_table import RequestTable

if TYPE_CHECKING:
    from services.manager.domain.sessions import Session

FINISHED_BATCHES_KEPT = 64
Taken = tuple[list[list[SampleRequest]], int]
"""Groups, and how many of the batch are still to come after them."""


def group_size(group: list[SampleRequest]) -> int:
    return group_tokens(len(group[0].prompt_token_ids), (r.token_count for r in group))


def session_group_size(group: list[SampleRequest], sessions: Mapping[str, Session]) -> int:
    """A group of multi-turn sessions weighs what its trajectories train as: every part of a
    broken history, its context and its response (a sample slot holds only the last part)."""
    return sum(
        trajectory_tokens(sessions[r.request_id].segments)
        if r.request_id in sessions
        else len(r.prompt_token_ids) + r.token_count
        for r in group
    )


class Delivery:
    def __init__(
        self,
        batches: Records[Batch],
        request_table: RequestTable,
        sessions: Mapping[str, Session],
        clock: Callable[[], float],
    ) -> None:
        self.batches = batches
        self.request_table = request_table
        self.sessions = sessions
        """The sessions by id, whose trajectories a session batch's groups are weighed by."""
        self.clock = clock
        self.delivered_groups = 0
        self.finished: dict[str, tuple[float, float, int]] = {}
        """Delivered batches: submission time, completion time, response tokens (for the balance)."""

    def restore(self, batches: Iterable[Batch]) -> None:
        """A restored batch's complete groups not sent before are ready again."""
        batches = list(batches)
        self.batches.restore(batches)
        for batch in batches:
            sent = set(batch.sent)
            batch.ready.extend(p for p, group in batch.groups.items() if p not in sent and all(r.done for r in group))

    def take_micro_batch(
        self,
        batch_id: str,
        groups: int,
        min_groups: int | None = None,
        max_tokens: int = 0,
        position: int | None = None,
    ) -> Taken | None:
        """The micro-batch at `position` of the batch's stream order (default: after every group
        sent). Below the groups sent so far it is those groups again, as many as fit; at the end
        it is between `min_groups` (default: `groups`) and `groups` complete groups, fewer only
        for the batch's last micro-batch, within a budget of `max_tokens` prompt + response
        tokens (0: none; see rlmesh.micro_batch). None while fewer than the lower bound are ready."""
        if groups < 1:
            raise InvalidArgument("micro_batch_groups must be at least 1")
        lower = groups if not min_groups else min_groups
        if lower > groups:
            raise InvalidArgument(f"min_groups ({lower}) exceeds micro_batch_groups ({groups})")
        if max_tokens < 0:
            raise InvalidArgument("max_tokens must be >= 0")
        batch = self._deliverable(batch_id)
        position = self._position(batch, position)
        if position < len(batch.sent):
            return self._resend(batch, position, groups, max_tokens)
        want = min(lower, batch.remaining)
        if want and len(batch.ready) < want:
            return None
        return self._take(batch, groups, max_tokens)

    def take_ready(self, batch_id: str, position: int | None = None) -> Taken:
        """From `position` on: the groups sent before and every complete group ready now, possibly none."""
        batch = self._deliverable(batch_id)
        position = self._position(batch, position)
        again, _ = self._resend(batch, position, len(batch.sent), 0)
        taken, remaining = self._take(batch, len(batch.ready), 0)
        return again + taken, remaining

    @staticmethod
    def _position(batch: Batch, position: int | None) -> int:
        if position is None:
            return len(batch.sent)
        if not 0 <= position <= len(batch.sent):
            raise InvalidArgument(
                f"resume_from {position} is past the {len(batch.sent)} groups of batch {batch.batch_id!r} sent so far"
            )
        return position

    def _deliverable(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was acknowledged")
        if batch.error:
            self.forget(batch)
            if batch.version_gone:
                raise OutOfRange(f"batch {batch_id!r} failed: {batch.error}")
            raise InvalidArgument(f"batch {batch_id!r} failed: {batch.error}")
        return batch

    def _resend(self, batch: Batch, position: int, most: int, max_tokens: int) -> Taken:
        again = pack([batch.groups[p] for p in batch.sent[position:]], most, max_tokens, self._sizer(batch))
        return again, len(batch.groups) - position - len(again)

    def _take(self, batch: Batch, most: int, max_tokens: int) -> Taken:
        taken = pack([batch.groups[p] for p in batch.ready], most, max_tokens, self._sizer(batch))
        if taken:
            batch.sent += [batch.ready.popleft() for _ in taken]
        self.delivered_groups += len(taken)
        if batch.remaining == 0 and taken:
            self._delivered(batch)
        return taken, batch.remaining

    def _sizer(self, batch: Batch) -> Callable[[list[SampleRequest]], int]:
        """What a group of the batch weighs against a budget."""
        if not batch.sessions:
            return group_size
        return lambda group: session_group_size(group, self.sessions)

    def _delivered(self, batch: Batch) -> None:
        """Every group was sent: the timing the stage balance needs is kept after the batch is forgotten."""
        self.finished[batch.batch_id] = (batch.submitted_at, batch.completed_at or self.clock(), batch.response_tokens)
        while len(self.finished) > FINISHED_BATCHES_KEPT:
            del self.finished[next(iter(self.finished))]
        unacknowledged = [b for b in self.batches.values() if b.remaining == 0]
        for stale in unacknowledged[:-FINISHED_BATCHES_KEPT]:
            self.forget(stale)

    def acknowledge(self, batch_id: str) -> bool:
        """The reader holds every group of the batch: forget it. False when it was not known."""
        batch = self.batches.get(batch_id)
        if batch is None:
            return False
        if batch.remaining:
            raise FailedPrecondition(f"batch {batch_id!r} has {batch.remaining} groups still to be sent")
        self.forget(batch)
        return True

    def cancel(self, batch_id: str) -> int:
        """Drops a batch nobody will read (its trainer stopped); returns its unfinished samples."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown or was acknowledged")
        unfinished = batch.unfinished
        self.forget(batch)
        return unfinished

    def forget(self, batch: Batch) -> None:
        del self.batches[batch.batch_id]
        self.request_table.forget(batch)

    @property
    def ready_groups(self) -> int:
        return sum(len(b.ready) for b in self.batches.values())
