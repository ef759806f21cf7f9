"""A relay shard's payloads: every request's tokens, logprobs and versions, in the order its attempts
ran, with the cumulative progress the shard reports to the manager's ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import relay_pb2
from services.manager.domain.records import FINISHED

CANCELLED = 1
"""grpc.StatusCode.CANCELLED's number: the code an attempt ends with when its stream drops it."""
MALFORMED = "the instance sent a malformed chunk: token, logprob and version counts differ"


class PayloadMissing(LookupError):
    """The manager's ledger counts tokens this shard does not hold (it restarted since)."""


@dataclass(slots=True)
class Payload:
    request_id: str
    attempt: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    ended: bool = False
    code: int = 0
    message: str = ""
    continued_from: int = 0

    @property
    def running(self) -> bool:
        return not self.ended and self.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED

    def progress(self) -> relay_pb2.RelayProgress:
        return relay_pb2.RelayProgress(
            request_id=self.request_id,
            attempt=self.attempt,
            token_count=len(self.token_ids),
            first_version=self.weight_versions[0] if self.weight_versions else 0,
            last_version=self.weight_versions[-1] if self.weight_versions else 0,
            finish_reason=self.finish_reason,
            ended=self.ended,
            code=self.code,
            message=self.message,
            continued_from=self.continued_from,
        )


class PayloadLog(Protocol):
    """Where a store's changes are written as they happen (payload_journal.py)."""

    def started(self, payload: Payload) -> None: ...

    def appended(self, request_id: str, token_ids, logprobs, weight_versions) -> None: ...

    def finished(self, payload: Payload) -> None: ...

    def released(self, request_id: str) -> None: ...

    def flush(self) -> None: ...


class PayloadStore:
    """A request's tokens only grow, in the order its attempts ran: an attempt starts after every
    token the shard holds (a drained instance's last tokens may reach the shard after the manager
    requeued the request, and are kept), and once a newer attempt starts, an older one's chunks
    are dropped. The ledger's count trails what the shard holds and catches up with each report."""

    def __init__(self, journal: PayloadLog | None = None, payloads: dict[str, Payload] | None = None) -> None:
        self.journal = journal
        self.payloads: dict[str, Payload] = payloads if payloads is not None else {}
        self._urgent: set[str] = set()
        """Requests whose attempt finished or ended since the last report: the manager waits on these."""
        self._changed: set[str] = set()
        self.accepted_tokens = 0
        """Tokens taken from instances since the shard started."""

    def start(self, request_id: str, attempt: int, continue_from: int, max_tokens: int) -> list[int] | None:
        """Makes `attempt` the request's current one; returns the tokens it continues after, or
        None when those already reach max_tokens (the attempt is then finished, by length)."""
        payload = self.payloads.get(request_id)
        if payload is None:
            if continue_from:
                raise PayloadMissing(f"{request_id}: the ledger counts {continue_from} tokens this shard does not hold")
            payload = self.payloads[request_id] = Payload(request_id, attempt, max_tokens)
        elif len(payload.token_ids) < continue_from:
            raise PayloadMissing(
                f"{request_id}: the ledger counts {continue_from} tokens, this shard holds {len(payload.token_ids)}"
            )
        if payload.finish_reason in FINISHED:
            # It finished before the manager heard (the manager restarted since): the new attempt
            # finishes at once with it; nothing is generated past its end.
            payload.attempt, payload.continued_from = attempt, len(payload.token_ids)
            if self.journal is not None:
                self.journal.started(payload)
            self._finished(payload)
            return None
        payload.attempt, payload.max_tokens, payload.continued_from = attempt, max_tokens, len(payload.token_ids)
        payload.finish_reason, payload.ended, payload.code, payload.message = (
            common_pb2.FINISH_REASON_UNSPECIFIED,
            False,
            0,
            "",
        )
        if self.journal is not None:
            self.journal.started(payload)
        if len(payload.token_ids) >= max_tokens:
            payload.finish_reason = common_pb2.FINISH_REASON_LENGTH
            self._finished(payload)
            return None
        return list(payload.token_ids)

    def _finished(self, payload: Payload) -> None:
        if self.journal is not None:
            self.journal.finished(payload)
        self._urgent.add(payload.request_id)

    def current(self, request_id: str, attempt: int) -> Payload | None:
        payload = self.payloads.get(request_id)
        if payload is None or payload.attempt != attempt or not payload.running:
            return None
        return payload

    def record(self, request_id: str, attempt: int, chunk: common_pb2.TokenChunk) -> bool:
        """Appends a chunk of the request's current attempt; False when the stream is not to go on
        with it (an abandoned attempt's chunk, dropped, or a malformed one, which ends the attempt)."""
        payload = self.current(request_id, attempt)
        if payload is None:
            return False
        count = len(chunk.token_ids)
        if not (count == len(chunk.logprobs) == len(chunk.weight_versions)):
            # As the manager treats a malformed chunk: the attempt ends, the request continues elsewhere.
            self.end(request_id, attempt, common_pb2.FINISH_REASON_UNSPECIFIED, CANCELLED, MALFORMED)
            return False
        accepted = max(0, min(count, payload.max_tokens - len(payload.token_ids)))
        token_ids, logprobs = chunk.token_ids[:accepted], chunk.logprobs[:accepted]
        weight_versions = chunk.weight_versions[:accepted]
        if self.journal is not None and accepted:
            self.journal.appended(request_id, token_ids, logprobs, weight_versions)
        payload.token_ids += token_ids
        payload.logprobs += logprobs
        payload.weight_versions += weight_versions
        self.accepted_tokens += accepted
        self._changed.add(request_id)
        if chunk.finish_reason in FINISHED or len(payload.token_ids) >= payload.max_tokens:
            payload.finish_reason = (
                chunk.finish_reason if chunk.finish_reason in FINISHED else common_pb2.FINISH_REASON_LENGTH
            )
            self._finished(payload)
        elif chunk.finish_reason == common_pb2.FINISH_REASON_ABORT:
            payload.finish_reason = common_pb2.FINISH_REASON_ABORT
            self._urgent.add(request_id)
        return True

    def end(self, request_id: str, attempt: int, finish_reason: int, code: int, message: str) -> None:
        """The attempt ended without finishing: refused, its stream failed or its chunk was malformed."""
        payload = self.current(request_id, attempt)
        if payload is None:
            return
        payload.ended, payload.finish_reason, payload.code, payload.message = True, finish_reason, code, message
        self._urgent.add(request_id)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.payloads.pop(request_id, None) is not None and self.journal is not None:
                self.journal.released(request_id)
            self._changed.discard(request_id)
            self._urgent.discard(request_id)

    @property
    def has_urgent(self) -> bool:
        return bool(self._urgent)

    def take_reports(self, running_too: bool) -> list[relay_pb2.RelayProgress]:
        """Cumulative progress of the attempts that finished or ended since the last call and, with
        `running_too`, of every other request that grew since its last report; the journal holds
        all of it first."""
        if self.journal is not None:
            self.journal.flush()
        names, self._urgent = self._urgent, set()
        self._changed -= names
        if running_too:
            names, self._changed = names | self._changed, set()
        return [self.payloads[name].progress() for name in names if name in self.payloads]

    def snapshot(self) -> list[relay_pb2.RelayProgress]:
        if self.journal is not None:
            self.journal.flush()
        return [payload.progress() for payload in self.payloads.values()]

    def fetch(self, request_id: str, token_count: int) -> relay_pb2.RelayedSample:
        payload = self.payloads.get(request_id)
        if payload is None:
            raise LookupError(f"{request_id}: this shard holds no payload of it")
        if payload.finish_reason not in FINISHED:
            raise ValueError(f"{request_id}: not finished on this shard")
        if len(payload.token_ids) != token_count:
            raise ValueError(f"{request_id}: the shard holds {len(payload.token_ids)} tokens, the ledger {token_count}")
        return relay_pb2.RelayedSample(
            request_id=request_id,
            token_ids=payload.token_ids,
            logprobs=payload.logprobs,
            weight_versions=payload.weight_versions,
        )
