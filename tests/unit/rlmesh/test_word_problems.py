"""The word-problem task: its generator, the math-verify reward, the chat tokenizer and the tiny chat model."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from math_verify import parse
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.environments.calculator import worked_turns
from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model, tool_episode_example, warmup_lr
from rlmesh.models.families import is_model_dir
from rlmesh.models.tokenizer import IM_END_TOKEN, TEXT_ALPHABET, UNK_TOKEN, build_text_tokenizer
from rlmesh.rewards.base import RewardItem
from rlmesh.rewards.guard import GuardedReward
from rlmesh.rewards.math import MathReward, check, final_answer
from rlmesh.tasks.word_problems import (
    HELD_OUT_COUNT,
    INSTRUCTION,
    KINDS,
    WordProblemSource,
    expression_of,
    held_out_problems,
    messages_for,
    solution_text,
)

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def item(completion: str, answer: str = "12") -> RewardItem:
    return RewardItem("s", "prompt", completion, {"answer": answer})


def test_source_is_reproducible_by_position_and_disjoint_from_held_out():
    source = WordProblemSource(seed=3)
    first = source.take(16)
    again = WordProblemSource(seed=3)
    again.cursor = 8
    assert again.take(8) == first[8:]
    assert source.cursor == 16
    assert WordProblemSource(seed=4).take(16) != first
    held_out = {p.text for p in held_out_problems(HELD_OUT_COUNT)}
    training = [WordProblemSource(3).problem_at(i) for i in range(1500)]
    assert not {p.text for p in training} & held_out
    evaluation = source.held_out(300)
    assert len(evaluation) == HELD_OUT_COUNT and evaluation == WordProblemSource(9).held_out(300)
    assert [p.messages[0]["content"] for p in evaluation] == [
        f"{p.text} {INSTRUCTION}" for p in held_out_problems(HELD_OUT_COUNT)
    ]
    assert {p.kind for p in training} == set(KINDS)


def test_every_answer_is_an_integer_equal_to_the_problems_arithmetic():
    source = WordProblemSource(seed=1)
    problems = [source.problem_at(i) for i in range(1000)] + held_out_problems(HELD_OUT_COUNT)
    assert any(op == "/" for p in problems for _, op, _ in p.steps)
    assert any(len(p.steps) == 2 and {p.steps[0][1], p.steps[1][1]} != {"+"} for p in problems)
    for problem in problems:
        given_numbers = [int(n) for n in re.findall(r"\d+", problem.text)]
        previous = None
        for left, op, right in problem.steps:
            operands = [left, right]
            if previous is not None:
                operands.remove(previous)  # one operand is the result of the step before
            assert all(n in given_numbers for n in operands), problem
            previous = OPERATORS[op](Fraction(left), Fraction(right))
            assert previous.denominator == 1 and previous > 0, problem
        assert previous == problem.answer, problem
    for prompt, problem in zip(source.take(50), [source.problem_at(i) for i in range(50)]):
        assert prompt.metadata == {"answer": str(problem.answer)}
        assert list(prompt.messages) == list(messages_for(problem))
        assert prompt.messages[0]["role"] == "user" and "\\boxed{}" in prompt.messages[0]["content"]


def test_solution_text_is_short_and_ends_in_the_boxed_answer():
    for problem in [WordProblemSource(2).problem_at(i) for i in range(300)]:
        solution = solution_text(problem)
        assert solution.endswith(f"\\boxed{{{problem.answer}}}")
        # The task's default response budget is 48 tokens, one per character, <|im_end|> included.
        assert len(solution) < 40
        assert check(solution, str(problem.answer)).reward == 1.0


def test_math_reward_scores_with_math_verify():
    reward = MathReward()
    results = asyncio.run(
        reward.score(
            [
                item("4*3=12. \\boxed{12}"),
                item("The answer is 12"),  # math-verify accepts a bare final number
                item("4*3=13. \\boxed{13}"),
                item("\\boxed{12} or \\boxed{13}"),  # two boxed answers parse as the set {12, 13}
                item(""),
                item("35. \\boxed{15}", "15"),  # the boxed answer wins over an earlier number
                item("so \\boxed{1+x}", "x+1"),  # a symbolic answer is compared symbolically
            ]
        )
    )
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert [r.components["correct"] for r in results] == [r.reward for r in results]
    assert [r.components["formatted"] for r in results] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="no 'answer'"):
        asyncio.run(reward.score_one(RewardItem("s", "p", "\\boxed{1}", {})))
    with pytest.raises(ValueError, match="cannot parse"):
        check("\\boxed{1}", "")


def test_math_reward_checks_a_gsm8k_answer_against_the_number_after_its_last_mark():
    # The worked solution's \boxed{} is what math-verify would take from the whole answer.
    gsm8k = "Half is \\boxed{5} apples.\nShe buys 5+8 = <<5+8=13>>13 apples.\n#### 13"
    completions = [("So \\boxed{13}.", gsm8k), ("So \\boxed{5}.", gsm8k), ("13 apples", "#### 1,300\n")]
    results = asyncio.run(MathReward().score([item(*pair) for pair in [*completions, ("\\boxed{1300}", "#### 1,300")]]))
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert final_answer("x+1") == "x+1" and final_answer("a #### b\n#### 42 ") == "42"
    with pytest.raises(ValueError, match="cannot parse"):
        check("\\boxed{1}", "The answer follows.\n####")


def test_math_reward_works_off_the_main_thread():
    # The reason for parsing_timeout=None: math-verify's default timeout uses signal.alarm.
    failures: list[BaseException] = []

    def default_parse() -> None:
        try:
            parse("\\boxed{12}")
        except ValueError as exc:
            failures.append(exc)

    thread = threading.Thread(target=default_parse)
    thread.start()
    thread.join()
    assert failures and "thread" in str(failures[0])

    results: list = []
    thread = threading.Thread(
        target=lambda: results.append(asyncio.run(MathReward().score([item("\\boxed{12}"), item("11")])))
    )
    thread.start()
    thread.join()
    assert [r.reward for r in results[0]] == [1.0, 0.0]

    guarded = GuardedReward(
        "math", MathReward(), timeout_seconds=30, failure_reward=0.0, max_error_rate=0.1, error_window=64
    )
    answers = [str(n) for n in range(40)]
    scored = asyncio.run(guarded.score([item(f"So \\boxed{{{n}}}", n) for n in answers] + [item("\\boxed{3}", "4")]))
    assert [r.reward for r in scored] == [1.0] * 40 + [0.0] and guarded.counters.failed == 0


@given(st.text(alphabet=TEXT_ALPHABET, max_size=80))
def test_text_tokenizer_round_trips_one_token_per_character(text):
    tokenizer = build_text_tokenizer()
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    # A special token's own text is that token, as in every HF tokenizer; any other text is one
    # token per character.
    assume(not any(special in text for special in specials))
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_a_special_tokens_text_is_the_special_token():
    tokenizer = build_text_tokenizer()
    for token, token_id in (
        (UNK_TOKEN, tokenizer.token_to_id(UNK_TOKEN)),
        (IM_END_TOKEN, tokenizer.token_to_id(IM_END_TOKEN)),
    ):
        assert tokenizer.encode(f"1{token}2").ids == [tokenizer.token_to_id("1"), token_id, tokenizer.token_to_id("2")]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_chat_model(tmp_path_factory.mktemp("chat"), ChatModelSpec(warmup_iterations=3, warmup_batch=4))


def test_auto_tokenizer_agrees_and_renders_chatml(chat_model_dir):
    ours = Tokenizer.from_file(str(chat_model_dir / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(chat_model_dir))
    assert len(theirs) == ours.get_vocab_size()
    assert theirs.eos_token == IM_END_TOKEN and theirs.eos_token_id == ours.token_to_id(IM_END_TOKEN)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?\nSay it."}]
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?\nSay it.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == ours.encode(rendered).ids == theirs.encode(rendered, add_special_tokens=False)
    assert ids.count(ours.token_to_id("<|im_start|>")) == 3 and theirs.unk_token_id not in ids
    text = "Sam has 12 apples, gives {3} away: 12-3=9. \\boxed{9} ~!"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text).ids
    assert theirs.decode(ours.encode(text).ids + [theirs.eos_token_id], skip_special_tokens=True) == text


def test_a_tool_episode_warms_up_on_the_tokens_its_episode_renders(chat_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(chat_model_dir))
    source = WordProblemSource(3)
    for position in range(8):
        problem = source.problem_at(position)
        tokens, mask = tool_episode_example(tokenizer, problem, tokenizer.eos_token_id)
        turns = worked_turns(problem.text, expression_of(problem), problem.answer)
        rendered = tokenizer.apply_chat_template(turns, tokenize=False)
        assert tokens == tokenizer.encode(rendered.removesuffix("\n"), add_special_tokens=False)
        trained = tokenizer.decode([token for token, weight in zip(tokens, mask, strict=True) if weight])
        assert trained == f"{turns[2]['content']}{IM_END_TOKEN}{turns[4]['content']}{IM_END_TOKEN}"


def test_the_warm_up_rate_ramps_up_then_decays_to_a_tenth():
    spec = ChatModelSpec(warmup_iterations=1000, warmup_lr=2e-3)
    rates = [warmup_lr(spec, iteration) for iteration in range(spec.warmup_iterations)]
    peak = rates.index(max(rates))
    assert rates[0] < rates[peak] <= spec.warmup_lr and peak < 50
    assert all(later <= earlier for earlier, later in zip(rates[peak:], rates[peak + 1 :]))
    assert spec.warmup_lr * 0.1 <= rates[-1] < spec.warmup_lr * 0.11


def test_chat_model_loads_and_generates(chat_model_dir):
    assert is_model_dir(chat_model_dir)
    config = json.loads((chat_model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(chat_model_dir))
    assert config["vocab_size"] == len(tokenizer) and config["tie_word_embeddings"]
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    assert config["max_position_embeddings"] == 512 and config["num_key_value_heads"] == 4
    model = AutoModelForCausalLM.from_pretrained(str(chat_model_dir))
    prompt = WordProblemSource(0).held_out(1)[0]
    ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=config["pad_token_id"])
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), str)
