"""Multi-turn sessions through faults, with real processes: an instance killed with SIGKILL mid-turn
(the turn continues on another instance from its tokens, none generated again), and the manager
killed with SIGKILL mid-session and restarted on its journal (the retried turns find theirs, every
session is delivered once with every turn's tokens once)."""

from __future__ import annotations

import asyncio

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import stop_children, wait_started
from rlmesh.manager.v1 import manager_pb2
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig
from services.rollout.main import start as start_rollout
from services.rollout.synthetic_engine import SyntheticConfig, response_length
from services.trainer.mesh import MeshClient
from tests.support.credentials import loopback
from tests.support.processes import spawn_manager, spawn_rollout
from tests.support.waiting import wait_for

SYNTHETIC = SyntheticConfig(length="fixed", mean_tokens=60, min_step_seconds=0.02, stream_interval=4)
TURN = response_length(SYNTHETIC, 0, 100)
SAMPLING = common_pb2.SamplingParams(temperature=1.0, max_tokens=100, seed=5)
MODEL = manager_pb2.SEGMENT_SOURCE_MODEL


async def episode(client: MeshClient, session_id: str, turns: int) -> None:
    for turn in range(turns):
        observation = manager_pb2.Segment(source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, token_ids=[1, 2, 3 + turn])
        await client.run_turn(
            manager_pb2.RunTurnRequest(session_id=session_id, turn=turn, append=[observation]), wait_seconds=30
        )
    await client.close_session(session_id, manager_pb2.SESSION_STATUS_DONE)


async def delivered(client: MeshClient, batch_id: str) -> list[manager_pb2.SessionTrajectory]:
    groups = []
    async for micro_batch in client.rollouts(batch_id, 4, 1, 0, timeout=120):
        groups += micro_batch
    return [s.session for g in groups for s in g.samples]


async def test_an_instance_killed_mid_turn_hands_the_turn_on_with_its_tokens(tmp_path):
    manager = await start_manager(ManagerConfig(server=loopback(), lease_seconds=10, heartbeat_interval_seconds=1))
    address = manager.server.address
    children = [
        spawn_rollout(
            tmp_path,
            address,
            f"r{i}",
            ENGINE__KIND="synthetic",
            ENGINE__MAX_BATCH_SIZE="4",
            ENGINE__SYNTHETIC__LENGTH="fixed",
            ENGINE__SYNTHETIC__MEAN_TOKENS="60",
            ENGINE__SYNTHETIC__MIN_STEP_SECONDS="0.02",
            ENGINE__SYNTHETIC__STREAM_INTERVAL="4",
        )
        for i in range(2)
    ]
    client = MeshClient(address, address, rpc_timeout=5)
    try:
        await wait_started(children)
        await wait_for(lambda: len(manager.state.instances) == 2, timeout=30)
        [handle] = await client.open_sessions(
            "killed", 0, [("p", [7, 8], SAMPLING)], 1, SAMPLING, manager_pb2.SessionLimits(max_turns=4), "faults"
        )
        running = asyncio.create_task(episode(client, handle.session_id, 2))
        session = manager.state.sessions.get(handle.session_id)
        await wait_for(
            lambda: (
                session.turn is not None and session.turn.instance_id is not None and len(session.turn.token_ids) >= 8
            ),
            timeout=30,
        )
        victim = next(c for c in children if c.name == session.turn.instance_id)
        victim.process.kill()
        await asyncio.wait_for(running, 60)
        [trajectory] = await delivered(client, "killed")
    finally:
        await client.close()
        await asyncio.to_thread(stop_children, children)
        await manager.stop()
    models = [s for s in trajectory.segments if s.source == MODEL]
    assert [len(m.token_ids) for m in models] == [TURN, TURN]
    assert models[0].instance_ids[0] == victim.name and len(models[0].instance_ids) == 2
    assert manager.state.request_table.continued_tokens >= 8


async def test_a_manager_killed_mid_session_goes_on_from_its_journal(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    journal = tmp_path / "manager-journal.sqlite"
    children = [spawn_manager(tmp_path, address, journal)]
    client = MeshClient(address, address, rpc_timeout=5, manager_outage_seconds=60)
    instances = []
    try:
        await wait_started(children)
        for i in range(2):
            instances.append(
                await start_rollout(
                    RolloutConfig(
                        server=loopback(),
                        instance_id=f"r{i}",
                        manager_address=address,
                        register_timeout_seconds=30,
                        engine=EngineConfig(kind="synthetic", max_batch_size=4, synthetic=SYNTHETIC),
                    )
                )
            )

        async def both_registered() -> bool:
            return len((await client.manager_status()).instances) == 2

        await wait_for(both_registered, timeout=30)
        handles = await client.open_sessions(
            "sessions", 0, [("p", [7, 8], SAMPLING)], 4, SAMPLING, manager_pb2.SessionLimits(max_turns=4), "faults"
        )
        episodes = [asyncio.create_task(episode(client, h.session_id, 2)) for h in handles]
        await wait_for(lambda: sum(i.engine.generated_tokens for i in instances) >= TURN * 4 + 20, timeout=60)
        # Mid-session: every session has finished a turn, and their second turns are generating.
        children[0].process.kill()
        await asyncio.to_thread(children[0].process.wait, 10)
        children.append(spawn_manager(tmp_path, address, journal))
        await asyncio.wait_for(asyncio.gather(*episodes), 120)
        trajectories = await delivered(client, "sessions")
    finally:
        await client.close()
        for instance in instances:
            await instance.stop()
        await asyncio.to_thread(stop_children, children)
    assert sorted(t.session_id for t in trajectories) == sorted(h.session_id for h in handles)
    for trajectory in trajectories:
        assert trajectory.status == manager_pb2.SESSION_STATUS_DONE and trajectory.turns == 2
        models = [s for s in trajectory.segments if s.source == MODEL]
        # Each turn's tokens once: exactly the synthetic length, however the restart cut them.
        assert [len(m.token_ids) for m in models] == [TURN] * 2
        assert [list(s.token_ids) for s in trajectory.segments if s.source != MODEL] == [[7, 8], [1, 2, 3], [1, 2, 4]]
