"""The episode driver against a stand-in manager (no sockets): a failed call of one session ends
that episode (counted, masked), never the job; a reward the manager could not store ends its
episode as an environment error; hung sync steps do not starve later episodes; at most a task's
max_concurrent episodes run at once, each session started when its episode is."""

import asyncio
import math
import threading

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.manager.v1 import manager_pb2
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.config import EnvironmentConfig
from services.trainer.episodes.driver import EpisodeDriver
from services.trainer.episodes.environment_threads import EnvironmentThreads
from services.trainer.episodes.spec import EpisodeSpec

OPEN = manager_pb2.SESSION_STATUS_OPEN
DONE = manager_pb2.SESSION_STATUS_DONE
DEADLINE = manager_pb2.SESSION_STATUS_DEADLINE
ENVIRONMENT_ERROR = manager_pb2.SESSION_STATUS_ENVIRONMENT_ERROR
STOP = 9


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [1, 2]

    def decode(self, ids, skip_special_tokens=False):
        return "answer"


class Manager:
    """The manager's session calls as the driver makes them: what it was told, and the refusals a
    real manager gives (a reward float32 cannot hold is INVALID_ARGUMENT)."""

    def __init__(self, failing: dict[str, grpc.aio.AioRpcError] | None = None) -> None:
        self.failing = failing or {}
        self.events: list[tuple[str, str]] = []
        self.closed: dict[str, tuple[int, str]] = {}

    def _call(self, name: str, session_id: str) -> None:
        self.events.append((name, session_id))
        if name in self.failing:
            raise self.failing[name]

    async def start_session(self, session_id):
        self._call("start", session_id)
        return OPEN

    async def run_turn(self, request, wait_seconds):
        self._call("turn", request.session_id)
        return manager_pb2.RunTurnResponse(
            status=OPEN, generated=manager_pb2.Segment(source=manager_pb2.SEGMENT_SOURCE_MODEL, token_ids=[5, STOP])
        )

    async def set_session_reward(self, session_id, reward, turn=None):
        self._call("reward", session_id)
        if not math.isfinite(np.float32(reward)):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"reward {reward} is not finite")

    async def close_session(self, session_id, status, detail=""):
        self._call("close", session_id)
        self.closed.setdefault(session_id, (status, detail))
        return self.closed[session_id][0]


class OneStep:
    """Reset, then one step rewarded `reward` that ends the episode."""

    reward = 1.0

    def reset(self, row):
        return {"text": row["prompt"]}

    def step(self, action):
        return None, self.reward, True


def spec_for(environment, **config) -> EpisodeSpec:
    settings = {"python": "unused:Unused", "step_deadline_seconds": 5.0, **config}
    return EpisodeSpec(
        "t", EnvironmentConfig(**settings), lambda episode_id: environment(), None, Tokenizer(), [STOP], 64
    )


def handles(count: int) -> list[manager_pb2.SessionHandle]:
    return [manager_pb2.SessionHandle(session_id=f"b/p/{i}", prompt_id="p", index=i, key="k") for i in range(count)]


async def run_all(driver: EpisodeDriver, spec: EpisodeSpec, count: int) -> None:
    """The episodes as the trainer runs them (their failures counted, the job's reported)."""
    driver.start(spec, handles(count), {"p": TaskPrompt("p", text="Say hi.")})
    await asyncio.gather(*list(driver.tasks))


@pytest.mark.parametrize(
    "call, code, status",
    [
        ("reward", grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE),
        ("turn", grpc.StatusCode.UNAVAILABLE, ENVIRONMENT_ERROR),
        ("start", grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE),
    ],
)
async def test_a_failed_call_of_one_session_ends_its_episode_not_the_job(call, code, status):
    manager = Manager({call: rpc_error(code, "the manager is busy")})
    failures = []
    driver = EpisodeDriver(manager, threads=2, on_failure=lambda exc: asyncio.sleep(0, failures.append(exc)))
    await run_all(driver, spec_for(OneStep), 2)
    await driver.close()
    assert failures == [] and driver.failure is None
    assert {s: c[0] for s, c in manager.closed.items()} == {"b/p/0": status, "b/p/1": status}
    assert all(f"{code.name}: the manager is busy" in detail for _, detail in manager.closed.values())
    assert list(driver.errors["t"].outcomes) == [True, True]


@pytest.mark.parametrize("reward", [math.nan, math.inf, 1e39, -3.5e38])
async def test_a_reward_the_manager_cannot_store_ends_its_episode_as_an_environment_error(reward):
    class Unstorable(OneStep):
        pass

    Unstorable.reward = reward
    manager = Manager()
    failures = []
    driver = EpisodeDriver(manager, threads=2, on_failure=lambda exc: asyncio.sleep(0, failures.append(exc)))
    await run_all(driver, spec_for(Unstorable), 1)
    await driver.close()
    assert failures == []
    status, detail = manager.closed["b/p/0"]
    assert status == ENVIRONMENT_ERROR and "not a finite number" in detail
    assert ("reward", "b/p/0") not in manager.events


async def test_hung_sync_steps_do_not_starve_the_episodes_after_them():
    release, lock = threading.Event(), threading.Lock()

    class HangsTwice(OneStep):
        """The first two steps taken (of any episode) sleep until the test ends."""

        hung = 0

        def step(self, action):
            with lock:
                hangs = HangsTwice.hung < 2
                HangsTwice.hung += hangs
            if hangs:
                release.wait(60)
            return None, 1.0, True

    manager = Manager()
    driver = EpisodeDriver(manager, threads=2, on_failure=lambda exc: asyncio.sleep(0))
    spec = spec_for(HangsTwice, step_deadline_seconds=0.3)
    try:
        await run_all(driver, spec, 4)
        statuses = sorted(status for status, _ in manager.closed.values())
        assert statuses == sorted([DEADLINE, DEADLINE, DONE, DONE])
        assert driver.threads.written_off == 2 and driver.threads.written_off_total == 2
    finally:
        release.set()
        await driver.close()


async def test_at_most_max_concurrent_episodes_run_each_started_when_it_runs():
    running, most = set(), [0]

    class Counted(OneStep):
        async def step(self, action):
            running.add(id(self))
            most[0] = max(most[0], len(running))
            await asyncio.sleep(0.01)
            running.discard(id(self))
            return None, 1.0, True

    manager = Manager()
    driver = EpisodeDriver(manager, threads=2, on_failure=lambda exc: asyncio.sleep(0))
    await run_all(driver, spec_for(Counted, max_concurrent=2), 7)
    await driver.close()
    assert most[0] == 2
    assert all(status == DONE for status, _ in manager.closed.values()) and len(manager.closed) == 7
    for i in range(7):
        calls = [name for name, session in manager.events if session == f"b/p/{i}"]
        assert calls == ["start", "turn", "reward", "close"]


def test_sessions_wait_for_their_episode_to_start_and_the_default_bound_follows_the_cores():
    spec = spec_for(OneStep)
    assert spec.limits().wait_for_start
    agents, environments = EnvironmentConfig(command="python harness.py"), EnvironmentConfig(builtin="calculator")
    assert 2 <= agents.concurrency < environments.concurrency
    assert EnvironmentConfig(command="python harness.py", max_concurrent=3).concurrency == 3


def test_a_task_chooses_what_its_gateway_does_with_a_break():
    assert not spec_for(OneStep).limits().refuse_breaks
    assert spec_for(OneStep, on_break="refuse").limits().refuse_breaks


@given(threads=st.integers(1, 3), data=st.data())
def test_written_off_threads_are_bounded_and_calls_go_on_while_under_the_bound(threads, data):
    # Past 2 x threads hung calls every place is held by one: a further call would wait for a hung one.
    hangs = data.draw(st.integers(0, 2 * threads))
    release = threading.Event()
    pool = EnvironmentThreads(threads)

    async def scenario() -> list[str]:
        outcomes = []
        for _ in range(hangs):
            try:
                await pool.call(release.wait, 60, deadline=0.01)
            except TimeoutError:
                outcomes.append("timeout")
        if hangs <= threads:
            outcomes.append(await pool.call(lambda: "ran", deadline=5))
        return outcomes

    try:
        outcomes = asyncio.run(scenario())
    finally:
        release.set()
    assert outcomes[:hangs] == ["timeout"] * hangs
    assert pool.written_off_total == min(hangs, threads)
    if hangs <= threads:
        assert outcomes[-1] == "ran"
