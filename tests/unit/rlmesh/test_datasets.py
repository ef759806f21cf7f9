"""Dataset sources: JSONL, Parquet and HF folders read alike, the field mapping, a seeded shuffle
that changes per epoch, epochs that run out, held-out rows kept apart, and a cursor that resumes
the exact sequence of prompts."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.tasks.base import SourceExhausted
from rlmesh.tasks.config import DatasetConfig, EvalConfig
from rlmesh.tasks.datasets import DatasetError, DatasetSource, read_rows

ROWS = [{"q": f"{i}+{i}=", "a": str(2 * i), "level": i % 3} for i in range(30)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def source(path, **kwargs) -> DatasetSource:
    evaluation = kwargs.pop("evaluation", EvalConfig(holdout=5))
    return DatasetSource(
        DatasetConfig(path=str(path), fields={"prompt": "q", "answer": "a"}, **kwargs), evaluation, seed=1
    )


def test_jsonl_parquet_and_hf_folders_give_the_same_rows(tmp_path, jsonl):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:3])}).save_to_disk(
        str(tmp_path / "hf")
    )
    assert read_rows(jsonl) == read_rows(tmp_path / "rows.parquet") == read_rows(tmp_path / "hf", split="train") == ROWS
    with pytest.raises(DatasetError, match="no split 'dev'"):
        read_rows(tmp_path / "hf", split="dev")
    held = DatasetSource(
        DatasetConfig(path=str(tmp_path / "hf"), fields={"prompt": "q", "answer": "a"}),
        EvalConfig(split="test"),
        seed=0,
    ).held_out(10)
    assert [p.text for p in held] == ["0+0=", "1+1=", "2+2="]


def test_rows_become_prompts_with_mapped_metadata(jsonl):
    prompt = source(jsonl).prompt_at(0)
    assert prompt.text.endswith("=") and set(prompt.metadata) == {"answer", "level"}
    assert prompt.metadata["answer"] == str(2 * int(prompt.text.split("+")[0]))


def test_bad_rows_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1=", "a": "2"}\n{"q": "2="}\n')
    with pytest.raises(DatasetError, match="row 1 has no field 'a'"):
        source(bad, evaluation=EvalConfig(holdout=0))
    bad.write_text('{"q": "1=", "a": "2"}\nnot json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2: not valid JSON"):
        read_rows(bad)
    bad.write_text('{"q": 5, "a": "2"}\n')
    with pytest.raises(DatasetError, match="must be text or a list"):
        source(bad, evaluation=EvalConfig(holdout=0))
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "absent.jsonl")


def test_chat_rows_keep_their_messages(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"q": [{"role": "user", "content": "hi"}], "a": "x"}) + "\n")
    prompt = source(path, evaluation=EvalConfig(holdout=0)).prompt_at(0)
    assert prompt.messages == [{"role": "user", "content": "hi"}] and prompt.text is None


def test_each_epoch_is_a_new_order_of_the_same_training_rows_and_held_out_rows_never_train(jsonl):
    data = source(jsonl)
    held = {p.text for p in data.held_out(100)}
    assert len(held) == 5
    epochs = [[data.prompt_at(e * 25 + i).text for i in range(25)] for e in range(3)]
    assert all(set(e) == set(epochs[0]) for e in epochs) and len(set(epochs[0])) == 25
    assert not held & set(epochs[0])
    assert epochs[0] != epochs[1]
    unshuffled = source(jsonl, shuffle=False)
    rows = [int(unshuffled.prompt_at(e * 25 + i).uid.split("-")[1]) for e in range(2) for i in range(25)]
    assert rows[:25] == sorted(rows[:25]) and rows[25:] == rows[:25]


def test_a_limited_number_of_epochs_runs_out(jsonl):
    data = source(jsonl, epochs=2)
    data.take(50)
    with pytest.raises(SourceExhausted, match="used 2 time"):
        data.take(1)


@settings(max_examples=30)
@given(chunks=st.lists(st.integers(0, 40), max_size=6), seed=st.integers(0, 5))
def test_a_cursor_resumes_the_exact_sequence(tmp_path_factory, chunks, seed):
    path = tmp_path_factory.mktemp("d") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = DatasetConfig(path=str(path), fields={"prompt": "q", "answer": "a"})
    whole = DatasetSource(config, EvalConfig(holdout=3), seed).take(sum(chunks) + 5)
    taken = []
    for size in chunks:
        resumed = DatasetSource(config, EvalConfig(holdout=3), seed)
        resumed.cursor = len(taken)
        taken += resumed.take(size)
    assert taken == whole[: len(taken)]
