"""The manager's journal: a SQLite file in WAL mode with what a restarted manager needs to go on
(accepted batches, every request's tokens so far, the order groups were sent in, the published
version, the instance registry and multi-turn sessions with their running turns). Written in one
transaction per flush, from what changed."""

from __future__ import annotations

import json
import sqlite3
from array import array
from dataclasses import asdict
from pathlib import Path

from rlmesh.common.v1 import common_pb2
from rlmesh.config import ConfigError
from rlmesh.manager.v1 import manager_pb2
from services.manager.domain.conversations import LoggedMessage
from services.manager.domain.journaled import BATCH, COUNTERS, INSTANCE, REQUEST, SESSION
from services.manager.domain.records import Batch, Instance, Limits, SampleRequest, Session
from services.manager.domain.state import ManagerState
from services.manager.domain.trajectories import take_progress, trajectory

FORMAT = 7
"""Bumped when the tables change; a journal of another format is migrated (from 2) or refused, not misread."""

_MIGRATIONS = {
    # 3: exact-version batches (held-out evaluation) and their failure when the version is gone.
    2: [
        "ALTER TABLE batches ADD COLUMN exact_version INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE batches ADD COLUMN version_gone INTEGER NOT NULL DEFAULT 0",
    ],
    # 4: background batches (decoded at the lowest CPU priority).
    3: ["ALTER TABLE batches ADD COLUMN background INTEGER NOT NULL DEFAULT 0"],
    # 5: an instance's saturation batch (the dispatch hold for later steps).
    4: ["ALTER TABLE instances ADD COLUMN saturation_batch_size INTEGER NOT NULL DEFAULT 0"],
    # 6: multi-turn sessions (their table is created with the schema) and their turns.
    5: [
        "ALTER TABLE batches ADD COLUMN sessions INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE requests ADD COLUMN session_id TEXT NOT NULL DEFAULT ''",
    ],
    # 7: requests whose tokens a relay shard holds (their count and first token's version here).
    6: [
        "ALTER TABLE requests ADD COLUMN relay TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE requests ADD COLUMN relayed_tokens INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE requests ADD COLUMN first_version INTEGER NOT NULL DEFAULT 0",
    ],
}
"""Per format, the columns (ALTER TABLE ... ADD COLUMN) that turn it into the next."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, policy_version INTEGER NOT NULL, prompt_ids TEXT NOT NULL,
    sent TEXT NOT NULL, error TEXT NOT NULL, submitted INTEGER NOT NULL, exact_version INTEGER NOT NULL DEFAULT 0,
    version_gone INTEGER NOT NULL DEFAULT 0, background INTEGER NOT NULL DEFAULT 0,
    sessions INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, batch_id TEXT NOT NULL, prompt_id TEXT NOT NULL, prompt_token_ids BLOB NOT NULL,
    sampling BLOB NOT NULL, policy_version INTEGER NOT NULL, token_ids BLOB NOT NULL, logprobs BLOB NOT NULL,
    weight_versions BLOB NOT NULL, instance_ids TEXT NOT NULL, finish_reason INTEGER NOT NULL,
    attempt INTEGER NOT NULL, migrations INTEGER NOT NULL, session_id TEXT NOT NULL DEFAULT '',
    relay TEXT NOT NULL DEFAULT '', relayed_tokens INTEGER NOT NULL DEFAULT 0,
    first_version INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS requests_of_batch ON requests (batch_id);
CREATE TABLE IF NOT EXISTS instances (
    instance_id TEXT PRIMARY KEY, address TEXT NOT NULL, weight_version INTEGER NOT NULL,
    max_batch_size INTEGER NOT NULL, min_version INTEGER NOT NULL, incarnation INTEGER NOT NULL, token TEXT NOT NULL,
    preemptible INTEGER NOT NULL, draining INTEGER NOT NULL, saturation_batch_size INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, batch_id TEXT NOT NULL, prompt_id TEXT NOT NULL, key TEXT NOT NULL,
    sampling BLOB NOT NULL, policy_version INTEGER NOT NULL, limits TEXT NOT NULL, trajectory BLOB NOT NULL,
    conversation TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_of_batch ON sessions (batch_id);
"""


# The widths the contracts carry (uint32 token ids, float logprobs, int64 versions): every token is
# written again at each flush of its request, so the journal writes no byte the wire did not carry.
def _token_ids(values: list[int]) -> bytes:
    return array("I", values).tobytes()


def _token_ids_from(blob: bytes) -> list[int]:
    return array("I", blob).tolist()


def _versions(values: list[int]) -> bytes:
    return array("q", values).tobytes()


def _versions_from(blob: bytes) -> list[int]:
    return array("q", blob).tolist()


def _logprobs(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def _logprobs_from(blob: bytes) -> list[float]:
    return array("f", blob).tolist()


class _EncodedProgress:
    """A request's tokens, logprobs and versions in their journal encoding. A request's arrays only
    grow, so each flush encodes what came since the last one instead of the whole request again."""

    __slots__ = ("request", "count", "token_ids", "logprobs", "weight_versions")

    def __init__(self, request: SampleRequest) -> None:
        self.request, self.count = request, 0
        self.token_ids, self.logprobs, self.weight_versions = bytearray(), bytearray(), bytearray()

    def extend(self) -> _EncodedProgress:
        request = self.request
        start, self.count = self.count, len(request.token_ids)
        self.token_ids += _token_ids(request.token_ids[start:])
        self.logprobs += _logprobs(request.logprobs[start:])
        self.weight_versions += _versions(request.weight_versions[start:])
        return self


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._encoded: dict[str, _EncodedProgress] = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The event loop is the only writer; autocommit is off so that a flush is one transaction.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            # Committed transactions survive the process being killed; only a machine crash can
            # lose the last ones, which then count as not yet journaled.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            found = self._counter("format")
            if found is None:
                self._db.execute("INSERT INTO counters VALUES ('format', ?)", (FORMAT,))
            elif found in _MIGRATIONS:
                self._migrate(found)
        except sqlite3.Error as exc:
            raise ConfigError(f"journal_path {str(self.path)!r}: cannot use it as a SQLite journal: {exc}") from exc
        if found is not None and found not in _MIGRATIONS and found != FORMAT:
            raise ConfigError(
                f"journal_path {str(self.path)!r}: journal format {found}, this manager reads formats "
                f"{', '.join(map(str, sorted(_MIGRATIONS)))} and {FORMAT}"
            )

    def _migrate(self, found: int) -> None:
        """Brings a journal of an older format to this one, in one transaction."""
        self._db.execute("BEGIN")
        try:
            for version in range(found, FORMAT):
                for statement in _MIGRATIONS[version]:
                    _, _, table, _, _, column, *_ = statement.split()
                    # A table the old format lacked was just created whole by the schema.
                    if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                        self._db.execute(statement)
            self._db.execute("UPDATE counters SET value = ? WHERE name = 'format'", (FORMAT,))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _counter(self, name: str) -> int | None:
        row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def restore(self, state: ManagerState, now: float) -> tuple[int, int]:
        """Loads the journal into an empty state; returns (batches, instances) restored."""
        instances = [
            Instance(
                instance_id=row[0],
                address=row[1],
                weight_version=row[2],
                max_batch_size=row[3],
                lease_expires=now,
                min_version=row[4],
                incarnation=row[5],
                token=row[6],
                preemptible=bool(row[7]),
                draining=bool(row[8]),
                saturation_batch_size=row[9],
            )
            for row in self._db.execute(
                "SELECT instance_id, address, weight_version, max_batch_size, min_version, incarnation, "
                "token, preemptible, draining, saturation_batch_size FROM instances ORDER BY instance_id"
            )
        ]
        batches, turns = [], []
        for (
            batch_id,
            policy_version,
            prompt_ids,
            sent,
            error,
            exact_version,
            version_gone,
            background,
            sessions,
        ) in self._db.execute(
            "SELECT batch_id, policy_version, prompt_ids, sent, error, exact_version, version_gone, background, "
            "sessions FROM batches ORDER BY submitted"
        ).fetchall():
            groups: dict[str, list[SampleRequest]] = {prompt_id: [] for prompt_id in json.loads(prompt_ids)}
            for row in self._db.execute(
                "SELECT request_id, prompt_id, prompt_token_ids, sampling, policy_version, token_ids, logprobs, "
                "weight_versions, instance_ids, finish_reason, attempt, migrations, session_id, relay, relayed_tokens, "
                "first_version FROM requests "
                "WHERE batch_id = ? ORDER BY rowid",
                (batch_id,),
            ):
                sampling = common_pb2.SamplingParams()
                sampling.ParseFromString(row[3])
                request = SampleRequest(
                    request_id=row[0],
                    batch_id=batch_id,
                    prompt_id=row[1],
                    prompt_token_ids=_token_ids_from(row[2]),
                    sampling=sampling,
                    policy_version=row[4],
                    exact_version=bool(exact_version),
                    background=bool(background),
                    token_ids=_token_ids_from(row[5]),
                    logprobs=_logprobs_from(row[6]),
                    weight_versions=_versions_from(row[7]),
                    instance_ids=json.loads(row[8]),
                    finish_reason=row[9],
                    attempt=row[10],
                    migrations=row[11],
                    session_id=row[12],
                    relay=row[13],
                    relayed_tokens=row[14],
                    first_version=row[15],
                )
                (turns if request.session_id else groups[row[1]]).append(request)
            for group in groups.values():
                group.sort(key=lambda r: int(r.request_id.rsplit("/", 1)[1]))
            batches.append(
                Batch(
                    batch_id,
                    policy_version,
                    groups,
                    submitted_at=state.clock(),
                    sent=json.loads(sent),
                    error=error,
                    exact_version=bool(exact_version),
                    version_gone=bool(version_gone),
                    background=bool(background),
                    sessions=bool(sessions),
                )
            )
        state.restore(
            instances,
            batches,
            self._counter("published_version") or 0,
            self._counter("registrations") or 0,
            now,
            self._sessions(),
            turns,
        )
        return len(batches), len(instances)

    def _sessions(self) -> list[Session]:
        sessions = []
        for (
            session_id,
            batch_id,
            prompt_id,
            key,
            sampling_blob,
            policy_version,
            limits,
            progress,
            conversation,
        ) in self._db.execute(
            "SELECT session_id, batch_id, prompt_id, key, sampling, policy_version, limits, trajectory, conversation "
            "FROM sessions ORDER BY rowid"
        ):
            sampling = common_pb2.SamplingParams()
            sampling.ParseFromString(sampling_blob)
            session = Session(
                session_id, batch_id, prompt_id, key, sampling, policy_version, Limits(**json.loads(limits))
            )
            message = manager_pb2.SessionTrajectory()
            message.ParseFromString(progress)
            take_progress(session, message)
            session.conversation = [LoggedMessage(*entry) for entry in json.loads(conversation)]
            sessions.append(session)
        return sessions

    def flush(self, state: ManagerState) -> None:
        """Writes what changed since the last flush, in one transaction: when it returns, a
        manager killed at any later point restarts with it."""
        changed = state.take_changes()
        if not changed:
            return
        db = self._db
        db.execute("BEGIN")
        try:
            for batch_id in changed.removed[BATCH] - state.batches.keys():
                db.execute("DELETE FROM batches WHERE batch_id = ?", (batch_id,))
                db.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))
                db.execute("DELETE FROM sessions WHERE batch_id = ?", (batch_id,))
            for batch_id in changed.written[BATCH] & state.batches.keys():
                batch = state.batches[batch_id]
                db.execute(
                    "INSERT INTO batches (batch_id, policy_version, prompt_ids, sent, error, submitted, exact_version, "
                    "version_gone, background, sessions) "
                    "VALUES (?, ?, ?, ?, ?, (SELECT COALESCE(MAX(submitted), 0) + 1 FROM batches), ?, ?, ?, ?) "
                    "ON CONFLICT (batch_id) DO UPDATE "
                    "SET sent = excluded.sent, error = excluded.error, version_gone = excluded.version_gone",
                    (
                        batch_id,
                        batch.policy_version,
                        json.dumps(list(batch.groups)),
                        json.dumps(batch.sent),
                        batch.error,
                        int(batch.exact_version),
                        int(batch.version_gone),
                        int(batch.background),
                        int(batch.sessions),
                    ),
                )
            requests = [state.requests[i] for i in changed.written[REQUEST] if i in state.requests]
            new_requests = changed.added[REQUEST]
            progress = {r.request_id: self._progress(r) for r in requests}
            db.executemany(
                "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        r.request_id,
                        r.batch_id,
                        r.prompt_id,
                        _token_ids(r.prompt_token_ids),
                        r.sampling.SerializeToString(),
                        r.policy_version,
                        (p := progress[r.request_id]).token_ids,
                        p.logprobs,
                        p.weight_versions,
                        json.dumps(r.instance_ids),
                        r.finish_reason,
                        r.attempt,
                        r.migrations,
                        r.session_id,
                        r.relay,
                        r.relayed_tokens,
                        r.first_version,
                    )
                    for r in requests
                    if r.request_id in new_requests
                ],
            )
            # Requests written before change only in how far they got.
            db.executemany(
                "UPDATE requests SET token_ids = ?, logprobs = ?, weight_versions = ?, instance_ids = ?, "
                "finish_reason = ?, attempt = ?, migrations = ?, relay = ?, relayed_tokens = ?, first_version = ? "
                "WHERE request_id = ?",
                [
                    (
                        (p := progress[r.request_id]).token_ids,
                        p.logprobs,
                        p.weight_versions,
                        json.dumps(r.instance_ids),
                        r.finish_reason,
                        r.attempt,
                        r.migrations,
                        r.relay,
                        r.relayed_tokens,
                        r.first_version,
                        r.request_id,
                    )
                    for r in requests
                    if r.request_id not in new_requests
                ],
            )
            # A turn that finished (or was dropped) leaves the request table but not the batch.
            for request_id in changed.removed[REQUEST] - state.requests.keys():
                if "#" in request_id:
                    db.execute("DELETE FROM requests WHERE request_id = ?", (request_id,))
            sessions = state.sessions.sessions
            for session_id in changed.removed[SESSION] - sessions.keys():
                db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            db.executemany(
                "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        s.session_id,
                        s.batch_id,
                        s.prompt_id,
                        s.key,
                        s.sampling.SerializeToString(),
                        s.policy_version,
                        json.dumps(asdict(s.limits)),
                        trajectory(s).SerializeToString(),
                        json.dumps([(m.key, m.end, m.stop_text, m.content_key, m.calls_key) for m in s.conversation]),
                    )
                    for s in (sessions[i] for i in changed.written[SESSION] if i in sessions)
                ],
            )
            for instance_id in changed.removed[INSTANCE] - state.instances.keys():
                db.execute("DELETE FROM instances WHERE instance_id = ?", (instance_id,))
            db.executemany(
                "INSERT OR REPLACE INTO instances VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        i.instance_id,
                        i.address,
                        i.weight_version,
                        i.max_batch_size,
                        i.min_version,
                        i.incarnation,
                        i.token,
                        int(i.preemptible),
                        int(i.draining),
                        i.saturation_batch_size,
                    )
                    for i in (state.instances[n] for n in changed.written[INSTANCE] if n in state.instances)
                ],
            )
            if changed.written[COUNTERS]:
                db.executemany(
                    "INSERT OR REPLACE INTO counters VALUES (?, ?)",
                    [("published_version", state.published_version), ("registrations", state.registrations)],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            # Still unwritten: the next flush tries them again.
            state.tracker.put_back(changed)
            raise
        self._forget_encodings(state, requests, bool(changed.removed[BATCH]))

    def _progress(self, request: SampleRequest) -> _EncodedProgress:
        encoded = self._encoded.get(request.request_id)
        # A batch forgotten and submitted again under its id has new requests under the old ids.
        if encoded is None or encoded.request is not request:
            encoded = self._encoded[request.request_id] = _EncodedProgress(request)
        return encoded.extend()

    def _forget_encodings(self, state: ManagerState, written: list[SampleRequest], batches_forgotten: bool) -> None:
        """A finished request is rarely written again, and a forgotten one never: their encodings go."""
        for request in written:
            if request.done:
                del self._encoded[request.request_id]
        if batches_forgotten:
            for request_id in [i for i in self._encoded if i not in state.requests]:
                del self._encoded[request_id]

    def close(self) -> None:
        self._db.close()


class NoJournal:
    """A manager whose state lives in memory only (journal_path ""): what changed is dropped."""

    def restore(self, state: ManagerState, now: float) -> tuple[int, int]:
        return 0, 0

    def flush(self, state: ManagerState) -> None:
        state.take_changes()

    def close(self) -> None:
        pass


def open_journal(path: str) -> Journal | NoJournal:
    return Journal(path) if path else NoJournal()
