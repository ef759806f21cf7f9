"""Exactly-once rollout delivery: the trainer's stream to a real manager runs through a proxy that
cuts the TCP connection after a drawn number of bytes, so replies are lost half-sent or sent and
never read; every group must still arrive exactly once, and the read batch be acknowledged."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmesh.common.v1 import common_pb2
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.manager.relay.config import RelayConfig
from services.manager.relay.main import start as start_relay
from services.rollout.config import EngineConfig, RolloutConfig
from services.rollout.main import start as start_rollout
from services.rollout.synthetic_engine import SyntheticConfig
from services.trainer.mesh import MeshClient
from tests.support.credentials import loopback
from tests.support.waiting import wait_for

PROMPTS = 10
GROUP_SIZE = 2
batch_numbers = itertools.count()


class CuttingProxy:
    """Forwards TCP to the manager. The n-th connection is cut (both sides aborted) once the
    manager has sent it cuts[n] bytes; connections beyond the list are not cut."""

    def __init__(self, target_port: int, cuts: list[int]) -> None:
        self.target_port = target_port
        self.cuts = list(cuts)
        self.cut_connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _connect(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        budget = self.cuts.pop(0) if self.cuts else None
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        writers = (client_writer, upstream_writer)

        def cut() -> None:
            self.cut_connections += 1
            for writer in writers:
                writer.transport.abort()

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(4096):
                    if limit is not None and len(data) >= limit:
                        writer.write(data[:limit])
                        await writer.drain()
                        cut()
                        return
                    if limit is not None:
                        limit -= len(data)
                    writer.write(data)
                    await writer.drain()
            for w in writers:
                w.transport.abort()

        tasks = [
            asyncio.create_task(pipe(client_reader, upstream_writer, None)),
            asyncio.create_task(pipe(upstream_reader, client_writer, budget)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["manager relays", "relay shards"])
async def manager(request):
    """The manager relaying every token itself, or two relay shards holding them with a queue ahead:
    reports gathered over a quarter second, the instance given four requests beyond its batch of
    eight (a group's requests start as others end, on the engine's queue)."""
    shards = request.param == "relay shards"
    relays = [
        await start_relay(RelayConfig(server=loopback(), report_window_seconds=0.25)) for _ in range(2 if shards else 0)
    ]
    manager = await start_manager(
        ManagerConfig(
            server=loopback(),
            relay_addresses=[relay.server.address for relay in relays],
            queue_ahead=4 if shards else 0,
        )
    )
    synthetic = SyntheticConfig(
        length="uniform", mean_tokens=20, throughput_tokens_per_second=20000, min_step_seconds=0.001
    )
    rollout = await start_rollout(
        RolloutConfig(
            server=loopback(),
            instance_id="fast",
            manager_address=manager.server.address,
            engine=EngineConfig(kind="synthetic", max_batch_size=8 if shards else 64, synthetic=synthetic),
            register_timeout_seconds=10,
        )
    )
    await wait_for(lambda: "fast" in manager.state.instances)
    try:
        yield manager, relays
    finally:
        await rollout.stop()
        await manager.stop()
        for relay in relays:
            await relay.stop()


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(min_value=0, max_value=2500), max_size=4),
    micro_batch_groups=st.integers(1, 4),
    wait_for_all=st.booleans(),
)
async def test_every_group_arrives_exactly_once_however_the_stream_is_cut(
    manager, cuts, micro_batch_groups, wait_for_all
):
    manager, relays = manager
    batch_id = f"b{next(batch_numbers)}"
    relayed_before = sum(relay.shard.store.accepted_tokens for relay in relays)
    direct = MeshClient(manager.server.address, manager.server.address, rpc_timeout=5)
    proxy = CuttingProxy(manager.server.port, cuts)
    proxied = MeshClient(await proxy.start(), manager.server.address, rpc_timeout=5, manager_outage_seconds=30)
    try:
        await direct.submit(
            batch_id,
            0,
            [(f"p{i}", [1, 2, 3]) for i in range(PROMPTS)],
            GROUP_SIZE,
            common_pb2.SamplingParams(temperature=1.0, max_tokens=40),
        )
        if wait_for_all:
            # Everything ready at once: large replies, cut in the middle of a micro-batch's bytes.
            await wait_for(lambda: len(manager.state.batches[batch_id].ready) == PROMPTS)
        read, delivered_tokens = [], 0
        async for groups in proxied.rollouts(batch_id, micro_batch_groups, 1, 0, timeout=30):
            assert 1 <= len(groups) <= micro_batch_groups
            read += [g.prompt_id for g in groups]
            assert all(len(g.samples) == GROUP_SIZE for g in groups)
            samples = [s for g in groups for s in g.samples]
            assert all(0 < len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) for s in samples)
            assert not any(s.HasField("relayed") for s in samples)
            delivered_tokens += sum(len(s.token_ids) for s in samples)
        assert sorted(read) == sorted(f"p{i}" for i in range(PROMPTS)), f"read {read} with {proxy.cut_connections} cuts"
        assert batch_id not in manager.state.batches, "the batch read was not acknowledged"
        if relays:
            # Every token went past the manager: the shards held them, and dropped them once read.
            assert not any(r.request.token_ids for r in manager.state.requests.values())
            await wait_for(lambda: not any(relay.shard.store.payloads for relay in relays))
            assert delivered_tokens <= sum(relay.shard.store.accepted_tokens for relay in relays) - relayed_before
    finally:
        await proxy.stop()
        await proxied.close()
        await direct.close()
