"""GenerateMany, the manager's dispatch path: many requests over one stream to a real rollout
server, each ending with a finishing chunk or its own refusal while the others go on; and a
manager that meets an instance predating it falls back to one Generate stream per request; and a
background batch reaches the engine as background work."""

import asyncio

import grpc
import pytest

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.trainer.mesh import MeshClient
from tests.support.clients import gather_batch
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.samples import prompt_batch, sampling


async def read_until_ended(
    call, endings: dict[str, int]
) -> tuple[dict[str, list[common_pb2.TokenChunk]], dict[str, rollout_pb2.GenerateRefusal]]:
    """Reads until each request id ended as many times as `endings` says (by a finishing chunk or a
    refusal); no chunk may follow its request's finishing chunk."""
    chunks: dict[str, list[common_pb2.TokenChunk]] = {}
    refusals: dict[str, rollout_pb2.GenerateRefusal] = {}
    finished: set[str] = set()
    left = dict(endings)
    while any(left.values()):
        response = await call.read()
        assert response is not grpc.aio.EOF, f"stream ended before {left}"
        for chunk in response.chunks:
            assert chunk.request_id not in finished, f"a chunk of {chunk.request_id} after its finishing one"
            chunks.setdefault(chunk.request_id, []).append(chunk)
            if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finished.add(chunk.request_id)
                left[chunk.request_id] -= 1
        for refusal in response.refusals:
            refusals[refusal.request_id] = refusal
            left[refusal.request_id] -= 1
    return chunks, refusals


async def test_one_stream_runs_many_requests_and_refuses_only_the_bad_ones(grpc_mesh, model_dir, channel_to):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_mesh.rollouts[0].server.address))
    prompts = prompt_batch(model_dir, 6)
    good = [
        rollout_pb2.GenerateRequest(request_id=f"good-{i}", prompt_token_ids=ids, sampling=sampling(model_dir, 6))
        for i, (_, ids) in enumerate(prompts[:4])
    ]
    bad_sampling = rollout_pb2.GenerateRequest(
        request_id="bad-sampling",
        prompt_token_ids=prompts[4][1],
        sampling=common_pb2.SamplingParams(temperature=-1.0, max_tokens=4),
    )
    other_version = rollout_pb2.GenerateRequest(
        request_id="other-version", prompt_token_ids=prompts[5][1], sampling=sampling(model_dir, 4), pinned_version=7
    )
    # Cancelled in the message that starts it: it ends with an ABORT before it reaches the engine.
    cancelled = rollout_pb2.GenerateRequest(
        request_id="cancelled",
        prompt_token_ids=prompts[0][1],
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=40),
    )
    call = stub.GenerateMany(timeout=60)
    await call.write(
        rollout_pb2.GenerateManyRequest(
            requests=[*good[:2], bad_sampling, cancelled, cancelled], cancel_request_ids=["cancelled"]
        )
    )
    await call.write(rollout_pb2.GenerateManyRequest(requests=[*good[2:], other_version]))
    chunks, refusals = await read_until_ended(
        call, {**{r.request_id: 1 for r in good}, "bad-sampling": 1, "other-version": 1, "cancelled": 2}
    )

    for request in good:
        received = chunks[request.request_id]
        tokens = [t for c in received for t in c.token_ids]
        assert 1 <= len(tokens) <= 6
        assert received[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert all(len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) for c in received)
    assert refusals["bad-sampling"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in refusals["bad-sampling"].message
    assert refusals["other-version"].code == grpc.StatusCode.ABORTED.value[0]
    assert [(list(c.token_ids), c.finish_reason) for c in chunks["cancelled"]] == [([], common_pb2.FINISH_REASON_ABORT)]
    # The same id twice while it ran: the second is refused, the first went on until cancelled.
    assert refusals["cancelled"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already running" in refusals["cancelled"].message

    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


@pytest.fixture
def rollouts_of_the_released_contract(monkeypatch):
    """Rollout servers as built before GenerateMany: calling it answers UNIMPLEMENTED."""
    register = rollout_pb2_grpc.add_RolloutServiceServicer_to_server

    class WithoutGenerateMany:
        def __init__(self, server):
            self.server = server

        def add_generic_rpc_handlers(self, handlers):
            self.server.add_generic_rpc_handlers(tuple(Released(h) for h in handlers))

        def add_registered_method_handlers(self, service, handlers):
            self.server.add_registered_method_handlers(
                service, {k: v for k, v in handlers.items() if k != "GenerateMany"}
            )

    class Released(grpc.GenericRpcHandler):
        def __init__(self, handler):
            self.handler = handler

        def service(self, details):
            return None if details.method.endswith("/GenerateMany") else self.handler.service(details)

    monkeypatch.setattr(
        rollout_pb2_grpc,
        "add_RolloutServiceServicer_to_server",
        lambda servicer, server: register(servicer, WithoutGenerateMany(server)),
    )


async def test_the_manager_runs_requests_one_stream_each_on_an_instance_without_generate_many(
    rollouts_of_the_released_contract, model_dir, channel_to
):
    mesh = await build_mesh(model_dir, "grpc")
    client = MeshClient(mesh.manager_address, mesh.weights_address, rpc_timeout=10)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(mesh.rollouts[0].server.address))
        call = stub.GenerateMany(timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

        await client.submit("batch-old", 0, prompt_batch(model_dir, 5), 3, sampling(model_dir))
        groups = await asyncio.wait_for(gather_batch(client, "batch-old", micro=5), 60)
    finally:
        await client.close()
        await stop_mesh(mesh)
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(5)]
    assert all(len(g.samples) == 3 and all(s.token_ids for s in g.samples) for g in groups)


async def test_a_background_batch_reaches_the_engine_as_background_work(grpc_mesh, model_dir):
    engine = grpc_mesh.rollouts[0].engine
    seen: dict[str, bool] = {}
    generate = engine.generate

    def recording(request):
        seen[request.request_id.split("/")[0]] = request.background
        return generate(request)

    engine.generate = recording
    client = MeshClient(grpc_mesh.manager_address, grpc_mesh.weights_address, rpc_timeout=10)
    try:
        await client.submit(
            "validation", 0, prompt_batch(model_dir, 2), 2, sampling(model_dir), exact_version=True, background=True
        )
        await client.submit("training", 0, prompt_batch(model_dir, 2), 2, sampling(model_dir))
        for batch_id in ("validation", "training"):
            await asyncio.wait_for(gather_batch(client, batch_id, micro=2), 60)
    finally:
        await client.close()
    assert seen == {"validation": True, "training": False}
