"""The default task's data and reward, and the character tokenizer's agreement with AutoTokenizer."""

import random

from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rlmesh.models.tokenizer import DEFAULT_ALPHABET, EOS_TOKEN, build_char_tokenizer, load_tokenizer
from rlmesh.tasks.increment import (
    HELD_OUT_COUNT,
    IncrementSource,
    answer_for,
    exact_match,
    held_out_problems,
    make_problem,
    reward,
)

digits = st.text(alphabet="0123456789", min_size=0, max_size=12)


def test_answer_wraps_nine():
    assert answer_for("0919") == "1020"


@given(digits, digits)
def test_reward_is_partial_credit_in_unit_interval(response, answer):
    value = reward(response, answer)
    assert 0.0 <= value <= 1.0
    assert (value == 1.0) == (response == answer)


def test_reward_counts_positions():
    assert reward("1235", "1234") == 0.75
    assert reward("123", "1234") == 0.75
    assert reward("12345", "1234") == 0.8
    assert exact_match("1234", "1234") and not exact_match("123", "1234")


def test_problems_are_reproducible_by_position_and_disjoint_from_held_out():
    source = IncrementSource(seed=3)
    first = source.take(16)
    again = IncrementSource(seed=3)
    again.cursor = 8
    assert again.take(8) == first[8:]
    assert source.cursor == 16
    seen = {p.text for p in IncrementSource(3).take(800)}
    assert not seen & {p.prompt for p in held_out_problems(HELD_OUT_COUNT)}
    assert [p.text for p in source.held_out(64)] == [p.prompt for p in held_out_problems(64)]
    assert all(p.metadata["answer"] == answer_for(p.text[:-1]) for p in first)
    problem = make_problem(random.Random(0))
    assert 4 <= len(problem.prompt) - 1 <= 8 and problem.prompt.endswith("=")


@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=30))
def test_tokenizer_round_trips_one_token_per_character(text):
    tokenizer = build_char_tokenizer()
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_auto_tokenizer_gives_the_same_ids(model_dir):
    ours = load_tokenizer(model_dir)
    auto = AutoTokenizer.from_pretrained(model_dir)
    for text in ("1234=", "90817=", "5="):
        assert auto(text)["input_ids"] == ours.encode(text).ids
    assert len(auto) == ours.get_vocab_size()
    assert auto.eos_token_id == ours.token_to_id(EOS_TOKEN)


def test_model_vocab_equals_tokenizer_size(model_dir):
    import json

    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == load_tokenizer(model_dir).get_vocab_size()
