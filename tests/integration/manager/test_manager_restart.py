"""A manager killed with SIGKILL mid-batch and restarted on its journal goes on: the instances
carry on with it by themselves, the trainer's stream resumes, and every group arrives exactly once
with every sample's tokens counted once."""

from __future__ import annotations

import asyncio
import json

from rlmesh.common.v1 import common_pb2
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import stop_children, wait_started
from services.rollout.config import EngineConfig, RolloutConfig
from services.rollout.main import start as start_rollout
from services.rollout.synthetic_engine import SyntheticConfig, response_length
from services.trainer.mesh import MeshClient
from tests.support.credentials import loopback
from tests.support.processes import spawn_manager
from tests.support.waiting import wait_for

PROMPTS, GROUP_SIZE = 16, 2
SYNTHETIC = SyntheticConfig(length="fixed", mean_tokens=60, min_step_seconds=0.02, stream_interval=4)


async def test_a_killed_manager_restarted_on_its_journal_loses_and_repeats_nothing(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    journal = tmp_path / "manager-journal.sqlite"
    manager = spawn_manager(tmp_path, address, journal)
    children = [manager]
    client = MeshClient(address, address, rpc_timeout=5, manager_outage_seconds=60)
    instances = []
    try:
        await wait_started([manager])
        for i in range(2):
            instances.append(
                await start_rollout(
                    RolloutConfig(
                        server=loopback(),
                        instance_id=f"r{i}",
                        manager_address=address,
                        register_timeout_seconds=30,
                        engine=EngineConfig(
                            kind="synthetic", max_batch_size=4, saturation_batch_size=2, synthetic=SYNTHETIC
                        ),
                    )
                )
            )
        await wait_for(lambda: _instance_ids(client), timeout=30)
        before = {i.instance_id: i.incarnation for i in (await client.manager_status()).instances}
        seeded = common_pb2.SamplingParams(temperature=1.0, max_tokens=100, seed=5)
        await client.submit("b", 0, [(f"p{i}", [1, 2, 3]) for i in range(PROMPTS)], GROUP_SIZE, seeded)

        groups = []
        async for micro_batch in client.rollouts("b", 2, 1, 0, timeout=120):
            groups += micro_batch
            if manager in children and len(groups) >= 2:
                # Mid-batch: samples are running on both instances and some groups were sent.
                manager.process.kill()
                await asyncio.to_thread(manager.process.wait, 10)
                children.remove(manager)
                children.append(spawn_manager(tmp_path, address, journal))
        restarted = children[-1]
        assert restarted is not manager and restarted.process.poll() is None

        assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(PROMPTS))
        samples = [s for g in groups for s in g.samples]
        assert all(len(g.samples) == GROUP_SIZE for g in groups)
        # A sample continued after the restart has its tokens once: exactly the configured length.
        length = response_length(SYNTHETIC, 0, 100)
        assert [len(s.token_ids) for s in samples] == [length] * len(samples)
        status = await client.manager_status()
        after = {i.instance_id: i.incarnation for i in status.instances}
        # The instances carried on with the restarted manager under the incarnations it journaled.
        assert after == before
        assert [i.saturation_batch_size for i in status.instances] == [2, 2]
        assert status.published_version == 0
        (restored,) = [
            json.loads(line)
            for line in (tmp_path / "manager.log").read_text().splitlines()
            if "restored from the journal" in line
        ]
        assert restored["batches"] == 1 and restored["instances"] == 2
        assert restored["queued_samples"] > 0, "the kill came after every sample had finished"
    finally:
        await client.close()
        for instance in instances:
            await instance.stop()
        await asyncio.to_thread(stop_children, children)


async def _instance_ids(client: MeshClient) -> bool:
    return len((await client.manager_status()).instances) == 2
