"""How the journal learns what changed: journaled objects mark themselves in one ChangeTracker
when a journaled field is assigned, and their collections mark them as they enter and leave."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

REQUEST, BATCH, INSTANCE, COUNTERS, SESSION = "request", "batch", "instance", "counters", "session"
_UNSET = object()


@dataclass(slots=True)
class Changed:
    """What changed since the journal last wrote, keys by kind: to write again (`written`), that
    entered (`added`, also written: whole) and that left (`removed`: deleted)."""

    written: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    added: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    removed: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def __bool__(self) -> bool:
        return any(self.written.values()) or any(self.removed.values())

    def absorb(self, other: Changed) -> None:
        for mine, theirs in ((self.written, other.written), (self.added, other.added), (self.removed, other.removed)):
            for kind, keys in theirs.items():
                mine[kind].update(keys)


class ChangeTracker:
    """Collects the marks until the journal takes them."""

    def __init__(self) -> None:
        self.pending = Changed()

    def written(self, kind: str, key: str) -> None:
        self.pending.written[kind].add(key)

    def added(self, kind: str, key: str) -> None:
        self.pending.written[kind].add(key)
        self.pending.added[kind].add(key)

    def removed(self, kind: str, key: str) -> None:
        self.pending.removed[kind].add(key)

    def take(self) -> Changed:
        changed, self.pending = self.pending, Changed()
        return changed

    def put_back(self, changed: Changed) -> None:
        """What a failed write took: the next one writes it."""
        self.pending.absorb(changed)


class Journaled:
    """Mixin: assigning one of the class's JOURNALED fields marks the object (its KIND, its
    `journal_key`) in the tracker it is attached to; detached (None), nothing is marked.

    One mechanism in the objects themselves rather than marks placed by hand after each mutation:
    a mutation added later is journaled without anyone remembering to say so (a decorator on
    mutating methods would still have to name what each touched; diffing the state at each flush
    would cost relay throughput, as requests hold every token). A field is marked when its value
    changes; a list field whenever it is assigned, since `+=` has already grown it in place by then
    (so journaled lists are only ever grown with `+=` or replaced, never mutated by a method)."""

    __slots__ = ()
    JOURNALED: ClassVar[frozenset[str]] = frozenset()
    KIND: ClassVar[str]
    tracker: ChangeTracker | None

    @property
    def journal_key(self) -> str:
        """Which one of its kind it is; the counters are one of a kind."""
        return self.KIND

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.JOURNALED:
            tracker = getattr(self, "tracker", None)
            if tracker is not None:
                old = getattr(self, name, _UNSET)
                if value != old or (value is old and isinstance(value, list)):
                    tracker.written(self.KIND, self.journal_key)
        object.__setattr__(self, name, value)


Record = TypeVar("Record", bound=Journaled)


class Records(dict[str, Record], Generic[Record]):
    """Journaled objects by key: storing one attaches it to the tracker and marks it added, taking
    one out marks it removed and detaches it (a forgotten object marks nothing any more)."""

    def __init__(self, tracker: ChangeTracker, kind: str) -> None:
        super().__init__()
        self.tracker, self.kind = tracker, kind

    def __setitem__(self, key: str, record: Record) -> None:
        super().__setitem__(key, record)
        record.tracker = self.tracker
        self.tracker.added(self.kind, key)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def pop(self, key: str, *default: Record | None) -> Record | None:  # type: ignore[override]
        if key not in self:
            return default[0] if default else super().pop(key)
        record = super().pop(key)
        record.tracker = None
        self.tracker.removed(self.kind, key)
        return record

    def restore(self, records: Iterable[Record]) -> None:
        """Takes in objects the journal already holds: attached, not marked."""
        for record in records:
            super().__setitem__(record.journal_key, record)
            record.tracker = self.tracker
