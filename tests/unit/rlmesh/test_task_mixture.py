"""Tasks built from config: prompts rendered with a plain template or the tokenizer's chat template,
a tokenizer that cannot encode a task refused at start, and the weighted mixture that draws each
step's prompts reproducibly and resumes from its cursors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.models.tokenizer import load_hf_tokenizer
from rlmesh.tasks.base import TaskPrompt
from rlmesh.tasks.build import PromptRenderer, TaskError, TaskMixture, build_task
from rlmesh.tasks.config import TaskConfig


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_hf_tokenizer(model_dir)


def dataset_task(tmp_path, name="digits", weight=1.0, template="{prompt}=") -> TaskConfig:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(1000 + i), "answer": str(i)}) + "\n" for i in range(40)))
    return TaskConfig(
        name=name,
        kind="dataset",
        weight=weight,
        dataset={"path": str(path)},
        eval={"holdout": 4},
        prompt={"template": template},
        reward={"builtin": "increment"},
    )


def test_a_plain_template_renders_prompt_and_metadata(tokenizer):
    renderer = PromptRenderer("t", tokenizer, "{prompt}{sep}", chat=False, system=None)
    prompt = TaskPrompt("a", text="123", metadata={"sep": "="})
    assert renderer.text(prompt) == "123=" and renderer.token_ids(prompt) == tokenizer.encode("123=")
    with pytest.raises(TaskError, match="names 'missing'"):
        PromptRenderer("t", tokenizer, "{missing}", chat=False, system=None).text(prompt)


def test_a_tokenizer_that_cannot_encode_the_task_is_refused_at_start(tmp_path, tokenizer):
    with pytest.raises(TaskError, match="task 'digits': the model's tokenizer cannot encode"):
        build_task(dataset_task(tmp_path, template="What is {prompt}?"), tokenizer)
    with pytest.raises(TaskError, match="has no chat template"):
        PromptRenderer("t", tokenizer, None, chat=True, system=None)


def test_chat_prompts_go_through_the_chat_template():
    class Templated:
        chat_template = "set"
        unk_token_id = None

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [ord(c) for c in text]

    renderer = PromptRenderer("t", Templated(), "Q {prompt}", chat=True, system="be brief")
    assert renderer.text(TaskPrompt("a", text="2+2")) == "system:be brief|user:Q 2+2|assistant:"
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.text(TaskPrompt("b", messages=messages)) == "system:be brief|user:hi|assistant:"


def test_the_mixture_splits_steps_by_weight(tmp_path, tokenizer):
    tasks = [
        build_task(dataset_task(tmp_path, "a", 3.0), tokenizer),
        build_task(dataset_task(tmp_path, "b", 1.0), tokenizer),
    ]
    mixture = TaskMixture(tasks, seed=0)
    drawn = [task.name for step in range(50) for task, _ in mixture.draw(step, 16)]
    assert 0.65 < drawn.count("a") / len(drawn) < 0.85
    assert mixture.cursors() == {"a": drawn.count("a"), "b": drawn.count("b")}
    with pytest.raises(TaskError, match="unique"):
        TaskMixture([tasks[0], tasks[0]], seed=0)


@settings(max_examples=20)
@given(stop=st.integers(0, 12), seed=st.integers(0, 3))
def test_a_resumed_mixture_draws_what_the_uninterrupted_one_would(tmp_path_factory, model_dir, stop, seed):
    tokenizer = load_hf_tokenizer(model_dir)
    folder = tmp_path_factory.mktemp("mix")
    configs = [dataset_task(folder, "a", 2.0), dataset_task(folder, "b", 1.0), TaskConfig(name="inc", kind="increment")]

    def fresh() -> TaskMixture:
        return TaskMixture([build_task(c, tokenizer, seed) for c in configs], seed)

    whole = fresh()
    expected = [[(t.name, p.uid) for t, p in whole.draw(step, 8)] for step in range(16)]
    first = fresh()
    for step in range(stop):
        first.draw(step, 8)
    resumed = fresh()
    resumed.restore(first.cursors())
    assert [[(t.name, p.uid) for t, p in resumed.draw(step, 8)] for step in range(stop, 16)] == expected[stop:]
