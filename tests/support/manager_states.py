"""A manager's state in memory (no server, no journal unless a test adds one) with instances
registered, and a group of sessions opened on it."""

from __future__ import annotations

from rlmesh.common.v1 import common_pb2
from services.manager.domain.records import Limits
from services.manager.domain.state import ManagerState
from tests.support.waiting import ManualClock

NO_LIMITS = Limits()


def manager_state(instances=("a",), clock=None) -> ManagerState:
    state = ManagerState(lease_seconds=10, max_staleness=0, clock=clock or ManualClock())
    for instance_id in instances:
        state.register(instance_id, f"127.0.0.1:{len(state.instances) + 1000}", 0, 8, now=0)
    return state


def seeded_sampling(max_tokens: int = 8) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=7)


def open_group(state: ManagerState, n: int = 2, limits: Limits = NO_LIMITS, prompt=(1, 2, 3)):
    return state.open_sessions("b", 0, [("p", list(prompt), n)], seeded_sampling(), limits)
