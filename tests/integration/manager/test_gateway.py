"""The OpenAI-compatible gateway driven by the official `openai` client against a real manager and torch
instance: the trajectory the trainer receives holds exactly the tokens the engine sampled (with
their logprobs and versions, model tokens apart from the rest), tool results render through the
chat template, an edited history is recorded as a break and trains as separate samples, streaming
works, text completions extend the stream token for token, a prompt past the session's room ends
it `truncated_context` with a reply instead of an error, a key reaches its own session only, a
killed gateway process comes back and goes on where it was, and the gateway knows sessions as they
open without reading them, yet never passes off a turn run elsewhere as its own. A stop string ends
the turn at the engine (its tokens kept, its text cut before the string), a task that scores itself
refuses its agents' rewards, and with the mesh's TLS the gateway serves HTTPS to an agent given the
mesh's CA."""

import asyncio
import os
import signal
import socket
import sys
import time

import httpx
import openai
import pytest

from rlmesh.chat.gateway_client import session_base_url, trust_environment
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.rpc.channels import open_channel, use_tls
from rlmesh.rpc.tls import create_certificates
from services.manager.gateway.openai_format import GatewayError
from services.manager.gateway.sessions import GatewaySessions
from services.trainer.trajectories import parts_of
from tests.support.clients import session_client, session_trajectories
from tests.support.credentials import roleless_certificate
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.waiting import wait_for

MODEL = manager_pb2.SEGMENT_SOURCE_MODEL


@pytest.fixture
async def gateway_mesh(chat_model_dir):
    mesh = await build_mesh(chat_model_dir, "grpc", gateway=True)
    channel = open_channel(mesh.manager_address)
    try:
        yield mesh, manager_pb2_grpc.ManagerServiceStub(channel)
    finally:
        await channel.close()
        await stop_mesh(mesh)


async def open_sessions(
    manager, chat_model_dir, count: int, batch_id: str = "agents", max_total_tokens: int = 0
) -> list[manager_pb2.SessionHandle]:
    stop = load_hf_tokenizer(chat_model_dir).convert_tokens_to_ids(IM_END_TOKEN)
    reply = await manager.OpenSessions(
        manager_pb2.OpenSessionsRequest(
            batch_id=batch_id,
            policy_version=0,
            task="harness",
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=[stop], seed=3),
            prompts=[manager_pb2.Prompt(prompt_id="p", n=count)],
            limits=manager_pb2.SessionLimits(max_turns=8, max_total_tokens=max_total_tokens),
        ),
        timeout=10,
    )
    return list(reply.sessions)


async def test_an_episode_through_the_openai_client_trains_exactly_the_sampled_tokens(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    [handle] = await open_sessions(manager, chat_model_dir, 1)
    tools = [
        {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
    ]
    tokenizer = load_hf_tokenizer(chat_model_dir)
    async with session_client(mesh, handle) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
        first = await client.chat.completions.create(model="tiny", messages=messages, tools=tools, logprobs=True)
        turns = [first.model_extra["rlmesh"]]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Again?"})
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        content, finish, usage, pieces = "", None, None, 0
        async for chunk in stream:
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                pieces += bool(chunk.choices[0].delta.content)
                finish = chunk.choices[0].finish_reason or finish
                if chunk.choices[0].finish_reason:
                    turns.append(chunk.model_extra["rlmesh"])
            usage = chunk.usage or usage
        assert finish in ("stop", "length") and usage.completion_tokens == len(turns[-1]["token_ids"])
        # The turn streams as it is decoded (one token a chunk from this engine), not in one piece at its end.
        printable = tokenizer.decode(turns[-1]["token_ids"], skip_special_tokens=True)
        assert content == printable and pieces >= min(2, len(printable))
    # The first reply's OpenAI logprobs are the extension's.
    assert [t.logprob for t in first.choices[0].logprobs.content] == pytest.approx(turns[0]["logprobs"])
    await manager.CloseSession(
        manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
        timeout=10,
    )
    [trajectory] = await session_trajectories(manager, "agents")
    models = [s for s in trajectory.segments if s.source == MODEL]
    assert [list(m.token_ids) for m in models] == [t["token_ids"] for t in turns]
    assert [list(m.logprobs) for m in models] == [pytest.approx(t["logprobs"]) for t in turns]
    assert [list(m.weight_versions) for m in models] == [t["weight_versions"] for t in turns]
    environment = [
        tokenizer.decode(s.token_ids) for s in trajectory.segments if s.source == manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
    ]
    assert environment == ["Be brief.", "What is 2+3?", "Again?"]
    [part] = parts_of(trajectory)
    trained = [t for t, m in zip(part.response_ids, part.mask) if m]
    assert trained == [t for m in models for t in m.token_ids]
    # The whole stream is the template's rendering of the conversation with the model's own tokens.
    assert tokenizer.decode(part.prompt_ids + part.response_ids).startswith(
        tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    )


async def test_tool_messages_render_through_the_chat_template(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    [handle] = await open_sessions(manager, chat_model_dir, 1, "tools")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
    }
    history = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    async with session_client(mesh, handle) as client:
        reply = await client.chat.completions.create(model="tiny", messages=history)
    assert reply.choices[0].message.role == "assistant"
    session = mesh.manager.state.sessions.get(handle.session_id)
    tokenizer = load_hf_tokenizer(chat_model_dir)
    rendered = tokenizer.decode(session.part_tokens()[: -len(reply.model_extra["rlmesh"]["token_ids"])])
    assert rendered.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


async def test_an_edited_history_is_a_break_trained_as_separate_samples(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    [handle] = await open_sessions(manager, chat_model_dir, 1, "edits")
    async with session_client(mesh, handle) as client:
        messages = [{"role": "user", "content": "Count."}]
        first = await client.chat.completions.create(model="tiny", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        second = await client.chat.completions.create(model="tiny", messages=messages)
        # The harness rewrites the model's first answer (summarizing, trimming): no longer a prefix.
        edited = [messages[0], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on."}]
        third = await client.chat.completions.create(model="tiny", messages=edited)
    assert third.model_extra["rlmesh"]["turn"] == 2
    await manager.CloseSession(
        manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
        timeout=10,
    )
    [trajectory] = await session_trajectories(manager, "edits")
    breaks = [s for s in trajectory.segments if s.starts_part]
    # Nothing before the edit is shared but the user's first message: the new part starts from scratch.
    assert len(breaks) == 1 and breaks[0].reused_prefix_tokens == 0 and breaks[0].break_cause == "content_mismatch"
    parts = parts_of(trajectory)
    assert len(parts) == 2
    first_ids = first.model_extra["rlmesh"]["token_ids"] + second.model_extra["rlmesh"]["token_ids"]
    assert [t for t, m in zip(parts[0].response_ids, parts[0].mask) if m] == first_ids
    assert [t for t, m in zip(parts[1].response_ids, parts[1].mask) if m] == third.model_extra["rlmesh"]["token_ids"]


async def test_text_completions_extend_the_stream_token_for_token_and_an_overflow_ends_the_session(
    gateway_mesh, chat_model_dir
):
    mesh, manager = gateway_mesh
    [handle] = await open_sessions(manager, chat_model_dir, 1, "text", max_total_tokens=80)
    tokenizer = load_hf_tokenizer(chat_model_dir)
    # The session named in a header instead of the base URL, the key as the bearer key.
    client = openai.AsyncOpenAI(
        base_url=f"http://{mesh.manager.gateway_address}/v1",
        api_key=handle.key,
        max_retries=0,
        timeout=60,
        default_headers={"x-rlmesh-session": handle.session_id},
    )
    async with client:
        first = await client.completions.create(model="tiny", prompt="Count: 1 2")
        first_turn = first.model_extra["rlmesh"]
        assert first.choices[0].text == tokenizer.decode(first_turn["token_ids"], skip_special_tokens=True)
        # The next prompt as token ids: the stream so far, the model's tokens exactly as sampled, then new ones.
        prompt_ids = (
            tokenizer.encode("Count: 1 2", add_special_tokens=False)
            + first_turn["token_ids"]
            + tokenizer.encode(" 3", add_special_tokens=False)
        )
        stream = await client.completions.create(model="tiny", prompt=prompt_ids, stream=True)
        chunks = [chunk async for chunk in stream]
        second_turn = chunks[-1].model_extra["rlmesh"]
        assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(
            second_turn["token_ids"], skip_special_tokens=True
        )
        assert second_turn["stream_tokens"] == len(prompt_ids) + len(second_turn["token_ids"])
        # A prompt past max_total_tokens: a reply (not an HTTP 400) that ends the session.
        overflow = await client.completions.create(
            model="tiny", prompt=prompt_ids + second_turn["token_ids"] + [5] * 80
        )
    assert (
        overflow.choices[0].finish_reason == "length"
        and overflow.model_extra["rlmesh"]["session_status"] == "truncated_context"
    )
    # The episode's owner settles it (the manager closed it first: that status stays).
    await manager.CloseSession(
        manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
        timeout=10,
    )
    [trajectory] = await session_trajectories(manager, "text")
    assert (
        trajectory.status == manager_pb2.SESSION_STATUS_TRUNCATED_CONTEXT
        and "max_total_tokens is 80" in trajectory.detail
    )
    models = [s for s in trajectory.segments if s.source == MODEL]
    assert [list(m.token_ids) for m in models] == [first_turn["token_ids"], second_turn["token_ids"]]
    assert [list(m.logprobs) for m in models] == [
        pytest.approx(first_turn["logprobs"]),
        pytest.approx(second_turn["logprobs"]),
    ]
    [part] = parts_of(trajectory)
    assert part.prompt_ids + part.response_ids == prompt_ids + second_turn["token_ids"]
    assert [t for t, m in zip(part.response_ids, part.mask) if m] == first_turn["token_ids"] + second_turn["token_ids"]


async def test_a_key_reaches_its_own_session_only(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    mine, theirs = await open_sessions(manager, chat_model_dir, 2, "keys")
    stranger = manager_pb2.SessionHandle(session_id=theirs.session_id, key=mine.key)
    async with session_client(mesh, stranger) as client:
        with pytest.raises(openai.AuthenticationError, match="no session"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    async with session_client(mesh, manager_pb2.SessionHandle(session_id=mine.session_id, key="wrong")) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with session_client(mesh, mine) as client:
        with pytest.raises(openai.BadRequestError, match="n: must be 1"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
        assert (await client.models.list()).data[0].object == "model"
    # The key in the base URL: one setting points a harness at its session, whatever bearer key it sends.
    address = mesh.manager.gateway_address
    in_url = openai.AsyncOpenAI(
        base_url=f"http://{address}/sessions/{mine.session_id}/key/{mine.key}/v1",
        api_key="anything",
        max_retries=0,
        timeout=60,
    )
    async with in_url as client:
        assert (await client.models.list()).data[0].object == "model"
    wrong_in_url = openai.AsyncOpenAI(
        base_url=f"http://{address}/sessions/{theirs.session_id}/key/{mine.key}/v1",
        api_key=theirs.key,
        max_retries=0,
        timeout=60,
    )
    async with wrong_in_url as client:
        with pytest.raises(openai.AuthenticationError, match="no session"):
            await client.models.list()


async def test_a_killed_gateway_process_is_started_again_and_the_episode_goes_on_token_for_token(
    gateway_mesh, chat_model_dir
):
    mesh, manager = gateway_mesh
    [handle] = await open_sessions(manager, chat_model_dir, 1, "restart")
    messages = [{"role": "user", "content": "Count."}]
    async with session_client(mesh, handle) as client:
        first = await client.chat.completions.create(model="tiny", messages=messages)
    gateway = mesh.manager.gateway
    killed = gateway.process.pid
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while gateway.process.pid == killed or not await gateway.healthy():
        assert time.monotonic() < deadline, "the manager did not start its gateway process again"
        await asyncio.sleep(0.2)
    # The new process knows nothing of the session but what the manager recorded: the conversation
    # matched so far and the turn's tokens, so the next request extends the stream without a break.
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    async with session_client(mesh, handle) as client:
        second = await client.chat.completions.create(model="tiny", messages=messages)
    assert second.model_extra["rlmesh"]["turn"] == 1
    await manager.CloseSession(
        manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
        timeout=10,
    )
    [trajectory] = await session_trajectories(manager, "restart")
    assert not any(s.starts_part for s in trajectory.segments)
    models = [list(s.token_ids) for s in trajectory.segments if s.source == MODEL]
    assert models == [first.model_extra["rlmesh"]["token_ids"], second.model_extra["rlmesh"]["token_ids"]]
    [part] = parts_of(trajectory)
    assert [t for t, m in zip(part.response_ids, part.mask) if m] == models[0] + models[1]


class CountingStub:
    """The manager's stub, counting the GetSession calls made through it."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self.loads = 0

    def GetSession(self, *args, **kwargs):
        self.loads += 1
        return self._stub.GetSession(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def test_sessions_are_known_as_they_open_and_a_first_turn_run_elsewhere_is_refused_not_replayed(
    gateway_mesh, chat_model_dir
):
    mesh, manager = gateway_mesh
    tokenizer = load_hf_tokenizer(chat_model_dir)
    stub = CountingStub(manager)
    sessions = GatewaySessions(stub, tokenizer, turn_timeout=60, rpc_timeout=10)
    following = asyncio.create_task(sessions.follow())
    try:
        # The gateway process follows the sessions too: this watcher is the second.
        await wait_for(lambda: len(mesh.manager.session_feed) == 2, what="the test's watcher beside the gateway's")
        fresh, ran_elsewhere = await open_sessions(manager, chat_model_dir, 2, "announced")
        await wait_for(lambda: ran_elsewhere.session_id in sessions._announced, what="the sessions announced")
        view = await sessions.authorized(fresh.session_id, fresh.key)
        assert view.announced and view.next_turn == 0 and view.stream == [] and stub.loads == 0
        user = [
            manager_pb2.Segment(source=manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, token_ids=tokenizer.encode("Count."))
        ]
        result = await sessions.run(view, user, None, view.sampling, [])
        assert result.segment is not None and view.next_turn == 1 and not view.announced
        assert view.stream == mesh.manager.state.sessions.get(fresh.session_id).part_tokens()

        # Turn 0 of the other ran through the contract: the gateway's first request must not get it back as its own.
        await manager.RunTurn(
            manager_pb2.RunTurnRequest(session_id=ran_elsewhere.session_id, turn=0, append=user), timeout=60
        )
        stale = await sessions.authorized(ran_elsewhere.session_id, ran_elsewhere.key)
        with pytest.raises(GatewayError) as refused:
            await sessions.run(stale, user + user, None, stale.sampling, [])
        assert refused.value.status == 409 and "did not know of" in str(refused.value)
        again = await sessions.authorized(ran_elsewhere.session_id, ran_elsewhere.key)
        assert stub.loads == 1 and again.next_turn == 1 and not again.announced
    finally:
        following.cancel()


async def test_a_stop_string_ends_the_turn_at_its_token_and_the_text_before_it(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    tokenizer = load_hf_tokenizer(chat_model_dir)
    greedy = common_pb2.SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    )
    reply = await manager.OpenSessions(
        manager_pb2.OpenSessionsRequest(
            batch_id="stops",
            policy_version=0,
            task="react",
            sampling=greedy,
            prompts=[manager_pb2.Prompt(prompt_id="p", n=2)],
            limits=manager_pb2.SessionLimits(max_turns=4),
        ),
        timeout=10,
    )
    free_handle, stopped_handle = reply.sessions
    async with session_client(mesh, free_handle) as client:
        free = await client.completions.create(model="tiny", prompt="Count: 1 2")
    free_tokens, text = free.model_extra["rlmesh"]["token_ids"], free.choices[0].text
    stop = text[1:3]
    assert len(stop) == 2, text
    async with session_client(mesh, stopped_handle) as client:
        stopped = await client.completions.create(model="tiny", prompt="Count: 1 2", stop=[stop])
    # The engine ended the turn at the token with which the text first held the stop string; the
    # turn keeps that token (what was sampled is what is trained), the text ends before the string.
    end = next(
        i for i in range(len(free_tokens)) if stop in tokenizer.decode(free_tokens[: i + 1], skip_special_tokens=True)
    )
    assert stopped.model_extra["rlmesh"]["token_ids"] == free_tokens[: end + 1]
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    session = mesh.manager.state.sessions.get(stopped_handle.session_id)
    assert [list(s.token_ids) for s in session.segments if s.source == MODEL] == [free_tokens[: end + 1]]


async def test_a_task_that_scores_itself_refuses_its_agents_rewards(gateway_mesh, chat_model_dir):
    mesh, manager = gateway_mesh
    [allowed] = await open_sessions(manager, chat_model_dir, 1, "agent-scored")
    refused = manager_pb2.OpenSessionsRequest(
        batch_id="task-scored",
        policy_version=0,
        task="harness",
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=4),
        prompts=[manager_pb2.Prompt(prompt_id="p", n=1)],
        limits=manager_pb2.SessionLimits(max_turns=2, refuse_agent_rewards=True),
    )
    [scored] = (await manager.OpenSessions(refused, timeout=10)).sessions
    async with httpx.AsyncClient(base_url=f"http://{mesh.manager.gateway_address}", timeout=30) as client:
        answer = await client.post(
            f"/sessions/{scored.session_id}/v1/rlmesh/reward",
            json={"reward": 1.0},
            headers={"authorization": f"Bearer {scored.key}"},
        )
        assert answer.status_code == 403 and "agent_rewards" in answer.json()["error"]["message"]
        answer = await client.post(
            f"/sessions/{allowed.session_id}/v1/rlmesh/reward",
            json={"reward": 0.25},
            headers={"authorization": f"Bearer {allowed.key}"},
        )
        assert answer.status_code == 200
    assert mesh.manager.state.sessions.get(allowed.session_id).reward == 0.25
    assert mesh.manager.state.sessions.get(scored.session_id).reward is None


AGENT = """
import openai
reply = openai.OpenAI(max_retries=0).chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "Count."}]
)
print(reply.model_extra["rlmesh"]["session_id"])
"""


async def test_with_mesh_tls_the_gateway_serves_https_to_an_agent_given_the_mesh_ca(chat_model_dir, tmp_path):
    files = create_certificates(tmp_path / "tls")
    # The test process hosts the services: its calls carry a certificate naming no role, and its roles' secrets.
    use_tls(roleless_certificate(tmp_path / "tls"))
    try:
        mesh = await build_mesh(chat_model_dir, "grpc", tls=files, gateway=True)
        channel = open_channel(mesh.manager_address)
        try:
            [handle] = await open_sessions(manager_pb2_grpc.ManagerServiceStub(channel), chat_model_dir, 1, "tls")
            address = mesh.manager.gateway_address
            # What an agent command is given, and nothing else: its base URL, its key, the CA bundle to trust.
            environment = {
                **os.environ,
                **trust_environment(),
                "OPENAI_BASE_URL": session_base_url(address, handle.session_id),
                "OPENAI_API_KEY": handle.key,
            }
            assert environment["OPENAI_BASE_URL"].startswith("https://")
            agent = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                AGENT,
                env=environment,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await agent.communicate()
            assert agent.returncode == 0 and out.decode().strip() == handle.session_id, err.decode()[-2000:]
            async with httpx.AsyncClient(timeout=10) as client:
                with pytest.raises(httpx.HTTPError):
                    await client.get(f"http://{address}/healthz")
        finally:
            await channel.close()
            await stop_mesh(mesh)
    finally:
        use_tls(None)


async def test_the_gateway_keeps_nothing_of_the_sessions_of_a_delivered_batch(gateway_mesh, chat_model_dir):
    """What the gateway holds is bounded by the sessions alive: once their batch is acknowledged,
    the manager tells it (WatchSessions) and it drops their views, those never asked for included."""
    mesh, manager = gateway_mesh
    handles = await open_sessions(manager, chat_model_dir, 3, "forgotten")
    health = f"http://{mesh.manager.gateway_address}/healthz"

    async def cached() -> int:
        async with httpx.AsyncClient(timeout=10) as http:
            return int((await http.get(health)).json()["sessions_cached"])

    for handle in handles[:2]:
        async with session_client(mesh, handle) as client:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count."}])
    assert await cached() == 2
    for handle in handles:
        await manager.CloseSession(
            manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
            timeout=10,
        )
    assert len(await session_trajectories(manager, "forgotten")) == 3
    await manager.AcknowledgeRollouts(manager_pb2.AcknowledgeRolloutsRequest(batch_id="forgotten"), timeout=10)
    deadline = time.monotonic() + 20
    while await cached():
        assert time.monotonic() < deadline, "the gateway kept the views of a delivered batch's sessions"
        await asyncio.sleep(0.1)
    async with session_client(mesh, handles[2]) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count."}])


async def test_a_gateway_port_in_use_stops_the_manager_before_it_serves_naming_the_port(chat_model_dir):
    from services.manager.config import ManagerConfig
    from services.manager.main import start as start_manager
    from tests.support.credentials import loopback

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = ManagerConfig(server=loopback(None, "manager"), gateway_port=port, model_dir=str(chat_model_dir))
        with pytest.raises(OSError, match=f"gateway cannot listen on 127.0.0.1:{port}"):
            await start_manager(config)
