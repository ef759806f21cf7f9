"""Harnesses as they are written in the wild, through the OpenAI gateway against a real manager (the
model's turns scripted on the rollout instance, so they hold tool calls and <think> blocks): a
Go-style harness that re-serializes tool arguments, one that strips the whitespace and <think>
blocks of the model's turns, and one that sends text as parts each run 3-turn episodes without a
break; what a streamed turn sends is what its echo matches; a chat request after a completions
turn breaks where the chat left off; `refuse` turns a break into a 409 naming the message; and a
retry with another body at the same turn is refused, not given the first body's reply."""

import asyncio
import json

import openai
import pytest

from rlmesh.chat.tool_calls import tool_call_text
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2, manager_pb2_grpc
from rlmesh.models.tokenizer import IM_END_TOKEN, load_hf_tokenizer
from rlmesh.rpc.channels import open_channel
from services.rollout.engine import Chunk, Finish
from services.trainer.trajectories import parts_of
from tests.support.clients import session_client, session_trajectories
from tests.support.meshes import build_mesh, stop_mesh
from tests.support.waiting import wait_for

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}]


class ScriptedModel:
    """The rollout instance's engine answering turn k of every session with `replies[k]` (its
    tokens, then the stop token), once `released` (set unless a test holds it)."""

    def __init__(self, engine, tokenizer, replies: list[str]) -> None:
        self.engine, self.tokenizer, self.replies = engine, tokenizer, replies
        self.released = asyncio.Event()
        self.released.set()

    async def generate(self, request):
        await self.released.wait()
        turn = int(request.request_id.rsplit("#", 1)[1].split("@")[0])
        ids = self.tokenizer.encode(self.replies[turn], add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
        ]
        yield Chunk(request.request_id, ids, [-1.0] * len(ids), [self.engine.weight_version] * len(ids), Finish.STOP)


@pytest.fixture
async def scripted(chat_model_dir, monkeypatch, request):
    """A mesh with its gateway whose model says what `script` (a list of replies, set by the test) says."""
    mesh = await build_mesh(chat_model_dir, "grpc", gateway=True, **getattr(request, "param", {}))
    channel = open_channel(mesh.manager_address)
    engine = mesh.rollouts[0].engine
    model = ScriptedModel(engine, load_hf_tokenizer(chat_model_dir), [])
    monkeypatch.setattr(engine, "generate", model.generate)
    try:
        yield mesh, manager_pb2_grpc.ManagerServiceStub(channel), model
    finally:
        await channel.close()
        await stop_mesh(mesh)


async def open_session(
    manager, chat_model_dir, batch_id: str, refuse_breaks: bool = False
) -> manager_pb2.SessionHandle:
    stop = load_hf_tokenizer(chat_model_dir).convert_tokens_to_ids(IM_END_TOKEN)
    reply = await manager.OpenSessions(
        manager_pb2.OpenSessionsRequest(
            batch_id=batch_id,
            policy_version=0,
            task="harness",
            prompts=[manager_pb2.Prompt(prompt_id="p", n=1)],
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=200, stop_token_ids=[stop], seed=3),
            limits=manager_pb2.SessionLimits(max_turns=8, refuse_breaks=refuse_breaks),
        ),
        timeout=10,
    )
    return reply.sessions[0]


async def closed_trajectory(manager, handle, batch_id: str) -> manager_pb2.SessionTrajectory:
    await manager.CloseSession(
        manager_pb2.CloseSessionRequest(session_id=handle.session_id, status=manager_pb2.SESSION_STATUS_DONE),
        timeout=10,
    )
    [trajectory] = await session_trajectories(manager, batch_id)
    return trajectory


def go_style(arguments: str) -> str:
    """What a Go harness sends back after decoding the arguments into a map: sorted keys, no spaces,
    `<`, `>` and `&` escaped."""
    text = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


async def test_a_go_style_harness_runs_three_turns_without_a_break(scripted, chat_model_dir):
    mesh, manager, model = scripted
    model.replies = [
        tool_call_text("calculator", {"expression": "2+3", "note": "a < b", "digits": 2.0}),
        "Checking. " + tool_call_text("calculator", {"expression": "5*5"}),
        "It is 25.",
    ]
    handle = await open_session(manager, chat_model_dir, "go")
    messages = [{"role": "user", "content": "What is (2+3)^2?"}]
    async with session_client(mesh, handle) as client:
        for turn in range(3):
            reply = (
                (await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)).choices[0].message
            )
            echoed = {"role": "assistant"}
            if reply.content:
                echoed["content"] = reply.content
            if reply.tool_calls:
                echoed["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": go_style(c.function.arguments)},
                    }
                    for c in reply.tool_calls
                ]
                assert echoed["tool_calls"][0]["function"]["arguments"] != reply.tool_calls[0].function.arguments
            messages.append(echoed)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "5"} for c in reply.tool_calls or []]
            if turn == 2:
                assert reply.content == "It is 25." and not reply.tool_calls
    trajectory = await closed_trajectory(manager, handle, "go")
    assert trajectory.turns == 3 and not any(s.starts_part for s in trajectory.segments)
    assert not mesh.manager.state.sessions.breaks_by_cause


async def test_a_harness_stripping_whitespace_and_think_blocks_runs_three_turns_without_a_break(
    scripted, chat_model_dir
):
    mesh, manager, model = scripted
    model.replies = ["<think>2 and 3 make 5.</think>\n  It is 5.\n\n", "\n<think>\nTimes 5.\n</think>25  ", "  Done.\n"]
    handle = await open_session(manager, chat_model_dir, "strip")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    async with session_client(mesh, handle) as client:
        for follow_up in ("Times 5?", "Thanks."):
            reply = (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message
            shown = reply.content.split("</think>")[-1].strip()
            messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": follow_up}]
        last = (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message
    assert messages[2]["content"] == "It is 5." and last.content == "  Done.\n"
    trajectory = await closed_trajectory(manager, handle, "strip")
    assert trajectory.turns == 3 and not any(s.starts_part for s in trajectory.segments)


async def test_a_harness_sending_text_parts_runs_three_turns_without_a_break(scripted, chat_model_dir):
    mesh, manager, model = scripted
    model.replies = ["It is 5.", "It is 25.", "Done."]
    handle = await open_session(manager, chat_model_dir, "parts")
    tokenizer = load_hf_tokenizer(chat_model_dir)

    def parts(text: str) -> list[dict]:
        middle = len(text) // 2
        return [{"type": "text", "text": text[:middle]}, {"type": "text", "text": text[middle:]}]

    messages = [{"role": "system", "content": parts("Be brief.")}, {"role": "user", "content": parts("What is 2+3?")}]
    async with session_client(mesh, handle) as client:
        for follow_up in ("Times 5?", "Thanks."):
            reply = (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message
            messages += [
                {"role": "assistant", "content": parts(reply.content)},
                {"role": "user", "content": parts(follow_up)},
            ]
        await client.chat.completions.create(model="tiny", messages=messages)
        with pytest.raises(openai.BadRequestError, match="image_url"):
            await client.chat.completions.create(
                model="tiny",
                messages=[
                    *messages[:-1],
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "And this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                        ],
                    },
                ],
            )
    trajectory = await closed_trajectory(manager, handle, "parts")
    assert trajectory.turns == 3 and not any(s.starts_part for s in trajectory.segments)
    environment = [
        tokenizer.decode(s.token_ids) for s in trajectory.segments if s.source == manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
    ]
    assert environment == ["Be brief.", "What is 2+3?", "Times 5?", "Thanks."]


async def stream_turn(client, messages, **options) -> dict:
    """A streamed turn as a harness accumulates it: the message it echoes back."""
    content, calls = "", {}
    async for chunk in await client.chat.completions.create(model="tiny", messages=messages, stream=True, **options):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def test_what_a_streamed_turn_sends_is_what_its_echo_matches(scripted, chat_model_dir):
    mesh, manager, model = scripted
    call = tool_call_text("calculator", {"expression": "2+3"})
    model.replies = ["Let me compute. " + call, "Again: " + call, "It is 5."]
    handle = await open_session(manager, chat_model_dir, "streams")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    async with session_client(mesh, handle) as client:
        # Without tools a written call is text: it streams as content and comes back as such.
        first = await stream_turn(client, messages)
        assert first == {"role": "assistant", "content": "Let me compute. " + call}
        messages += [first, {"role": "user", "content": "Use the tool."}]
        # With tools the call is no content: it streams as a tool call only.
        second = await stream_turn(client, messages, tools=TOOLS)
        assert second["content"] == "Again:" and second["tool_calls"][0]["function"]["name"] == "calculator"
        messages += [second, {"role": "tool", "tool_call_id": second["tool_calls"][0]["id"], "content": "5"}]
        third = (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message
    assert third.content == "It is 5."
    trajectory = await closed_trajectory(manager, handle, "streams")
    assert trajectory.turns == 3 and not any(s.starts_part for s in trajectory.segments)


async def test_a_chat_request_after_a_completions_turn_breaks_where_the_chat_left_off(scripted, chat_model_dir):
    mesh, manager, model = scripted
    model.replies = ["It is 5.", " 6 7", "It is 25."]
    handle = await open_session(manager, chat_model_dir, "mixed")
    tokenizer = load_hf_tokenizer(chat_model_dir)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    async with session_client(mesh, handle) as client:
        first = await client.chat.completions.create(model="tiny", messages=messages)
        chat_end = first.model_extra["rlmesh"]["stream_tokens"]
        stream = mesh.manager.state.sessions.get(handle.session_id).part_tokens()
        await client.completions.create(model="tiny", prompt=tokenizer.decode(stream) + "Count on: 5")
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Times 5?"}]
        await client.chat.completions.create(model="tiny", messages=messages)
    trajectory = await closed_trajectory(manager, handle, "mixed")
    [part_start] = [s for s in trajectory.segments if s.starts_part]
    assert part_start.break_cause == "mixed_endpoints" and part_start.reused_prefix_tokens == chat_end
    # The new part is the chat: its messages through the template, with the model's own first turn.
    last = parts_of(trajectory)[-1]
    assert tokenizer.decode(last.response_ids) == f"It is 25.{IM_END_TOKEN}"
    assert tokenizer.decode(last.prompt_ids) == tokenizer.apply_chat_template(
        [*messages[:1], {"role": "assistant", "content": "It is 5."}, messages[2]],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert mesh.manager.state.sessions.breaks_by_cause == {"mixed_endpoints": 1}


async def test_a_session_that_refuses_breaks_answers_409_naming_the_message(scripted, chat_model_dir):
    mesh, manager, model = scripted
    model.replies = ["It is 5.", "It is 25.", "Done."]
    refusing = await open_session(manager, chat_model_dir, "refuse", refuse_breaks=True)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    async with session_client(mesh, refusing) as client:
        first = (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message
        rewritten = [*messages, {"role": "assistant", "content": "Five."}, {"role": "user", "content": "Times 5?"}]
        with pytest.raises(
            openai.ConflictError, match=r"messages\[1\] \(assistant\) differs .*content_mismatch.*on_break"
        ):
            await client.chat.completions.create(model="tiny", messages=rewritten)
        # The session is as it was: the harness goes on with the history it was given.
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Times 5?"}]
        await client.chat.completions.create(model="tiny", messages=messages)
    trajectory = await closed_trajectory(manager, refusing, "refuse")
    assert trajectory.turns == 2 and not any(s.starts_part for s in trajectory.segments)
    assert not mesh.manager.state.sessions.breaks_by_cause


@pytest.mark.parametrize("scripted", [{"gateway_turn_timeout_seconds": 2.0}], indirect=True)
async def test_a_retry_with_another_body_is_refused_not_given_the_first_reply(scripted, chat_model_dir):
    mesh, manager, model = scripted
    model.replies = ["It is 5."]
    handle = await open_session(manager, chat_model_dir, "retry")
    model.released.clear()
    async with session_client(mesh, handle) as client:
        # The turn outlives the gateway's wait for it: a 504, the turn still running on the manager.
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2+3?"}])
        with pytest.raises(openai.ConflictError, match="turn 0 was asked for with other segments to append"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 3+4?"}])
    model.released.set()
    session = mesh.manager.state.sessions.get(handle.session_id)
    await wait_for(lambda: session.turn is None, what="turn 0 to end")
    trajectory = await closed_trajectory(manager, handle, "retry")
    tokenizer = load_hf_tokenizer(chat_model_dir)
    environment = [
        tokenizer.decode(s.token_ids) for s in trajectory.segments if s.source == manager_pb2.SEGMENT_SOURCE_ENVIRONMENT
    ]
    assert trajectory.turns == 1 and environment == ["What is 2+3?"]
    assert tokenizer.decode(trajectory.segments[-1].token_ids) == f"It is 5.{IM_END_TOKEN}"
