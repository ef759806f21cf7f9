"""The instance registry alone: a registration returns an incarnation token; while the lease is live
only the registered process (its address, its token) may use the id."""

import re

import pytest

from rlmesh.errors import AlreadyExists
from services.manager.domain.journaled import ChangeTracker
from services.manager.domain.records import Instance
from services.manager.domain.registry import InstanceRegistry, WrongIncarnation


def registry_with(*instance_ids: str) -> InstanceRegistry:
    registry = InstanceRegistry(ChangeTracker(), lease_seconds=10, now=0)
    for instance_id in instance_ids:
        register(registry, instance_id, f"127.0.0.1:{len(registry.instances) + 1000}", now=0)
    return registry


def register(registry: InstanceRegistry, instance_id: str, address: str, now: float, token: str = "") -> Instance:
    """A registration of an instance serving version 0, 64 sequences at once, with nothing published yet."""
    instance, _ = registry.register(instance_id, address, 0, 64, now, False, token, 0)
    return instance


def test_a_registration_under_a_live_id_without_its_token_is_refused():
    registry = registry_with("a")
    original = registry.instances["a"]
    for token in ("", "0" * 32, original.token.upper(), "non-ascii \u00e9"):
        with pytest.raises(AlreadyExists, match="lease is live"):
            register(registry, "a", original.address, now=5, token=token)
    assert registry.instances["a"] is original and registry.registrations == 1


def test_every_incarnation_gets_its_own_token():
    """Tokens are secrets drawn per registration: two instances, or two incarnations of one, never share one."""
    registry = registry_with("a", "b")
    first, other = registry.instances["a"].token, registry.instances["b"].token
    for expired in registry.expired(now=11):
        registry.drop(expired.instance_id, now=11)
    again = register(registry, "a", "127.0.0.1:1000", now=11)
    assert all(re.fullmatch("[0-9a-f]{32}", token) for token in (first, other, again.token))
    assert len({first, other, again.token}) == 3 and again.incarnation == 3


def test_calls_without_the_live_incarnations_token_are_refused():
    registry = registry_with("a")
    live = registry.instances["a"]
    with pytest.raises(WrongIncarnation, match="'a': the call carries no incarnation token"):
        registry.heartbeat("a", 0, now=1, draining=False, token="")
    with pytest.raises(WrongIncarnation, match="carries the token of another incarnation"):
        registry.heartbeat("a", 0, now=1, draining=False, token="f" * 32)
    # What a deregistration checks before the instance leaves.
    with pytest.raises(WrongIncarnation):
        registry.incarnation("a", "f" * 32)
    assert registry.instances["a"] is live and live.lease_expires == 10


def test_after_a_deregistration_the_id_registers_again_at_once():
    registry = registry_with("a")
    first = registry.instances["a"]
    registry.drop(registry.incarnation("a", first.token).instance_id, now=1)
    second = register(registry, "a", first.address, now=1.5)
    assert second.incarnation == 2 and second.token != first.token
