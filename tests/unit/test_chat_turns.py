"""Rendering a conversation turn by turn: the stream built from pieces equals the chat template's
rendering of the whole conversation, contents are environment tokens and the rest template tokens;
tool calls in the Hermes form come back as OpenAI tool calls."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rlmesh.chat_turns import ENVIRONMENT, TEMPLATE, ChatTurns, RenderError
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from rlmesh.tool_calls import parse_tool_calls, tool_call_text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(build_text_tokenizer(), folder, model_max_length=512)
    return AutoTokenizer.from_pretrained(str(folder))


def ids_of(pieces) -> list[int]:
    return [t for p in pieces for t in p.token_ids]


TEXT = st.text(alphabet=st.sampled_from("abc xyz user assistant 0123<|>\n"), min_size=1, max_size=20)


@settings(max_examples=40, deadline=None)
@given(system=TEXT, user=TEXT, answer=TEXT, observation=TEXT, role=st.sampled_from(["user", "tool"]))
def test_turn_by_turn_equals_the_template_over_the_whole_conversation(tokenizer, system, user, answer, observation, role):
    turns = ChatTurns(tokenizer)
    first = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    opening = turns.first(first)
    # The model writes its answer and ends its turn with the stop token.
    model = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    history = [*first, {"role": "assistant", "content": answer}]
    later = turns.after_model(history, IM_END_TOKEN, [{"role": role, "content": observation}])
    stream = ids_of(opening) + model + ids_of(later)
    whole = tokenizer.apply_chat_template([*history, {"role": role, "content": observation}], add_generation_prompt=True, tokenize=False)
    assert stream == tokenizer.encode(whole, add_special_tokens=False)
    contents = [tokenizer.decode(p.token_ids) for p in opening + later if p.source == ENVIRONMENT]
    assert contents == [system, user, observation]
    assert {p.source for p in opening + later} == {ENVIRONMENT, TEMPLATE}


def test_a_turn_cut_at_max_tokens_gets_the_end_of_turn_from_the_template(tokenizer):
    turns = ChatTurns(tokenizer)
    later = turns.after_model([{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}], "",
                              [{"role": "user", "content": "go on"}])
    assert tokenizer.decode(ids_of(later)) == f"{IM_END_TOKEN}\n<|im_start|>user\ngo on{IM_END_TOKEN}\n<|im_start|>assistant\n"


def test_rendering_needs_a_template_and_messages(tokenizer, tmp_path):
    with pytest.raises(RenderError, match="at least one message"):
        ChatTurns(tokenizer).first([])
    plain = AutoTokenizer.from_pretrained(str(tokenizer.name_or_path))
    plain.chat_template = None
    with pytest.raises(RenderError, match="no chat template"):
        ChatTurns(plain)


def test_tool_calls_in_the_hermes_form_become_openai_tool_calls():
    text = "Let me compute. " + tool_call_text("calculator", {"expression": "3*4"}) + "<tool_call>not json</tool_call>"
    parsed = parse_tool_calls(text)
    [call] = parsed.tool_calls
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "3*4"}
    assert parsed.content == "Let me compute." and parsed.malformed == 1
    assert call.openai()["function"]["name"] == "calculator" and call.id == parse_tool_calls(text).tool_calls[0].id
    plain = parse_tool_calls("The answer is 12.")
    assert plain.content == "The answer is 12." and plain.tool_calls == [] and plain.malformed == 0
