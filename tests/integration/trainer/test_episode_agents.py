"""Agent commands as processes, against a real manager and its gateway: a reward the manager could
not store ends its episode as an environment error (the job goes on); an agent's exit ends its
episode even when a child it left holds its output, and the child dies with it; at the deadline its
whole process group is killed; a row too big for an environment variable reaches it in a file;
episodes beyond max_concurrent wait, and their deadlines start when they do; a task that refuses its
agents' rewards ignores the one on an agent's stdout, and the gateway refuses the one it posts."""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from rlmesh.chat.turns import ChatTurns
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.config import EnvironmentConfig
from services.trainer.episodes.driver import EpisodeDriver, open_sessions
from services.trainer.episodes.spec import EpisodeSpec
from tests.support.waiting import wait_until

STATUS = manager_pb2.SessionStatus.Name


def running(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def agent(folder: Path, name: str, source: str) -> str:
    """An agent command running `source` with this interpreter."""
    (folder / name).write_text(source)
    return f"{sys.executable} {folder / name}"


async def run_episodes(
    mesh,
    chat_model_dir,
    folder: Path,
    config: EnvironmentConfig,
    count: int,
    prompt: TaskPrompt | None = None,
    batch_id: str = "agents",
) -> tuple[list[tuple[str, str]], EpisodeDriver]:
    """`count` episodes of one group as the trainer runs them: opened as the trainer opens them,
    each started by the driver; their (status, detail) at the manager, in order."""
    built, client = mesh
    tokenizer = load_hf_tokenizer(chat_model_dir)
    stop = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    spec = EpisodeSpec("agents", config, None, ChatTurns(tokenizer), tokenizer, [stop], 512, str(folder))
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=[stop])
    handles = await open_sessions(client, spec, batch_id, 0, [("p", [], params)], count)
    failures = []
    driver = EpisodeDriver(
        client,
        threads=2,
        on_failure=lambda exc: asyncio.sleep(0, failures.append(exc)),
        gateway_address=built.manager.gateway_address,
    )
    try:
        driver.start(spec, handles, {"p": prompt or TaskPrompt("p", text="Count.")})
        await asyncio.gather(*list(driver.tasks))
    finally:
        await driver.close()
    assert failures == []
    sessions = built.manager.state.sessions
    return [(STATUS(sessions.get(h.session_id).status), sessions.get(h.session_id).detail) for h in handles], driver


async def test_an_agent_reward_the_manager_cannot_store_ends_its_episode_and_the_job_goes_on(
    chat_mesh, chat_model_dir, tmp_path, monkeypatch
):
    command = agent(tmp_path, "report.py", "import os\nprint(os.environ['REPORT'])\n")
    outcomes = []
    for index, report in enumerate(('{"reward": NaN}', '{"reward": 1e39}', '{"reward": 0.5}')):
        monkeypatch.setenv("REPORT", report)
        [outcome], driver = await run_episodes(
            chat_mesh, chat_model_dir, tmp_path, EnvironmentConfig(command=command), 1, batch_id=f"report-{index}"
        )
        outcomes.append(outcome)
        assert driver.failure is None
    assert [status for status, _ in outcomes] == [
        "SESSION_STATUS_ENVIRONMENT_ERROR",
        "SESSION_STATUS_ENVIRONMENT_ERROR",
        "SESSION_STATUS_DONE",
    ]
    assert "the agent's report gave reward=nan" in outcomes[0][1] and "reward=1e+39" in outcomes[1][1]


async def test_an_agent_that_exits_ends_its_episode_though_its_child_holds_its_output(
    chat_mesh, chat_model_dir, tmp_path
):
    pid_file = tmp_path / "child.pid"
    command = agent(
        tmp_path,
        "leaves_a_child.py",
        f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
print('{{"reward": 1.0}}', flush=True)
""",
    )
    try:
        [(status, detail)], _ = await run_episodes(
            chat_mesh, chat_model_dir, tmp_path, EnvironmentConfig(command=command, episode_deadline_seconds=60), 1
        )
        assert status == "SESSION_STATUS_DONE", detail
        child = int(pid_file.read_text())
        wait_until(lambda: not running(child), 10, "the agent's child to die with its episode")
    finally:
        if pid_file.exists() and running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_at_the_deadline_the_agents_whole_process_group_is_killed(chat_mesh, chat_model_dir, tmp_path):
    pid_file = tmp_path / "child.pid"
    command = agent(
        tmp_path,
        "hangs.py",
        f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(600)
""",
    )
    try:
        [(status, detail)], _ = await run_episodes(
            chat_mesh, chat_model_dir, tmp_path, EnvironmentConfig(command=command, episode_deadline_seconds=3), 1
        )
        assert status == "SESSION_STATUS_DEADLINE" and "episode_deadline_seconds (3)" in detail
        child = int(pid_file.read_text())
        wait_until(lambda: not running(child), 10, "the agent's child to be killed with its group")
    finally:
        if pid_file.exists() and running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_a_row_too_big_for_an_environment_variable_reaches_the_agent_in_a_file(
    chat_mesh, chat_model_dir, tmp_path
):
    command = agent(
        tmp_path,
        "reads_row.py",
        """
import json, os, sys
row = json.loads(open(os.environ["RLMESH_ROW_FILE"]).read())
inline = os.environ.get("RLMESH_ROW")
if inline is not None and json.loads(inline) != row:
    sys.exit("RLMESH_ROW differs from RLMESH_ROW_FILE")
print(json.dumps({"reward": len(row["document"]) + (0.5 if inline is not None else 0.0)}))
""",
    )
    config = EnvironmentConfig(command=command)
    big = TaskPrompt("p", text="Summarize.", metadata={"document": "x" * 200_000})
    small = TaskPrompt("p", text="Summarize.", metadata={"document": "x" * 100})
    [(status, detail)], _ = await run_episodes(chat_mesh, chat_model_dir, tmp_path, config, 1, big, "big")
    assert status == "SESSION_STATUS_DONE", detail
    assert chat_mesh[0].manager.state.sessions.get("big/p/0").reward == 200_000
    [(status, detail)], _ = await run_episodes(chat_mesh, chat_model_dir, tmp_path, config, 1, small, "small")
    assert status == "SESSION_STATUS_DONE", detail
    assert chat_mesh[0].manager.state.sessions.get("small/p/0").reward == 100.5


async def test_episodes_beyond_max_concurrent_wait_and_their_deadlines_start_with_them(
    chat_mesh, chat_model_dir, tmp_path
):
    log = tmp_path / "runs.jsonl"
    # Each agent takes well under the manager's step deadline (2 x 3 s) to close its session, and
    # the last of them starts well past it after the opening: timed from the opening, it would be reaped.
    command = agent(
        tmp_path,
        "slow.py",
        f"""
import json, os, time
started = time.time()
time.sleep(1.5)
with open({str(log)!r}, "a") as runs:
    runs.write(json.dumps([os.environ["RLMESH_SESSION_ID"], started, time.time()]) + "\\n")
""",
    )
    config = EnvironmentConfig(command=command, max_concurrent=1, step_deadline_seconds=3)
    outcomes, _ = await run_episodes(chat_mesh, chat_model_dir, tmp_path, config, 5)
    assert [status for status, _ in outcomes] == ["SESSION_STATUS_DONE"] * 5, outcomes
    runs = sorted((start, end) for _, start, end in map(json.loads, log.read_text().splitlines()))
    assert len(runs) == 5
    assert all(end <= next_start for (_, end), (next_start, _) in zip(runs, runs[1:])), "two agents ran at once"


async def test_a_task_that_refuses_agent_rewards_ignores_its_agents_report_and_its_gateway_refuses_one(
    chat_mesh, chat_model_dir, tmp_path
):
    command = agent(
        tmp_path,
        "self_scoring.py",
        """
import json, os, urllib.error, urllib.request
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/rlmesh/reward",
    data=json.dumps({"reward": 1.0}).encode(),
    headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"},
)
try:
    status = urllib.request.urlopen(request).status
except urllib.error.HTTPError as refused:
    status = refused.code
open(os.environ["RLMESH_SESSION_ID"].replace("/", "-") + ".posted", "w").write(str(status))
print('{"reward": 1.0}')
""",
    )
    sessions = chat_mesh[0].manager.state.sessions
    [(status, detail)], _ = await run_episodes(
        chat_mesh,
        chat_model_dir,
        tmp_path,
        EnvironmentConfig(command=command, agent_rewards=False),
        1,
        batch_id="refused",
    )
    assert status == "SESSION_STATUS_DONE", detail
    assert (tmp_path / "refused-p-0.posted").read_text() == "403" and sessions.get("refused/p/0").reward is None
    [(status, detail)], _ = await run_episodes(
        chat_mesh, chat_model_dir, tmp_path, EnvironmentConfig(command=command), 1, batch_id="allowed"
    )
    assert status == "SESSION_STATUS_DONE", detail
    assert (tmp_path / "allowed-p-0.posted").read_text() == "200" and sessions.get("allowed/p/0").reward == 1.0
