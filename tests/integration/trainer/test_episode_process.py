"""The episode process rank 0 starts (`episode_driver = "process"`): it builds the job's multi-turn
tasks and reports ready; killed, it is reported with how it ended and the job's failure hook runs
once; closed, it ends without a report."""

import asyncio
import os
import signal

from services.trainer.config import TrainerConfig
from services.trainer.episodes.process import EpisodeProcess, EpisodeProcessError
from services.trainer.mesh import MeshClient
from tests.support.credentials import loopback
from tests.support.waiting import wait_for

ENVIRONMENT = """
class Once:
    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        return None, 1.0, True
"""


def config_for(tmp_path, chat_model_dir) -> TrainerConfig:
    (tmp_path / "once_env.py").write_text(ENVIRONMENT)
    return TrainerConfig(
        model_dir=str(chat_model_dir),
        output_dir=str(tmp_path / "out"),
        server=loopback(),
        python_path=[str(tmp_path)],
        tasks=[{"name": "once", "kind": "increment", "environment": {"python": "once_env:Once"}}],
    )


async def started(tmp_path, chat_model_dir) -> tuple[EpisodeProcess, list[BaseException]]:
    """An episode process for a job with one multi-turn task, and the failures it reports."""
    failures: list[BaseException] = []

    async def failed(exc: BaseException) -> None:
        failures.append(exc)

    mesh = MeshClient("127.0.0.1:1", "127.0.0.1:1", 1.0, 1.0)
    return await EpisodeProcess.start(config_for(tmp_path, chat_model_dir), mesh, [0], 64, failed), failures


async def test_a_killed_episode_process_is_reported_once_naming_how_it_ended(tmp_path, chat_model_dir):
    episodes, failures = await started(tmp_path, chat_model_dir)
    os.kill(episodes.process.pid, signal.SIGKILL)
    await wait_for(lambda: failures, 10, "the failure report")
    await asyncio.sleep(0.2)
    assert len(failures) == 1 and isinstance(failures[0], EpisodeProcessError)
    assert f"the episode process (pid {episodes.process.pid}) was killed by SIGKILL" in str(failures[0])
    await episodes.close()
    assert episodes.failure is failures[0]


async def test_a_closed_episode_process_ends_without_a_report(tmp_path, chat_model_dir):
    episodes, failures = await started(tmp_path, chat_model_dir)
    await episodes.close()
    assert episodes.process.returncode == 0 and failures == []
