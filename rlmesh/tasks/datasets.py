"""Dataset-backed prompt sources: rows from JSONL, Parquet or a local HF `datasets` folder, mapped
to prompts and metadata by the task's field mapping, shuffled per epoch from a seed."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlmesh.tasks.base import PromptSource, SourceExhausted, TaskPrompt
from rlmesh.tasks.config import DatasetConfig, EvalConfig


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and what is wrong."""


def _format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        return "hf"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    raise DatasetError(f"{path}: cannot tell the format from the name; set format to jsonl, parquet or hf")


def read_rows(path: str | Path, format: str = "auto", split: str | None = None) -> list[dict[str, Any]]:
    """Every row of a dataset as a dict."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    kind = _format(path, format)
    if kind == "jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds; the message says which
            raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from exc
    else:
        from datasets import Dataset, DatasetDict, load_from_disk

        try:
            loaded = load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001
            raise DatasetError(f"{path}: not a dataset folder written by datasets.save_to_disk: {exc}") from exc
        if isinstance(loaded, DatasetDict):
            if split is None or split not in loaded:
                raise DatasetError(f"{path}: no split {split!r}; the folder has {sorted(loaded)}")
            loaded = loaded[split]
        assert isinstance(loaded, Dataset)
        rows = loaded.to_list()
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


def map_rows(rows: Sequence[Mapping[str, Any]], fields: Mapping[str, str], origin: str) -> list[dict[str, Any]]:
    """Rows renamed by the field mapping; raises naming the first row that lacks a mapped column."""
    mapped = []
    renamed = set(fields.values())
    for index, row in enumerate(rows):
        missing = [column for column in fields.values() if column not in row]
        if missing:
            raise DatasetError(
                f"{origin}: row {index} has no field {missing[0]!r} (fields mapped: "
                f"{dict(fields)}; the row has {sorted(row)})"
            )
        out = {name: row[column] for name, column in fields.items()}
        out.update({column: value for column, value in row.items() if column not in renamed and column not in out})
        mapped.append(out)
    return mapped


def row_prompt(uid: str, row: Mapping[str, Any]) -> TaskPrompt:
    """A mapped row as a prompt: `prompt` is text or a list of chat messages; the rest is metadata."""
    metadata = {k: v for k, v in row.items() if k != "prompt"}
    value = row.get("prompt")
    if value is None:
        return TaskPrompt(uid, text="", metadata=metadata)
    if isinstance(value, str):
        return TaskPrompt(uid, text=value, metadata=metadata)
    if isinstance(value, list) and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in value):
        return TaskPrompt(
            uid, messages=[{"role": str(m["role"]), "content": str(m["content"])} for m in value], metadata=metadata
        )
    raise DatasetError(
        f"prompt {uid}: the prompt field must be text or a list of {{role, content}} messages, "
        f"got {type(value).__name__}"
    )


class DatasetSource(PromptSource):
    """Training rows in a seeded order that changes every epoch; held-out rows from a separate file,
    a split, or rows set aside from the training data."""

    def __init__(self, config: DatasetConfig, evaluation: EvalConfig, seed: int) -> None:
        rows = map_rows(read_rows(config.path, config.format, config.split), config.fields, config.path)
        self.seed = seed
        self.shuffle = config.shuffle
        self.epochs = config.epochs
        ids = list(range(len(rows)))
        if evaluation.path or evaluation.split:
            origin = evaluation.path or f"{config.path} split {evaluation.split}"
            held = map_rows(
                read_rows(evaluation.path or config.path, config.format, evaluation.split), config.fields, origin
            )
            self._held_out = [row_prompt(f"eval-{i}", row) for i, row in enumerate(held)]
        else:
            if evaluation.holdout >= len(rows):
                raise DatasetError(
                    f"{config.path}: eval.holdout {evaluation.holdout} leaves no training rows ({len(rows)} in all)"
                )
            shuffled = ids[:]
            random.Random(seed).shuffle(shuffled)
            set_aside = sorted(shuffled[: evaluation.holdout])
            self._held_out = [row_prompt(f"row-{i}", rows[i]) for i in set_aside]
            ids = sorted(set(ids) - set(set_aside))
        # Every row is checked now, so a bad one stops the job at start rather than mid-run.
        self._prompts = [row_prompt(f"row-{i}", rows[i]) for i in ids]
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self._prompts)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def prompt_at(self, position: int) -> TaskPrompt:
        epoch, index = divmod(position, len(self._prompts))
        if self.epochs is not None and epoch >= self.epochs:
            raise SourceExhausted(f"all {len(self._prompts)} rows were used {self.epochs} time(s) (dataset.epochs)")
        return self._prompts[self._order(epoch)[index]]

    def held_out(self, count: int) -> list[TaskPrompt]:
        return self._held_out[:count]
