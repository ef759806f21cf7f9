"""The environments shipped with rlmesh and the checks every environment's answers go through: the
calculator evaluates only arithmetic and rewards a right boxed answer, the feedback marks what was
right, whatever an environment returns is an observation or an EnvironmentFailure, and a verifiers
task that does not fit is refused naming why."""

import random
import re
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rlmesh.chat.tool_calls import parse_tool_calls, tool_call_text
from rlmesh.environments.base import (
    Action,
    EnvironmentFailure,
    StepResult,
    Text,
    Tokens,
    as_observation,
    as_step_result,
)
from rlmesh.environments.calculator import CalculatorEnvironment, evaluate
from rlmesh.environments.feedback import FeedbackEnvironment, hidden_code, marks
from rlmesh.environments.verifiers_adapter import VerifiersError, VerifiersSource, load_verifiers
from rlmesh.models.qwen2_tiny import TinyModelSpec, create_default_model, feedback_warmup_example
from rlmesh.models.tokenizer import EOS_TOKEN, build_char_tokenizer
from rlmesh.tasks.config import TaskConfig
from rlmesh.tasks.increment import held_out_problems, make_problem
from rlmesh.tasks.word_problems import WordProblemSource, expression_of, messages_for


def action(text: str) -> Action:
    parsed = parse_tool_calls(text)
    return Action(text, parsed.tool_calls, parsed.content, [], False)


def test_the_calculator_evaluates_arithmetic_only():
    assert evaluate("(3*4)-5") == "7" and evaluate("10/4") == "2.5" and evaluate("-2*3") == "-6"
    assert evaluate("__import__('os')").startswith("error:") and evaluate("2**99").startswith("error:")
    assert evaluate("1/0").startswith("error:") and evaluate("9" * 70).startswith("error: expression longer")


def test_a_calculator_episode_answers_calls_and_rewards_the_right_boxed_answer():
    problem = WordProblemSource(3).problem_at(0)
    row = {"prompt": list(messages_for(problem)), "answer": str(problem.answer)}
    environment = CalculatorEnvironment()
    first = environment.reset(row)
    assert first[0]["role"] == "system" and "calculator" in first[0]["content"] and "boxed" not in first[1]["content"]
    called = environment.step(action(tool_call_text("calculator", {"expression": expression_of(problem)})))
    assert called == StepResult([{"role": "tool", "content": str(problem.answer)}], 0.0, False)
    assert environment.step(action(f"\\boxed{{{problem.answer}}}")) == StepResult([], 1.0, True)
    assert CalculatorEnvironment().step(action("\\boxed{-1}")).reward == 0.0
    # Without tools a call is no call: the episode ends unanswered.
    plain = CalculatorEnvironment(tools=False)
    assert "calculator" not in plain.reset(row)[0]["content"]
    assert plain.step(action(tool_call_text("calculator", {"expression": "1+1"}))) == StepResult([], 0.0, True)
    with pytest.raises(EnvironmentFailure, match="no 'answer'"):
        CalculatorEnvironment().reset({"prompt": "x"})


def test_feedback_marks_what_was_right_and_asks_again():
    assert marks("5932", "5932") == "5932="
    assert marks("5942", "5932") == "59=2="
    assert marks("59", "5932") == "59==="
    # The hidden code: each digit kept or plus one, fixed per problem.
    assert hidden_code("4821") == "5831" and hidden_code("999999") == "000999"
    # About half the digits of a problem set are incremented: a first attempt can only guess.
    problems = [problem.prompt[:-1] for problem in held_out_problems(256)]
    changed = sum(c != d for problem in problems for c, d in zip(hidden_code(problem), problem))
    assert 0.45 < changed / sum(map(len, problems)) < 0.55
    environment = FeedbackEnvironment()
    assert environment.reset({"prompt": "4821=", "answer": "5932"}) == Text("4821=")
    first = environment.step(action("5932"))
    assert first == StepResult(Text("5=3=="), 0.5, False)
    assert environment.step(action("5831")) == StepResult([], 1.0, True)
    baseline = FeedbackEnvironment(tools=False)
    baseline.reset({"prompt": "4821=", "answer": "5932"})
    assert baseline.step(action("5932")).messages == Text("4821=")
    with pytest.raises(EnvironmentFailure, match="digits and '='"):
        FeedbackEnvironment().reset({"prompt": "hello", "answer": "1"})


def test_the_feedback_model_warms_up_on_the_episodes_the_environment_plays(tmp_path):
    tokenizer = build_char_tokenizer()
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(5)
    for _ in range(20):
        problem = make_problem(rng)
        tokens, mask = feedback_warmup_example(problem, rng, lambda text: tokenizer.encode(text).ids, eos)
        answer_starts = mask.index(1)
        assert set(mask[answer_starts:]) == {1} and len(mask) == len(tokens)
        context, target = tokens[:answer_starts], tokens[answer_starts:]
        first_ids = context[len(tokenizer.encode(problem.prompt).ids) : context.index(eos)]
        first = tokenizer.decode(first_ids).replace(" ", "")
        environment = FeedbackEnvironment()
        environment.reset({"prompt": problem.prompt})
        observation = environment.step(action(first)).messages
        assert context[context.index(eos) + 1 :] == tokenizer.encode(observation.text).ids
        assert target == tokenizer.encode(hidden_code(problem.prompt[:-1])).ids + [eos]
    folder = create_default_model(
        tmp_path / "model", TinyModelSpec(warmup_iterations=2, warmup_batch=8, feedback_share=0.5)
    )
    assert (folder / "model.safetensors").is_file()


@given(st.text("0123456789", min_size=1, max_size=12))
def test_a_hidden_code_keeps_or_increments_each_digit(digits):
    code = hidden_code(digits)
    assert len(code) == len(digits)
    assert all(int(c) - int(d) in (0, 1, -9) for c, d in zip(code, digits))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("hi", [{"role": "user", "content": "hi"}]),
        ({"role": "tool", "content": "5"}, [{"role": "tool", "content": "5"}]),
        ({"token_ids": [1, 2]}, Tokens([1, 2])),
        ({"text": "12="}, Text("12=")),
    ],
)
def test_observations_come_as_text_messages_tokens_or_raw_text(value, expected):
    assert as_observation(value, "step") == expected


@pytest.mark.parametrize(
    "value, message",
    [
        (42, "not messages or text"),
        ([{"role": "robot", "content": "x"}], "a role in"),
        ({"token_ids": [-1]}, "token ids"),
        ({"text": ""}, "non-empty string"),
    ],
)
def test_garbage_observations_are_environment_failures(value, message):
    with pytest.raises(EnvironmentFailure, match=message):
        as_observation(value, "step")


@pytest.mark.parametrize(
    "value, message",
    [
        (("ok", float("nan"), False), "finite number"),
        (("ok", 1.0, "yes"), "not a bool"),
        ((None, 0.0, False), "no observation"),
        (("ok", 1e39, False), "within float32's range"),
        (("ok", -float("inf"), False), "within float32's range"),
        (("ok", 10**400, False), "within float32's range"),
        ({"reward": 1, "bogus": 2}, "keys"),
        ("text", r"give \(observation, reward, done\)"),
    ],
)
def test_garbage_steps_are_environment_failures(value, message):
    with pytest.raises(EnvironmentFailure, match=message):
        as_step_result(value)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"name": "t", "kind": "verifiers"}, "kind 'verifiers' and environment.verifiers go together"),
        (
            {"name": "t", "kind": "increment", "environment": {"verifiers": "sums"}},
            "kind 'verifiers' and environment.verifiers go together",
        ),
        (
            {"name": "t", "kind": "increment", "environment": {"builtin": "feedback", "verifiers_args": {"rows": 2}}},
            "verifiers_args are a verifiers taskset's fields",
        ),
        (
            {"name": "t", "kind": "verifiers", "environment": {"verifiers": "sums", "python": "env.py:Env"}},
            "give one of python, builtin, remote, verifiers or command, not python and verifiers",
        ),
    ],
)
def test_a_verifiers_task_is_refused_naming_what_does_not_fit(task, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        TaskConfig.model_validate(task)


def test_a_verifiers_taskset_that_cannot_load_stops_the_task_naming_it():
    with pytest.raises(VerifiersError, match="verifiers taskset 'no_such_taskset'"):
        load_verifiers("no_such_taskset", {})


@given(rows=st.integers(2, 40), holdout=st.integers(1, 10), seed=st.integers(0, 1000))
def test_a_verifiers_taskset_gives_every_training_row_once_a_pass_and_never_a_held_out_one(rows, holdout, seed):
    taskset = [SimpleNamespace(data=SimpleNamespace(prompt=f"row {i}")) for i in range(rows)]
    environment = SimpleNamespace(taskset=taskset)
    if holdout >= rows:
        with pytest.raises(VerifiersError, match="leaves no training rows"):
            VerifiersSource(environment, holdout, seed)
        return
    source = VerifiersSource(environment, holdout, seed)
    held = {p.uid for p in source.held_out(rows)}
    training = rows - holdout
    for epoch in range(2):
        seen = [source.prompt_at(epoch * training + i).uid for i in range(training)]
        assert len(set(seen)) == training and not set(seen) & held
    assert len(held) == holdout and all(
        p.metadata["verifiers_index"] == int(p.uid.split("-")[1]) for p in source.held_out(rows)
    )
    assert [p.uid for p in VerifiersSource(environment, holdout, seed).take(training)] == [
        source.prompt_at(i).uid for i in range(training)
    ]
