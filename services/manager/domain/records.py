"""What the manager keeps: rollout instances, sample requests with their tokens so far, batches of
groups in delivery, and sessions with their segments; the journal writes the fields each declares
JOURNALED."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.journaled import BATCH, INSTANCE, REQUEST, SESSION, ChangeTracker, Journaled

FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


@dataclass(slots=True)
class Instance(Journaled):
    JOURNALED: ClassVar[frozenset[str]] = frozenset(
        {
            "address",
            "weight_version",
            "max_batch_size",
            "saturation_batch_size",
            "min_version",
            "incarnation",
            "token",
            "preemptible",
            "draining",
        }
    )
    KIND: ClassVar[str] = INSTANCE

    instance_id: str
    address: str
    weight_version: int
    """The newest version it is known to serve: the one it reported, or one its chunks carried since."""
    max_batch_size: int
    lease_expires: float
    min_version: int
    """Version it must serve before it gets work: the latest published when it joined."""
    incarnation: int = 0
    """Manager-wide registration counter: tells a restarted process from the one before it."""
    token: str = ""
    """Secret of this incarnation: its heartbeats and deregistration present it."""
    preemptible: bool = False
    draining: bool = False
    saturation_batch_size: int = 0
    """Running sequences beyond which its decode steps gain no throughput (0: not known): while it
    runs this many it starts no sample of a later step than the oldest it runs."""
    reported_version: int = 0
    """The version of its last registration or heartbeat: a report never goes below it."""
    refused_version: int = -1
    """The newest version it refused an exact-version request for (it moved on): it gets none of
    that version again."""
    running: set[str] = field(default_factory=set)
    outstanding_tokens: float = 0.0
    """Tokens its running requests are still expected to generate."""
    generated_tokens: int = 0
    tokens_per_second: float = 0.0
    """Measured while busy (smoothed): what the instance delivers in total."""
    sequence_tokens_per_second: float = 0.0
    """Measured while busy (smoothed): what one of its sequences gets."""
    failures_in_a_row: int = 0
    """Requests that failed here one after another, no token in between (see breaker.py)."""
    quarantined_until: float = 0.0
    """While set, the instance gets no work (0: not quarantined)."""
    quarantines: int = 0
    """Quarantines since a request last finished here: each next one lasts twice as long."""
    rate_tokens: int = 0
    rate_time: float = 0.0
    busy_samples: float = 0.0
    queue_ahead: int = 0
    """Requests it is given beyond its max batch, which wait in its engine's queue and start the
    moment a sequence ends (the manager's setting of that name; not journaled)."""
    tracker: ChangeTracker | None = field(default=None, repr=False, compare=False)

    @property
    def journal_key(self) -> str:
        return self.instance_id

    @property
    def schedulable(self) -> bool:
        return self.weight_version >= self.min_version and not self.draining and not self.quarantined_until

    @property
    def free_slots(self) -> int:
        """Requests it may be given now: its free decode slots and its queue ahead."""
        return self.max_batch_size + self.queue_ahead - len(self.running)

    @property
    def free_decode_slots(self) -> int:
        """Sequences it could start decoding at once (none while requests wait in its queue)."""
        return max(0, self.max_batch_size - len(self.running))

    @property
    def decoding(self) -> int:
        """Sequences it decodes at once: its running requests beyond its max batch wait."""
        return min(len(self.running), self.max_batch_size)


@dataclass(slots=True)
class SampleRequest(Journaled):
    JOURNALED: ClassVar[frozenset[str]] = frozenset(
        {
            "token_ids",
            "logprobs",
            "weight_versions",
            "instance_ids",
            "finish_reason",
            "attempt",
            "migrations",
            "relay",
            "relayed_tokens",
            "first_version",
        }
    )
    KIND: ClassVar[str] = REQUEST

    request_id: str
    batch_id: str
    prompt_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    policy_version: int
    exact_version: bool = False
    """Every token must come from exactly policy_version (held-out evaluation): background work."""
    background: bool = False
    """Instances decode it at the lowest CPU priority while nothing else shares their batch."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    relay: str = ""
    """The relay shard holding its tokens (a job running relay shards): token_ids, logprobs and
    weight_versions then stay empty here, relayed_tokens counts them and first_version is the
    version of the first."""
    relayed_tokens: int = 0
    first_version: int = 0
    instance_ids: list[str] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    attempt: int = 0
    instance_id: str | None = None
    charged: float = 0.0
    """Expected tokens still counted in its instance's outstanding_tokens."""
    migrate_to: str | None = None
    """Set while it is being moved off a slow instance: where it continues."""
    migrations: int = 0
    failures_in_a_row: int = 0
    """Attempts that failed one after another, no token in between (see breaker.py)."""
    failed_on: set[str] = field(default_factory=set)
    """The instances those attempts failed on."""
    session_id: str = ""
    """Set on a turn of a multi-turn session (sessions.py): its tokens go to the session when it
    finishes, not to a group."""
    affinity: str = ""
    """The instance it runs on when that one may take it (a session's turn goes where its last turn
    ran, whose engine may still hold the session's KV cache)."""
    tracker: ChangeTracker | None = field(default=None, repr=False, compare=False)

    @property
    def journal_key(self) -> str:
        return self.request_id

    @property
    def engine_request_id(self) -> str:
        """Unique per attempt, so a late chunk of an abandoned attempt is never taken for the current one."""
        return f"{self.request_id}@{self.attempt}"

    @property
    def token_count(self) -> int:
        """Response tokens generated so far, wherever they are held."""
        return self.relayed_tokens if self.relay else len(self.token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - self.token_count

    @property
    def done(self) -> bool:
        return self.finish_reason in FINISHED

    def expected_remaining(self, mean_length: float | None) -> float:
        """Tokens it is still expected to generate. Lengths are long-tailed, so a request that has
        already run long is expected to run as long again; before any length was observed,
        max_tokens is the only bound known."""
        if mean_length is None:
            return float(self.remaining_tokens)
        generated = self.token_count
        return float(max(1, min(self.remaining_tokens, max(mean_length, 2 * generated) - generated)))


@dataclass(slots=True)
class Batch(Journaled):
    JOURNALED: ClassVar[frozenset[str]] = frozenset({"sent", "error", "version_gone"})
    KIND: ClassVar[str] = BATCH

    batch_id: str
    policy_version: int
    groups: dict[str, list[SampleRequest]]
    submitted_at: float = 0.0
    completed_at: float | None = None
    """When its last group became complete."""
    ready: deque[str] = field(default_factory=deque)
    """Complete groups not yet sent, by prompt id."""
    sent: list[str] = field(default_factory=list)
    """Groups sent, by prompt id, in stream order: a resumed stream resends from any position."""
    exact_version: bool = False
    """Its samples are generated by exactly policy_version (see SampleRequest.exact_version)."""
    background: bool = False
    """Its samples are background work (see SampleRequest.background)."""
    error: str = ""
    """Why the batch cannot complete: an instance refused one of its requests as invalid, or (with
    version_gone) no instance serves its exact version any more."""
    version_gone: bool = False
    sessions: bool = False
    """Its samples are multi-turn sessions (sessions.py): they run turn by turn, not from the queue,
    and each is done when its session closes."""
    tracker: ChangeTracker | None = field(default=None, repr=False, compare=False)

    @property
    def journal_key(self) -> str:
        return self.batch_id

    @property
    def unfinished(self) -> int:
        """Samples still to generate."""
        return sum(1 for group in self.groups.values() for r in group if not r.done)

    @property
    def response_tokens(self) -> int:
        return sum(r.token_count for group in self.groups.values() for r in group)

    @property
    def remaining(self) -> int:
        """Groups still to be sent."""
        return len(self.groups) - len(self.sent)

    def sample_finished(self, prompt_id: str, now: float) -> None:
        """One of the group's samples finished: the group is ready once all of them are."""
        if all(r.done for r in self.groups[prompt_id]):
            self.ready.append(prompt_id)
            if len(self.ready) + len(self.sent) == len(self.groups):
                self.completed_at = now

    def sample_unfinished(self, prompt_id: str) -> None:
        """A sample of a group not yet sent must generate again (its relay shard lost its tokens)."""
        if prompt_id in self.ready:
            self.ready.remove(prompt_id)
        self.completed_at = None


@dataclass(frozen=True, slots=True)
class Assignment:
    request: SampleRequest
    instance: Instance
    attempt: int


# Sessions -----------------------------------------------------------------------------

MODEL, ENVIRONMENT, TEMPLATE = (
    manager_pb2.SEGMENT_SOURCE_MODEL,
    manager_pb2.SEGMENT_SOURCE_ENVIRONMENT,
    manager_pb2.SEGMENT_SOURCE_TEMPLATE,
)
OPEN = manager_pb2.SESSION_STATUS_OPEN
DONE = manager_pb2.SESSION_STATUS_DONE
TRUNCATED_CONTEXT = manager_pb2.SESSION_STATUS_TRUNCATED_CONTEXT
TRUNCATED_TURNS = manager_pb2.SESSION_STATUS_TRUNCATED_TURNS
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
CLOSING_STATUSES = frozenset({DONE, TRUNCATED_CONTEXT, TRUNCATED_TURNS, DEADLINE, ENVIRONMENT_ERROR})


@dataclass(slots=True)
class Segment:
    """A run of tokens of one source; see manager.proto's Segment."""

    source: int
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    instance_ids: list[str] = field(default_factory=list)
    starts_part: bool = False
    reused_prefix_tokens: int = 0
    turn: int = 0
    break_cause: str = ""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of a session; 0 means none (see manager.proto's SessionLimits)."""

    max_turns: int = 0
    max_total_tokens: int = 0
    turn_deadline_seconds: float = 0.0
    step_deadline_seconds: float = 0.0
    session_deadline_seconds: float = 0.0
    wait_for_start: bool = False
    """The deadlines do not run until the episode starts (Sessions.start, or its first turn)."""
    refuse_agent_rewards: bool = False
    """The gateway refuses the rewards the session's harness reports."""
    refuse_breaks: bool = False
    """The gateway refuses a chat history that breaks the session's, instead of starting a part."""

    def problem(self) -> str:
        for name in ("turn_deadline_seconds", "step_deadline_seconds", "session_deadline_seconds"):
            value = getattr(self, name)
            if not 0 <= value < 1e9:
                return f"limits.{name} must be in [0, 1e9) seconds, got {value}"
        return ""


@dataclass(slots=True)
class Session(Journaled):
    JOURNALED: ClassVar[frozenset[str]] = frozenset(
        {
            "segments",
            "status",
            "detail",
            "turns",
            "reward",
            "turn_rewards",
            "environment_seconds",
            "conversation",
            "limits",
        }
    )
    KIND: ClassVar[str] = SESSION

    session_id: str
    batch_id: str
    prompt_id: str
    key: str
    sampling: common_pb2.SamplingParams
    policy_version: int
    limits: Limits
    segments: list[Segment] = field(default_factory=list)
    status: int = OPEN
    detail: str = ""
    turns: int = 0
    """Turns started; a running turn is the last of them."""
    reward: float | None = None
    turn_rewards: dict[int, float] = field(default_factory=dict)
    environment_seconds: float = 0.0
    conversation: list[LoggedMessage] = field(default_factory=list)
    """The messages before the last turn the gateway ran, as it matched them (see
    RunTurnRequest.conversation)."""
    turn: SampleRequest | None = None
    """The turn generating now."""
    opened_at: float = 0.0
    turn_started: float | None = None
    """When the running turn was first seen on an instance (None: still queued)."""
    idle_since: float = 0.0
    """When the last turn ended (or the session opened): the environment's step runs since."""
    last_instance: str = ""
    tracker: ChangeTracker | None = field(default=None, repr=False, compare=False)

    @property
    def journal_key(self) -> str:
        return self.session_id

    @property
    def is_open(self) -> bool:
        return self.status == OPEN

    def part_tokens(self) -> list[int]:
        """The current part's token stream: what the next turn is generated from."""
        return stream_of(self.segments)

    def turn_segment(self, turn: int) -> Segment | None:
        return next((s for s in reversed(self.segments) if s.source == MODEL and s.turn == turn), None)


def stream_of(segments: list[Segment]) -> list[int]:
    """The token stream the segments leave as context: a segment that starts a part keeps only the
    reused prefix of the stream before it."""
    stream: list[int] = []
    for segment in segments:
        if segment.starts_part:
            stream = stream[: segment.reused_prefix_tokens]
        stream += segment.token_ids
    return stream


@dataclass(frozen=True, slots=True)
class TurnState:
    """Where a RunTurn call stands: `running` (wait for it), or the turn's model segment, or the
    session ended without it (`segment` None, `status` why)."""

    status: int
    running: SampleRequest | None = None
    segment: Segment | None = None
    stream_tokens: int = 0
