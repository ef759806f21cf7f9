"""Multi-turn sessions: each one trajectory held as one canonical token stream of segments, its turns
run as sample requests through the request table, its limits and deadlines, and the group slot it fills."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import replace

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.admission import per_sample_sampling
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.journaled import SESSION, ChangeTracker, Records
from services.manager.domain.records import (
    CLOSING_STATUSES,
    DEADLINE,
    ENVIRONMENT,
    ENVIRONMENT_ERROR,
    MODEL,
    OPEN,
    TEMPLATE,
    TRUNCATED_CONTEXT,
    TRUNCATED_TURNS,
    Batch,
    Limits,
    SampleRequest,
    Segment,
    Session,
    TurnState,
    stream_of,
)
from services.manager.domain.request_table import RequestTable


class Sessions:
    """Every open and closed session of the batches the manager holds, by session id. Their turns run
    in the request table, which tells how each ends through the hooks its owner points at
    turn_finished, turn_refused, turn_failed and forget."""

    def __init__(
        self,
        tracker: ChangeTracker,
        request_table: RequestTable,
        batches: Mapping[str, Batch],
        clock: Callable[[], float],
    ) -> None:
        self.sessions: Records[Session] = Records(tracker, SESSION)
        self.request_table = request_table
        self.batches = batches
        self.clock = clock
        self.closed_by_status: dict[int, int] = {}
        self.breaks_by_cause: dict[str, int] = {}
        """Parts started, by the cause their caller named ("unnamed" when it named none)."""
        self.turn_ended: Callable[[str], None] = lambda session_id: None
        """Told the session id whenever a session's running turn ends (finished, or cut by its close)."""
        self.forgotten: Callable[[list[str]], None] = lambda session_ids: None
        """Told the ids of the sessions forgotten with their batch."""

    def open(self, batch: Batch, limits: Limits) -> list[Session]:
        """A session per sample slot of a session batch just admitted; each begins with its prompt's
        tokens as an environment segment."""
        now = self.clock()
        opened = []
        for prompt_id, group in batch.groups.items():
            for slot in group:
                segments = [Segment(ENVIRONMENT, list(slot.prompt_token_ids))] if slot.prompt_token_ids else []
                session = Session(
                    slot.request_id,
                    batch.batch_id,
                    prompt_id,
                    secrets.token_hex(16),
                    slot.sampling,
                    batch.policy_version,
                    limits,
                    segments,
                    opened_at=now,
                    idle_since=now,
                )
                self.sessions[session.session_id] = session
                opened.append(session)
        return opened

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(
                f"session {session_id!r} is unknown (never opened, or its batch was delivered and acknowledged)"
            )
        return session

    def start(self, session_id: str) -> Session:
        """The session's episode begins: one opened to wait for it (limits.wait_for_start) has its
        deadlines run from now; starting it again changes nothing."""
        session = self.get(session_id)
        if session.is_open and session.limits.wait_for_start:
            session.limits = replace(session.limits, wait_for_start=False)
            session.opened_at = session.idle_since = self.clock()
        return session

    def run_turn(
        self,
        session_id: str,
        turn: int,
        append: list[Segment],
        keep_tokens: int | None,
        sampling: common_pb2.SamplingParams | None,
        conversation: list[LoggedMessage] | None = None,
    ) -> TurnState:
        """Starts turn `turn` (queued in the request table), or tells where a turn already asked for stands.
        `conversation`: the gateway's record of the messages before it, kept with the turn."""
        session = self.start(session_id)
        if turn == session.turns - 1:
            differs = self._asked_otherwise(session, turn, append, keep_tokens)
            if differs:
                raise FailedPrecondition(
                    f"session {session_id!r}: turn {turn} was asked for with {differs}: a retried call must ask "
                    f"for the same turn, and the next is turn {session.turns}"
                )
            return self.turn_state(session, turn)
        if turn != session.turns:
            raise FailedPrecondition(
                f"session {session_id!r} has run {session.turns} turns: the next is turn {session.turns}, not {turn}"
            )
        if not session.is_open:
            return TurnState(session.status, stream_tokens=len(session.part_tokens()))
        batch = self.batches.get(session.batch_id)
        if batch is not None and batch.error:
            raise FailedPrecondition(f"session {session_id!r}: its batch failed: {batch.error}")
        segments = self._appended(session, append, keep_tokens, turn)
        limits = session.limits
        if limits.max_turns and turn >= limits.max_turns:
            self.close(session, TRUNCATED_TURNS, f"max_turns ({limits.max_turns}) were run", settle=False)
            return TurnState(session.status, stream_tokens=len(session.part_tokens()))
        stream = stream_of(session.segments + segments)
        if not stream:
            raise InvalidArgument(f"session {session_id!r}: turn {turn} has no tokens to generate from: append some")
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling if sampling is not None else session.sampling)
        if limits.max_total_tokens:
            room = limits.max_total_tokens - len(stream)
            if room <= 0:
                self.close(
                    session,
                    TRUNCATED_CONTEXT,
                    f"turn {turn} would start at {len(stream)} tokens, max_total_tokens is {limits.max_total_tokens}",
                    settle=False,
                )
                return TurnState(session.status, stream_tokens=len(session.part_tokens()))
            params.max_tokens = min(params.max_tokens, room)
        now = self.clock()
        session.segments += segments
        if segments and segments[0].starts_part:
            cause = segments[0].break_cause or "unnamed"
            self.breaks_by_cause[cause] = self.breaks_by_cause.get(cause, 0) + 1
        session.environment_seconds += max(0.0, now - session.idle_since)
        session.turns = turn + 1
        session.turn_started = None
        if conversation:
            session.conversation = conversation
        request = SampleRequest(
            f"{session_id}#{turn}",
            session.batch_id,
            session.prompt_id,
            stream,
            per_sample_sampling(params, session_id.replace("/", ":"), turn),
            session.policy_version,
            session_id=session_id,
            affinity=session.last_instance,
        )
        session.turn = request
        self.request_table.add_turn(request)
        return TurnState(OPEN, running=request)

    def turn_state(self, session: Session, turn: int) -> TurnState:
        """A turn asked for before: still running, finished with its segment, or cut by the session's end."""
        if session.turn is not None and turn == session.turns - 1:
            return TurnState(OPEN, running=session.turn)
        segment = session.turn_segment(turn)
        return TurnState(session.status, segment=segment, stream_tokens=len(session.part_tokens()))

    def _asked_otherwise(self, session: Session, turn: int, append: list[Segment], keep_tokens: int | None) -> str:
        """How a call for a turn already started asks for it otherwise than the call that started it
        ("" when it asks for the same: a retry): other segments to append or another keep_tokens."""
        started = [s for s in session.segments if s.turn == turn and s.source != MODEL]
        slot = self._slot(session)
        if turn == 0 and started and started[0] is session.segments[0] and slot is not None and slot.prompt_token_ids:
            started = started[1:]  # the prompt the session opened with
        asked = [(s.source, list(s.token_ids)) for s in append if s.token_ids]
        if asked != [(s.source, s.token_ids) for s in started]:
            return (
                f"other segments to append ({sum(len(t) for _, t in asked)} tokens; it started with "
                f"{sum(len(s.token_ids) for s in started)})"
            )
        kept = started[0].reused_prefix_tokens if started and started[0].starts_part else None
        if kept != keep_tokens:
            return f"keep_tokens {keep_tokens} (it started with {kept})"
        return ""

    @staticmethod
    def _appended(session: Session, append: list[Segment], keep_tokens: int | None, turn: int) -> list[Segment]:
        """The caller's segments, validated, the first starting a new part (with the break's cause the
        caller named) when the history was edited."""
        for index, segment in enumerate(append):
            if segment.source not in (ENVIRONMENT, TEMPLATE):
                raise InvalidArgument(
                    f"append[{index}]: source must be ENVIRONMENT or TEMPLATE: only the engine adds model tokens"
                )
            if segment.logprobs or segment.weight_versions or segment.instance_ids or segment.starts_part:
                raise InvalidArgument(
                    f"append[{index}]: logprobs, weight_versions, instance_ids and starts_part belong to model "
                    f"segments and breaks; leave them empty"
                )
            if segment.break_cause and (keep_tokens is None or len(segment.break_cause) > 64):
                raise InvalidArgument(
                    f"append[{index}]: break_cause names why a history broke: give it with keep_tokens, in at "
                    f"most 64 characters"
                )
        segments = [Segment(s.source, list(s.token_ids), turn=turn) for s in append if s.token_ids]
        if keep_tokens is None:
            return segments
        stream = session.part_tokens()
        if keep_tokens > len(stream):
            raise InvalidArgument(
                f"keep_tokens {keep_tokens} exceeds the {len(stream)} tokens of session {session.session_id!r}"
            )
        if not segments:
            raise InvalidArgument("keep_tokens (an edited history) needs segments to append after the kept tokens")
        segments[0].starts_part = True
        segments[0].reused_prefix_tokens = keep_tokens
        segments[0].break_cause = next((s.break_cause for s in append if s.break_cause), "")
        return segments

    def turn_finished(self, request: SampleRequest) -> None:
        """The request table finished a turn: its tokens become the session's model segment."""
        session = self.sessions.get(request.session_id)
        self.request_table.requests.pop(request.request_id, None)
        if session is None or session.turn is not request:
            return
        turn = session.turns - 1
        session.segments += [
            Segment(
                MODEL,
                list(request.token_ids),
                list(request.logprobs),
                list(request.weight_versions),
                request.finish_reason,
                list(request.instance_ids),
                turn=turn,
            )
        ]
        session.turn = None
        session.idle_since = self.clock()
        if request.instance_ids:
            session.last_instance = request.instance_ids[-1]
        self.turn_ended(session.session_id)

    def turn_refused(self, request: SampleRequest, reason: str) -> None:
        """An instance refused a turn as invalid (what the environment built cannot be generated
        from): the session ends with the error; the batch goes on."""
        session = self.sessions.get(request.session_id)
        if session is not None and session.turn is request:
            self.close(
                session, ENVIRONMENT_ERROR, f"an instance refused turn {session.turns - 1}: {reason}", settle=False
            )

    def turn_failed(self, request: SampleRequest, reason: str) -> None:
        """A turn failed attempt after attempt (an error on every instance it tried, such as running
        out of memory on a long context): the session ends with the error; the batch goes on."""
        session = self.sessions.get(request.session_id)
        if session is not None and session.turn is request:
            self.close(
                session,
                ENVIRONMENT_ERROR,
                f"turn {session.turns - 1} failed {request.failures_in_a_row} times in a row "
                f"on {len(request.failed_on)} instances: {reason}",
                settle=False,
            )

    def set_reward(self, session_id: str, reward: float, turn: int | None) -> None:
        session = self.get(session_id)
        if reward != reward or abs(reward) == float("inf"):
            raise InvalidArgument(f"session {session_id!r}: reward must be a finite number, got {reward}")
        if self.settled(session):
            raise FailedPrecondition(
                f"session {session_id!r} was closed ({manager_pb2.SessionStatus.Name(session.status)}) and its "
                f"group may be delivered: no reward is taken after its close"
            )
        if turn is None:
            session.reward = reward
            return
        if turn >= session.turns:
            raise InvalidArgument(f"session {session_id!r} has run {session.turns} turns: no turn {turn} to reward")
        session.turn_rewards = {**session.turn_rewards, turn: reward}

    def close(self, session: Session, status: int, detail: str = "", settle: bool = True) -> SampleRequest | None:
        """Ends an open session (its running turn is dropped); returns the dropped turn, to cancel on
        its instance. A closed session keeps its first status. `settle`: its group slot is done too.
        The manager ends a session itself (a limit, a turn refused or failing) without settling it:
        its episode may still be scoring what it did, and its owner's close settles it."""
        if status not in CLOSING_STATUSES:
            given = manager_pb2.SessionStatus.Name(status) if status in manager_pb2.SessionStatus.values() else status
            raise InvalidArgument(
                f"status must be one of {sorted(manager_pb2.SessionStatus.Name(s) for s in CLOSING_STATUSES)}, "
                f"got {given}"
            )
        dropped = None
        if session.is_open:
            dropped = session.turn
            if dropped is not None:
                self.request_table.drop_turn(dropped)
                session.turn = None
            session.status = status
            session.detail = detail
            session.idle_since = self.clock()
            self.closed_by_status[status] = self.closed_by_status.get(status, 0) + 1
            self.turn_ended(session.session_id)
        if settle:
            self._settle(session)
        return dropped

    def _slot(self, session: Session) -> SampleRequest | None:
        batch = self.batches.get(session.batch_id)
        if batch is None:
            return None
        return next(r for r in batch.groups[session.prompt_id] if r.request_id == session.session_id)

    def settled(self, session: Session) -> bool:
        """Closed and its group slot done: what it holds may be delivered."""
        slot = self._slot(session)
        return not session.is_open and (slot is None or slot.done)

    def _settle(self, session: Session) -> None:
        slot = self._slot(session)
        if slot is None or slot.done:
            return
        slot.token_ids = stream_of(session.segments)[len(slot.prompt_token_ids) :]
        slot.finish_reason = common_pb2.FINISH_REASON_STOP
        self.batches[session.batch_id].sample_finished(session.prompt_id, self.clock())

    def reap(self, now: float) -> list[tuple[Session, SampleRequest | None]]:
        """Closes the open sessions past a deadline (whole session, the running turn's, or the
        environment step's since the last turn), and settles those the manager ended whose owner
        did not close them within the step deadline: a session nobody closes frees its capacity."""
        reaped = []
        for session in list(self.sessions.values()):
            if not session.is_open:
                if not self.settled(session) and deadline_passed(session, now):
                    self._settle(session)
                    reaped.append((session, None))
                continue
            if session.turn is not None and session.turn_started is None and session.turn.attempt:
                session.turn_started = now
            why = deadline_passed(session, now)
            if why:
                reaped.append((session, self.close(session, DEADLINE, why)))
        return reaped

    def forget(self, batch: Batch) -> None:
        """The batch was acknowledged or cancelled: its sessions go, with any turn still running."""
        forgotten = []
        for group in batch.groups.values():
            for slot in group:
                session = self.sessions.pop(slot.request_id, None)
                if session is None:
                    continue
                forgotten.append(session.session_id)
                if session.turn is not None:
                    self.request_table.drop_turn(session.turn)
        if forgotten:
            self.forgotten(forgotten)

    def restore(self, sessions: list[Session], turns: list[SampleRequest]) -> None:
        """Takes over what the journal kept; deadlines count again from now (the old clock is gone),
        and each turn that was running continues from its tokens."""
        now = self.clock()
        self.sessions.restore(sessions)
        running = {t.session_id: t for t in turns}
        for session in sessions:
            session.opened_at = session.idle_since = now
            turn = running.get(session.session_id)
            if turn is not None and session.is_open:
                session.turn = turn
                self.request_table.add_turn(turn, restored=True)

    @property
    def open_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.is_open)


def deadline_passed(session: Session, now: float) -> str:
    """Which of the session's deadlines passed ("" if none)."""
    limits = session.limits
    if limits.wait_for_start:
        return ""
    if limits.session_deadline_seconds and now - session.opened_at > limits.session_deadline_seconds:
        return f"open for more than session_deadline_seconds ({limits.session_deadline_seconds:g})"
    if session.turn is not None:
        started = session.turn_started
        if limits.turn_deadline_seconds and started is not None and now - started > limits.turn_deadline_seconds:
            return (
                f"turn {session.turns - 1} generated for more than turn_deadline_seconds "
                f"({limits.turn_deadline_seconds:g})"
            )
    elif limits.step_deadline_seconds and now - session.idle_since > limits.step_deadline_seconds:
        return (
            f"no call for more than step_deadline_seconds ({limits.step_deadline_seconds:g}) after turn "
            f"{session.turns - 1 if session.turns else 'opening'}"
        )
    return ""
