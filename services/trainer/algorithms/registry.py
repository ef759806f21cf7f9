"""Named registries of the algorithm's parts (policy losses, advantage estimators, reward shapers):
a part is one function registered under a name, and settings name the part they choose."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Part = TypeVar("Part")


class UnknownName(ValueError):
    """A setting names a part no registry entry has."""


class Registry(Generic[Part]):
    def __init__(self, kind: str) -> None:
        """`kind` says what the registry holds, in error messages ("policy loss")."""
        self.kind = kind
        self._parts: dict[str, Part] = {}

    def register(self, name: str) -> Callable[[Part], Part]:
        """Decorator: registers the function (or object) under `name`; a name is registered once."""

        def add(part: Part) -> Part:
            if name in self._parts:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._parts[name] = part
            return part

        return add

    def get(self, name: str) -> Part:
        try:
            return self._parts[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}: known are {', '.join(self.names())}") from None

    def check(self, name: str) -> str:
        """`name` if registered (for settings' validators); raises UnknownName otherwise."""
        self.get(name)
        return name

    def names(self) -> list[str]:
        return sorted(self._parts)

    def items(self) -> list[tuple[str, Part]]:
        return sorted(self._parts.items())
