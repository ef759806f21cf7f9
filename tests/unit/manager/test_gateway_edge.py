"""The gateway's HTTP edge, driven in-process (ASGI, no sockets) against a stand-in for the manager:
a malformed body is a 400 naming its field, never a 500; what the gateway cannot honour is refused
by name; `stop` ends the text before the stop string while the turn keeps its tokens; no log line
carries a session key; an unknown session id costs one GetSession, not one per request; a request
with a wrong key evicts no good view; a body over the limit is refused from its Content-Length, or
once the bytes read pass the limit; a task that takes no agent rewards refuses them with a 403."""

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from services.manager.gateway.app import MAX_BODY_BYTES, Gateway, create_app
from services.manager.gateway.sessions import ExpiringSet, GatewaySessions

KEY = "k" * 32
REPLY = "Action: look\nObservation: a door"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(build_text_tokenizer(), folder, model_max_length=512)
    return AutoTokenizer.from_pretrained(str(folder))


def not_found(session_id: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), f"no session {session_id!r}"
    )


class Manager:
    """The manager's session contract as the gateway calls it: known sessions, each turn answered
    with REPLY and the end-of-turn token, the calls counted."""

    def __init__(self, tokenizer, sessions: dict[str, manager_pb2.SessionLimits]) -> None:
        self.tokenizer = tokenizer
        self.limits = sessions
        self.streams: dict[str, list[int]] = {s: [] for s in sessions}
        self.loads: list[str] = []
        self.turns: list[manager_pb2.RunTurnRequest] = []
        self.rewards: list[manager_pb2.SetSessionRewardRequest] = []

    async def GetSession(self, request, **options):
        self.loads.append(request.session_id)
        if request.session_id not in self.limits:
            raise not_found(request.session_id)
        return manager_pb2.GetSessionResponse(
            session=manager_pb2.SessionTrajectory(
                session_id=request.session_id, status=manager_pb2.SESSION_STATUS_OPEN
            ),
            key=KEY,
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=32),
            refuse_agent_rewards=self.limits[request.session_id].refuse_agent_rewards,
        )

    async def RunTurn(self, request, **options):
        self.turns.append(request)
        stream = self.streams[request.session_id]
        if request.HasField("keep_tokens"):
            del stream[request.keep_tokens :]
        generated = self.tokenizer.encode(REPLY, add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
        ]
        stream += [t for segment in request.append for t in segment.token_ids] + generated
        segment = manager_pb2.Segment(
            source=manager_pb2.SEGMENT_SOURCE_MODEL,
            token_ids=generated,
            logprobs=[-0.5] * len(generated),
            weight_versions=[0] * len(generated),
            finish_reason=common_pb2.FINISH_REASON_STOP,
        )
        return manager_pb2.RunTurnResponse(
            generated=segment, status=manager_pb2.SESSION_STATUS_OPEN, stream_tokens=len(stream)
        )

    def StreamTurn(self, request, **options):
        async def stream():
            reply = await self.RunTurn(request.run)
            # Token by token, as an engine streams them: the text passes through the stop string.
            for end in range(1, len(reply.generated.token_ids) + 1):
                yield manager_pb2.StreamTurnResponse(token_ids=reply.generated.token_ids[:end])
            yield manager_pb2.StreamTurnResponse(result=reply)

        return stream()

    async def SetSessionReward(self, request, **options):
        self.rewards.append(request)
        return manager_pb2.SetSessionRewardResponse()


@pytest.fixture
def manager(tokenizer):
    return Manager(
        tokenizer,
        {
            "b/p/0": manager_pb2.SessionLimits(),
            "b/p/1": manager_pb2.SessionLimits(),
            "scored/p/0": manager_pb2.SessionLimits(refuse_agent_rewards=True),
        },
    )


@pytest.fixture
def sessions(manager, tokenizer):
    return GatewaySessions(manager, tokenizer, turn_timeout=5, rpc_timeout=5, capacity=2)


@pytest.fixture
async def client(sessions, tokenizer):
    app = create_app(Gateway(sessions, tokenizer, "tiny"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://gateway", headers={"authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


CHAT, TEXT, REWARD = (
    "/sessions/b/p/0/v1/chat/completions",
    "/sessions/b/p/0/v1/completions",
    "/sessions/b/p/0/v1/rlmesh/reward",
)
USER = {"role": "user", "content": "hi"}

MALFORMED = {
    "a text part null": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        "messages[0].content[0]",
    ),
    "a content part null": (CHAT, {"messages": [{"role": "user", "content": [None]}]}, "messages[0].content[0]"),
    "content a number": (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "a tool call not an object": (
        CHAT,
        {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [5]}, USER]},
        "messages[1].tool_calls[0]",
    ),
    "a tool call's function null": (
        CHAT,
        {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": None}]}, USER]},
        "messages[1].tool_calls[0].function",
    ),
    "a tool call's name a number": (
        CHAT,
        {"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}, USER]},
        "messages[1].tool_calls[0].function.name",
    ),
    "tool calls an object": (
        CHAT,
        {"messages": [USER, {"role": "assistant", "tool_calls": {"a": 1}}, USER]},
        "messages[1].tool_calls",
    ),
    "a role missing": (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    "a message a string": (CHAT, {"messages": ["hi"]}, "messages[0]"),
    "messages an object": (CHAT, {"messages": {"role": "user"}}, "messages"),
    "a tool not an object": (CHAT, {"messages": [USER], "tools": [3]}, "tools[0]"),
    "a tool without a name": (
        CHAT,
        {"messages": [USER], "tools": [{"type": "function", "function": {}}]},
        "tools[0].function",
    ),
    "tools a string": (CHAT, {"messages": [USER], "tools": "calculator"}, "tools"),
    "stream options a string": (
        CHAT,
        {"messages": [USER], "stream": True, "stream_options": "usage"},
        "stream_options",
    ),
    "stream a string": (CHAT, {"messages": [USER], "stream": "yes"}, "stream"),
    "max_tokens past uint32": (CHAT, {"messages": [USER], "max_tokens": 2**40}, "max_tokens"),
    "stop a number": (CHAT, {"messages": [USER], "stop": 5}, "stop"),
    "five stop strings": (TEXT, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "a token id past uint32": (TEXT, {"prompt": [5, 2**32]}, "prompt[1]"),
    "a negative token id": (TEXT, {"prompt": [-1]}, "prompt[0]"),
    "a token id a float": (TEXT, {"prompt": [5, 1.5]}, "prompt[1]"),
    "a batch of prompts": (TEXT, {"prompt": ["a", "b"]}, "prompt"),
    "a batch of token prompts": (TEXT, {"prompt": [[1, 2], [3]]}, "prompt"),
    "no prompt": (TEXT, {}, "prompt"),
    "a reward's turn past uint32": (REWARD, {"reward": 1.0, "turn": 2**32}, "turn"),
    "a negative turn": (REWARD, {"reward": 1.0, "turn": -1}, "turn"),
    "a reward past float32": (REWARD, {"reward": 1e39}, "reward"),
    "a reward true": (REWARD, {"reward": True}, "reward"),
}

UNSUPPORTED = {
    "n 2": (CHAT, {"messages": [USER], "n": 2}, "n"),
    "json output": (CHAT, {"messages": [USER], "response_format": {"type": "json_object"}}, "response_format"),
    "a required tool": (
        CHAT,
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        "tool_choice",
    ),
    "a named tool": (
        CHAT,
        {
            "messages": [USER],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tool_choice",
    ),
    "no tool while offering some": (
        CHAT,
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
        "tool_choice",
    ),
    "a logit bias": (CHAT, {"messages": [USER], "logit_bias": {"5": 10}}, "logit_bias"),
    "top logprobs": (CHAT, {"messages": [USER], "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    "a presence penalty": (CHAT, {"messages": [USER], "presence_penalty": 0.5}, "presence_penalty"),
    "legacy functions": (CHAT, {"messages": [USER], "functions": [{"name": "f"}]}, "functions"),
    "n 3 on text": (TEXT, {"prompt": "hi", "n": 3}, "n"),
    "best_of": (TEXT, {"prompt": "hi", "best_of": 2}, "best_of"),
    "echo": (TEXT, {"prompt": "hi", "echo": True}, "echo"),
    "a suffix": (TEXT, {"prompt": "hi", "suffix": "end"}, "suffix"),
    "text logprobs": (TEXT, {"prompt": "hi", "logprobs": 2}, "logprobs"),
    "a frequency penalty on text": (TEXT, {"prompt": "hi", "frequency_penalty": 1}, "frequency_penalty"),
}


@pytest.mark.parametrize("name", list(MALFORMED) + list(UNSUPPORTED))
async def test_a_malformed_or_unsupported_field_is_a_400_naming_it(client, manager, name):
    path, body, field = {**MALFORMED, **UNSUPPORTED}[name]
    reply = await client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"{field}: ") and error["param"] == field, error
    assert not manager.turns and not manager.rewards


async def test_what_the_gateway_supports_is_taken(client, manager):
    body = {
        "messages": [USER],
        "n": 1,
        "tool_choice": "auto",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "presence_penalty": 0,
        "top_logprobs": 0,
        "logprobs": False,
        "stream_options": None,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert (
        await client.post(TEXT, json={"prompt": "hi", "best_of": 1, "echo": False, "suffix": None, "logprobs": 0})
    ).status_code == 200


async def test_stop_strings_reach_the_turn_and_the_text_ends_before_them(client, manager, tokenizer):
    chat = await client.post(CHAT, json={"messages": [USER], "stop": ["Observation:"]})
    assert chat.json()["choices"][0]["message"]["content"] == "Action: look\n"
    assert list(manager.turns[-1].sampling.stop) == ["Observation:"]
    # The turn's tokens stay as sampled: the extension carries all of them.
    assert tokenizer.decode(chat.json()["rlmesh"]["token_ids"], skip_special_tokens=True) == REPLY
    text = await client.post("/sessions/b/p/1/v1/completions", json={"prompt": "Thought:", "stop": "\nObs"})
    assert text.json()["choices"][0]["text"] == "Action: look" and list(manager.turns[-1].sampling.stop) == ["\nObs"]
    streamed = await client.post(
        "/sessions/b/p/1/v1/completions", json={"prompt": "Thought: again", "stop": "door", "stream": True}
    )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "Action: look\nObservation: a "
    # A streamed chat turn never shows the start of a stop string it may yet complete.
    chat = await client.post(CHAT, json={"messages": [USER], "stop": ["Observation:"], "stream": True})
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"].get("content")
        for line in chat.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(d for d in deltas if d) == "Action: look\n" and all("Obs" not in d for d in deltas if d)


async def test_no_log_line_carries_a_session_key(client, manager):
    with capture_logs() as logs:
        for path in (f"/sessions/b/p/0/key/{KEY}/v1/chat/completions", f"/sessions/b/p/0/key/{KEY[:-1]}x/v1/models"):
            reply = (
                await client.post(path, json={"messages": [{"role": 7}]}) if "chat" in path else await client.get(path)
            )
            assert reply.status_code in (400, 401)
    assert logs and not any(KEY[:-1] in json.dumps(entry, default=str) for entry in logs), logs


async def test_a_key_in_its_header_reaches_its_session(client):
    reply = await client.get(
        "/sessions/b/p/0/v1/models", headers={"authorization": "Bearer not-this-one", "x-rlmesh-session-key": KEY}
    )
    assert reply.status_code == 200


async def test_an_unknown_session_costs_one_load_until_it_is_announced(client, manager, sessions):
    for _ in range(5):
        assert (await client.get("/sessions/later/p/0/v1/models")).status_code == 401
    assert manager.loads == ["later/p/0"]
    sessions.announce([manager_pb2.OpenedSession(session_id="later/p/0", key=KEY)])
    assert (await client.get("/sessions/later/p/0/v1/models")).status_code == 200
    assert manager.loads == ["later/p/0"]


def test_an_unknown_id_is_forgotten_after_its_time_and_the_set_stays_bounded():
    now = [0.0]
    unknown = ExpiringSet(2.0, capacity=3, clock=lambda: now[0])
    unknown.add("a")
    assert unknown.known("a")
    now[0] = 2.5
    assert not unknown.known("a")
    for name in "bcdef":
        unknown.add(name)
    assert len(unknown) == 3 and not unknown.known("b") and unknown.known("f")
    now[0] = 10.0
    unknown.add("g")
    assert len(unknown) == 1


async def test_requests_with_a_wrong_key_evict_no_good_view(client, manager, sessions):
    assert (await client.get("/sessions/b/p/0/v1/models")).status_code == 200
    for session_id in ("b/p/1", "scored/p/0", "b/p/1"):
        assert (
            await client.get(f"/sessions/{session_id}/v1/models", headers={"authorization": "Bearer wrong"})
        ).status_code == 401
    assert (await client.get("/sessions/b/p/0/v1/models")).status_code == 200
    # b/p/0 was read once; the wrong key's sessions once each (kept apart), and no view of theirs is kept.
    assert manager.loads == ["b/p/0", "b/p/1", "scored/p/0"] and len(sessions) == 1
    assert (await client.get("/sessions/b/p/1/v1/models")).status_code == 200
    assert manager.loads == ["b/p/0", "b/p/1", "scored/p/0"] and len(sessions) == 2


async def test_a_body_over_the_limit_is_refused_from_its_length_or_as_it_passes_the_limit(client):
    declared = await client.post(CHAT, content=b"{}", headers={"content-length": str(MAX_BODY_BYTES + 1)})
    assert declared.status_code == 413 and "over" in declared.json()["error"]["message"]
    read = []

    async def endless() -> AsyncIterator[bytes]:
        for _ in range(64):
            read.append(1)
            yield b" " * (1 << 20)

    streamed = await client.post(CHAT, content=endless())
    assert streamed.status_code == 413 and "over" in streamed.json()["error"]["message"]
    assert len(read) <= (MAX_BODY_BYTES >> 20) + 2


async def test_a_task_that_scores_itself_refuses_its_agents_rewards(client, manager):
    refused = await client.post("/sessions/scored/p/0/v1/rlmesh/reward", json={"reward": 1.0})
    assert refused.status_code == 403 and "agent_rewards" in refused.json()["error"]["message"]
    taken = await client.post(REWARD, json={"reward": 0.5, "turn": 2})
    assert taken.status_code == 200 and [(r.session_id, r.reward, r.turn) for r in manager.rewards] == [
        ("b/p/0", 0.5, 2)
    ]


async def test_an_unknown_route_or_method_gets_an_openai_error_that_does_not_repeat_the_path(client):
    missing = await client.post(f"/sessions/b/p/0/key/{KEY}/v2/chat/completions", json={})
    assert (
        missing.status_code == 404 and "no such route" in missing.json()["error"]["message"] and KEY not in missing.text
    )
    wrong_method = await client.delete("/sessions/b/p/0/v1/chat/completions")
    assert wrong_method.status_code == 405 and "DELETE is not allowed" in wrong_method.json()["error"]["message"]
