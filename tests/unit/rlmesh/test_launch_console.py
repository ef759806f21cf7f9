"""The console reads the supervisor's events and the trainer's status: it writes each notice,
shows progress, and returns the trainer's exit code once the trainer has ended (130 on Ctrl-C)."""

import asyncio

import pytest

from rlmesh.launch import console
from rlmesh.launch.console import INTERRUPTED, follow_training
from rlmesh.launch.supervisor import Notice, ServiceEnded


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(console, "POLL_SECONDS", 0)


def follow(events: list, statuses: list, steps: int = 10, stop: bool = False) -> int:
    """Runs the console over `events` queued up front and `statuses` read in turn (None: the
    trainer does not answer); after the last status the trainer reports nothing new."""

    async def run() -> int:
        queue = asyncio.Queue()
        for event in events:
            queue.put_nowait(event)
        readings = iter(statuses)

        async def read_status():
            return next(readings, None)

        stopped = asyncio.Event()
        if stop:
            stopped.set()
        return await follow_training(queue, read_status, steps, stopped)

    return asyncio.run(run())


def test_notices_are_written_in_order_and_the_trainers_end_is_the_runs_exit_code(capsys):
    events = [
        Notice("rollout-1 exited (killed by signal 9); restarting in 1 s"),
        Notice("rollout-1 restarted (pid 7)"),
        ServiceEnded("trainer", 3),
        Notice("never shown"),
    ]
    assert follow(events, []) == 3
    assert capsys.readouterr().err.splitlines() == [
        "rollout-1 exited (killed by signal 9); restarting in 1 s",
        "rollout-1 restarted (pid 7)",
    ]


def test_without_a_terminal_progress_is_a_line_per_tenth_of_the_run(capsys):
    async def run() -> int:
        queue = asyncio.Queue()
        readings = [None, (1, {"reward": 0.25}), (1, {"reward": 0.25}), (5, {"reward": 0.5, "eval/exact_match": 1.0})]

        async def read_status():
            if not readings:
                queue.put_nowait(ServiceEnded("trainer", 0))
                return None
            return readings.pop(0)

        return await follow_training(queue, read_status, 10, asyncio.Event())

    assert asyncio.run(run()) == 0
    assert capsys.readouterr().out.splitlines() == ["step 1/10 reward=0.250", "step 5/10 reward=0.500 exact=1.000"]


def test_another_services_end_is_written_and_training_goes_on_until_the_trainers(capsys):
    assert follow([ServiceEnded("weights", 1), ServiceEnded("trainer", 0)], []) == 0
    assert capsys.readouterr().err.splitlines() == ["weights exited (exit code 1); not started again"]


def test_ctrl_c_ends_the_console_with_130():
    assert follow([], [], stop=True) == INTERRUPTED == 130
