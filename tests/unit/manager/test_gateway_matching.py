"""Matching a harness's messages against a session's conversation: what harnesses commonly change
in what they echo back (tool-call arguments re-serialized, whitespace or <think> blocks stripped
from the model's turns, text given as parts) still matches the model's turns, a message's `name`
counts, and every break names its cause."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rlmesh.chat.tool_calls import tool_call_text
from rlmesh.chat.turns import ChatTurns, RenderError
from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from services.manager.domain.conversations import (
    BREAK_CAUSES,
    COMPLETIONS_KEY,
    ConversationError,
    LoggedMessage,
    canonical_arguments,
    message_key,
    plan_turn,
)
from services.manager.gateway.sessions import model_turn

QUESTION = {"role": "user", "content": "What is 2+3?"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "5"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(build_text_tokenizer(), folder, model_max_length=512)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def turns(tokenizer):
    return ChatTurns(tokenizer)


def answered(tokenizer, text: str, **tools) -> tuple[dict, list[LoggedMessage]]:
    """The model wrote `text` after QUESTION: the assistant message the gateway returned and the log."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    segment = manager_pb2.Segment(
        source=manager_pb2.SEGMENT_SOURCE_MODEL, token_ids=ids, finish_reason=common_pb2.FINISH_REASON_STOP
    )
    message, _, logged = model_turn(tokenizer, "b/p/0", 0, segment, 20 + len(ids), **tools)
    return message, [LoggedMessage(message_key(QUESTION)), logged]


def assert_extends(plan, log) -> None:
    assert plan.keep_tokens is None and plan.kept == log and plan.cause == ""


def go_style(arguments: str) -> str:
    """How Go's encoding/json writes a decoded object: sorted keys, no spaces, <, > and & escaped."""
    text = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def shuffled(value, rng: random.Random):
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: shuffled(value[key], rng) for key in keys}
    return [shuffled(v, rng) for v in value] if isinstance(value, list) else value


@settings(max_examples=200, deadline=None)
@given(
    arguments=st.dictionaries(st.text(max_size=5), JSON, max_size=5),
    seed=st.integers(0, 2**16),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")]),
    ascii_only=st.booleans(),
)
def test_any_serialization_of_the_same_arguments_is_one_canonical_form(arguments, seed, separators, ascii_only):
    written = json.dumps(arguments)
    again = json.dumps(shuffled(arguments, random.Random(seed)), separators=separators, ensure_ascii=ascii_only)
    assert canonical_arguments(written) == canonical_arguments(again) == canonical_arguments(json.loads(again))


def test_tool_arguments_re_serialized_by_another_language_match(tokenizer, turns):
    call = tool_call_text("calculator", {"expression": "2+3 < 6", "precision": 2.0, "units": {"z": 1, "a": [1, 2]}})
    message, log = answered(tokenizer, call, tools=True)
    [sent] = message["tool_calls"]
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": sent["id"],
                "type": "function",
                "function": {"name": "calculator", "arguments": go_style(sent["function"]["arguments"])},
            }
        ],
    }
    assert echoed["tool_calls"][0]["function"]["arguments"] != sent["function"]["arguments"]
    assert_extends(plan_turn(log, [QUESTION, echoed, RESULT], turns), log)
    # Arguments given as an object, not as JSON text, are the same arguments.
    function = {"name": "calculator", "arguments": json.loads(sent["function"]["arguments"])}
    as_object = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "function": function}]}
    assert_extends(plan_turn(log, [QUESTION, as_object, RESULT], turns), log)


@pytest.mark.parametrize(
    "echo",
    [
        "The answer is 5.",  # whitespace at the ends stripped
        "<think>2 and 3 make 5.</think>\n  The answer is 5.\n",  # echoed as it was
        "  The answer is 5.\n",  # the <think> block removed
        "The answer is 5.",  # both
    ],
)
def test_assistant_content_stripped_of_whitespace_or_its_think_block_matches(tokenizer, turns, echo):
    _, log = answered(tokenizer, "<think>2 and 3 make 5.</think>\n  The answer is 5.\n")
    assert_extends(plan_turn(log, [QUESTION, {"role": "assistant", "content": echo}, RESULT], turns), log)


def test_a_turn_opening_inside_its_think_block_matches_without_it(tokenizer, turns):
    _, log = answered(tokenizer, "2 and 3 make 5.</think>The answer is 5.")
    assert_extends(plan_turn(log, [QUESTION, {"role": "assistant", "content": "The answer is 5."}, RESULT], turns), log)


def test_text_parts_match_the_same_text(tokenizer, turns):
    message, log = answered(tokenizer, "The answer is 5.")
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]
    answer = [{"type": "text", "text": "The answer"}, {"type": "text", "text": " is 5."}]
    plan = plan_turn(log, [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}, RESULT], turns)
    assert_extends(plan, log)
    assert tokenizer.decode([t for p in plan.pieces for t in p.token_ids]).startswith("\n<|im_start|>tool\n5<|im_end|>")


def test_parts_that_are_not_text_are_refused_naming_their_type(turns):
    image = {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}],
    }
    with pytest.raises((ConversationError, RenderError), match=r"messages\[0\].*image_url"):
        plan_turn([], [image], turns)
    with pytest.raises((ConversationError, RenderError), match=r"messages\[0\].*text part"):
        plan_turn([], [{"role": "user", "content": [{"type": "text", "text": None}]}], turns)


def test_a_messages_name_is_part_of_it(tokenizer, turns):
    alice = {"role": "user", "name": "alice", "content": "What is 2+3?"}
    assert message_key(alice) != message_key({**alice, "name": "bob"}) != message_key(QUESTION)
    # A message without a name keeps the key it always had.
    assert message_key(QUESTION) == message_key({**QUESTION, "name": ""})
    message, [_, model] = answered(tokenizer, "5")
    log = [LoggedMessage(message_key(alice)), model]
    assert_extends(plan_turn(log, [alice, message, RESULT], turns), log)
    renamed = plan_turn(log, [{**alice, "name": "bob"}, message, RESULT], turns)
    assert renamed.cause == "edited_message" and renamed.keep_tokens == 0


def test_without_tools_a_written_call_is_text_and_its_echo_matches(tokenizer, turns):
    call = tool_call_text("calculator", {"expression": "2+3"})
    message, log = answered(tokenizer, "Let me compute. " + call, tools=False)
    assert message == {"role": "assistant", "content": "Let me compute. " + call}
    assert_extends(plan_turn(log, [QUESTION, message, {"role": "user", "content": "Go on."}], turns), log)
    offered, log = answered(tokenizer, "Let me compute. " + call, tools=True)
    assert offered["content"] == "Let me compute." and offered["tool_calls"][0]["function"]["name"] == "calculator"
    assert_extends(plan_turn(log, [QUESTION, offered, RESULT], turns), log)


def test_a_turn_read_back_from_the_record_matches_either_form_of_its_calls(tokenizer, turns):
    """A gateway started again does not know whether the turn's request offered tools: the turn
    as text and as parsed calls both match."""
    call = tool_call_text("calculator", {"expression": "2+3"})
    as_text, log = answered(tokenizer, call)
    parsed, _ = answered(tokenizer, call, tools=True)
    assert_extends(plan_turn(log, [QUESTION, {"role": "assistant", "content": call}, RESULT], turns), log)
    assert_extends(plan_turn(log, [QUESTION, parsed, RESULT], turns), log)


def test_every_break_names_its_cause(tokenizer, turns):
    call = tool_call_text("calculator", {"expression": "2+3"})
    message, log = answered(tokenizer, "Let me compute. " + call, tools=True)
    log = [*log, LoggedMessage(message_key(RESULT))]
    other_arguments = {"name": "calculator", "arguments": '{"expression": "3+2"}'}
    changed_call = {**message, "tool_calls": [{**message["tool_calls"][0], "function": other_arguments}]}
    cases = {
        "edited_message": [{"role": "user", "content": "What is 3+2?"}, message, RESULT],
        "removed_message": [QUESTION, RESULT],
        "inserted_message": [QUESTION, {"role": "user", "content": "Use the tool."}, message, RESULT],
        "content_mismatch": [QUESTION, {**message, "content": "I will compute."}, RESULT],
        "tool_calls": [QUESTION, changed_call, RESULT],
    }
    assert set(cases) < set(BREAK_CAUSES)
    for cause, messages in cases.items():
        plan = plan_turn(log, messages, turns)
        assert plan.cause == cause and plan.keep_tokens is not None, cause
    assert plan_turn(log, [QUESTION, message, RESULT, {"role": "user", "content": "More."}], turns).cause == ""
    # After a turn through /v1/completions the chat history cannot be extended.
    completed = plan_turn([*log[:2], LoggedMessage(COMPLETIONS_KEY)], [QUESTION, message, RESULT], turns)
    assert completed.cause == "mixed_endpoints" and completed.keep_tokens == log[1].end and completed.differs_at == 2
