"""Resumable sharded checkpoints: each rank writes its own rows of the policy and optimizer in one
file (a checkpoint saved by N ranks loads on any number of ranks), the step and weight version,
and on request the whole policy as an HF folder.

Layout: `checkpoints/step_NNNNNN/` holds `shards_rank<r>.pt` (rank r's rows of every tensor along
dim 0, the FSDP2 layout, with its RNG state: the policy and its optimizer, and the critic's
under `critic/` when PPO trains one), `pipeline.pkl` (rank 0's steps in flight),
`trainer_state.pt` (written last), and with an export `config.json`, `model.safetensors` and the
tokenizer. A save goes to `step_NNNNNN.partial/` and is renamed when complete; the newest KEEP
checkpoints are kept.

Every function here is collective when a process group is initialised: every rank calls it, in
the same order. Without a process group it runs on a plain (unsharded) model."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from rlmesh.models.tp_layout import fsdp_rows

log = structlog.get_logger()

KEEP = 2
STATE_FILE = "trainer_state.pt"
PIPELINE_FILE = "pipeline.pkl"
SHARD_FILE = "shards_rank{rank}.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CRITIC = "critic/"
"""Where the critic's tensors lie in a shard file: its keys are the policy's with this prefix."""

Trained = tuple[torch.nn.Module, torch.optim.Optimizer]
"""A model and its optimizer."""


def _parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic: Trained | None) -> dict[str, Trained]:
    """What a checkpoint holds, by key prefix: the policy's keys have none."""
    return {"": (model, optimizer)} | ({CRITIC: critic} if critic is not None else {})


@dataclass(slots=True)
class TrainerState:
    step: int
    """Training steps completed."""
    version: int
    """Weight version of the policy: the step plus an offset fixed when a run starts, since a
    run restarted on a mesh that already holds versions must publish above them."""
    task_cursors: dict[str, int] = field(default_factory=dict)
    """Each task's prompts taken so far: a resumed run draws from there."""
    pipeline: bytes = b""
    """The steps drawn but not yet trained, pickled (`pipeline.py`): their accepted groups and their
    prompts in flight. Written to PIPELINE_FILE, not to STATE_FILE."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and _world() > 1:
        dist.barrier(group=group)


def _shard_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / SHARD_FILE.format(rank=rank)


def _begin(directory: Path, step: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    """The checkpoint's folder and the `.partial` one it is written to (made empty by rank 0)."""
    target = directory / f"step_{step:06d}"
    partial = target.with_suffix(".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(group)
    return target, partial


def _complete(directory: Path, target: Path, partial: Path, state: TrainerState, world_size: int) -> None:
    """Rank 0, once every rank's shards are written: the state, then the rename, then pruning."""
    if state.pipeline:
        _write_durably(partial / PIPELINE_FILE, lambda file: file.write(state.pipeline))
    saved = {
        "step": state.step,
        "version": state.version,
        "task_cursors": dict(state.task_cursors),
        "world_size": world_size,
    }
    _write_durably(partial / STATE_FILE, lambda file: torch.save(saved, file))
    shutil.rmtree(target, ignore_errors=True)
    # Rename last so a crash mid-save never leaves a checkpoint that looks complete.
    partial.rename(target)
    for old in sorted(directory.glob("step_??????"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def _flat_entries(model_state: dict, optimizer_state: dict, prefix: str = "") -> dict[str, object]:
    """Every value of the model and optimizer state dicts under one path-like key; param_groups apart."""
    entries: dict[str, object] = {f"{prefix}model/{name}": value for name, value in model_state.items()}
    for name, values in optimizer_state["state"].items():
        entries |= {f"{prefix}optimizer/{name}/{key}": value for key, value in values.items()}
    return entries


def _local_rows(key: str, value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """This rank's part of a state-dict tensor and the rows of dim 0 it holds (None: the whole tensor)."""
    if not isinstance(value, DTensor):
        return value, None
    if len(value.placements) != 1 or value.placements[0] != Shard(0):
        raise ValueError(f"{key}: placement {value.placements}; checkpoints hold FSDP's dim-0 shards only")
    local = value.to_local()
    rows = fsdp_rows(value.shape[0], value.device_mesh.size(), value.device_mesh.get_local_rank())
    if local.shape[0] != rows[1] - rows[0]:
        raise RuntimeError(f"{key}: this rank holds {local.shape[0]} rows, expected rows {rows}")
    return local, rows


def _stage(parts: dict[str, Trained]) -> dict:
    """A copy in host memory of this rank's rows of the policy and optimizer (and the critic's), its
    RNG state and where each tensor's rows lie: what the shard file holds. Training may change the
    originals at once (a copy from a GPU waits for the device's work on them so far)."""
    staged: dict = {"tensors": {}, "rows": {}, "values": {}, "rng": torch.get_rng_state()}
    for prefix, (model, optimizer) in parts.items():
        model_state, optimizer_state = get_state_dict(model, optimizer)
        for key, value in _flat_entries(model_state, optimizer_state, prefix).items():
            if not isinstance(value, torch.Tensor):
                staged["values"][key] = value
                continue
            local, held = _local_rows(key, value)
            staged["tensors"][key] = local.detach().to("cpu", copy=True)
            if held is not None:
                staged["rows"][key] = held
        staged[f"{prefix}param_groups"] = optimizer_state["param_groups"]
    return staged


def _write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write` to the file, then fsync: the rename that completes a checkpoint must not outrun its files."""
    with path.open("wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def _write(partial: Path, staged: dict, group: dist.ProcessGroup | None) -> None:
    """This rank's shard file; returns once every rank has written its own."""
    _write_durably(_shard_file(partial, _rank()), lambda file: torch.save(staged, file))
    _barrier(group)


def gather_rows(pieces: list[tuple[tuple[int, int], torch.Tensor]], rows: tuple[int, int]) -> torch.Tensor:
    """Rows [rows) of a tensor split along dim 0 into `pieces` ((start, stop) and its rows each)."""
    start, stop = rows
    parts = []
    for (piece_start, piece_stop), piece in sorted(pieces, key=lambda p: p[0]):
        if piece_stop <= start or piece_start >= stop:
            continue
        if piece_start > start:
            raise ValueError(f"rows {start}-{piece_start} are in no shard")
        parts.append(piece[start - piece_start : min(stop, piece_stop) - piece_start])
        start = min(stop, piece_stop)
    if start < stop:
        raise ValueError(f"rows {start}-{stop} are in no shard")
    return torch.cat(parts) if parts else pieces[0][1][:0]


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    export_hf: bool = False,
    tokenizer_dir: Path | None = None,
    group: dist.ProcessGroup | None = None,
    critic: Trained | None = None,
) -> Path:
    """Saves every rank's shards (the critic's with them, if given), and returns when they are on
    disk; with `export_hf` rank 0 also writes the whole policy as an HF folder (the only place the
    full model is gathered, offloaded to CPU). `group` is a gloo group for barriers (None: the
    default group)."""
    target, partial = _begin(directory, state.step, group)
    _write(partial, _stage(_parts(model, optimizer, critic)), group)
    full = (
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if export_hf
        else None
    )
    if _rank() == 0:
        if full is not None:
            export_hf_folder(partial, model, full, tokenizer_dir)
        _complete(directory, target, partial, state, _world())
    _barrier(group)
    return target


class BackgroundCheckpoints:
    """Checkpoints that training does not wait for: this rank's shards are copied to memory
    (staged) at once, then written by a background thread while training goes on; rank 0
    completes the checkpoint (state, rename) once every rank has written. One is written at a
    time: a new one first waits for the last.

    `group` is a gloo group used by nothing else: the writers' barrier then never interleaves
    with training's collectives."""

    def __init__(self, directory: Path, group: dist.ProcessGroup | None) -> None:
        """`group` None: one process alone, whose write needs no collective."""
        if group is None and _world() > 1:
            raise ValueError("background checkpoints of several ranks need a process group of their own")
        self.directory = directory
        self.group = group
        self._writing: Future | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        barrier_group: dist.ProcessGroup | None = None,
        critic: Trained | None = None,
    ) -> Path:
        """Starts writing a checkpoint; returns its folder (complete once `wait` returns)."""
        self.wait()
        target, partial = _begin(self.directory, state.step, barrier_group)
        staged = _stage(_parts(model, optimizer, critic))
        world_size, leader = _world(), _rank() == 0

        def write() -> None:
            _write(partial, staged, self.group)
            if leader:
                _complete(self.directory, target, partial, state, world_size)

        self._writing = self._writer.submit(write)
        return target

    def wait(self) -> None:
        """Until the checkpoint being written (if any) is complete; raises what failed it."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()


def export_hf_folder(
    path: Path, model: torch.nn.Module, full_state: dict[str, torch.Tensor], tokenizer_dir: Path | None = None
) -> None:
    """The policy as an HF-format folder any engine loads: config, safetensors (tied weights
    once), generation config and, if given, the tokenizer."""
    from safetensors.torch import save_file

    config = model.config
    tensors = {name: tensor.detach().contiguous() for name, tensor in full_state.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, path / name)


def latest_checkpoint(directory: Path) -> Path | None:
    complete = [
        p for p in sorted(directory.glob("step_??????")) if (p / STATE_FILE).is_file() and _shard_file(p, 0).is_file()
    ]
    if not complete and any((p / STATE_FILE).is_file() for p in directory.glob("step_??????")):
        log.warning("ignoring checkpoints without shard files: written by an older trainer", directory=str(directory))
    return complete[-1] if complete else None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic: Trained | None = None
) -> TrainerState:
    """Loads the policy and optimizer (and the critic, if given) into this rank's shards
    (resharded if the checkpoint was saved by another number of ranks) and this rank's RNG state
    if the checkpoint has one."""
    saved = torch.load(path / STATE_FILE, weights_only=True)
    saved_world = saved.get("world_size", 1)
    shards = [torch.load(_shard_file(path, rank), weights_only=True, mmap=True) for rank in range(saved_world)]
    for prefix, (part_model, part_optimizer) in _parts(model, optimizer, critic).items():
        _load_part(path, shards, prefix, part_model, part_optimizer)
    if _rank() < saved_world:
        torch.set_rng_state(shards[_rank()]["rng"])
    if saved_world != _world():
        log.info("resharded a checkpoint", checkpoint=str(path), saved_ranks=saved_world, ranks=_world())
    return TrainerState(step=saved["step"], version=saved["version"], task_cursors=dict(saved.get("task_cursors", {})))


def _load_part(
    path: Path, shards: list[dict], prefix: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """One model and its optimizer from the shard files' entries under `prefix`."""
    if f"{prefix}param_groups" not in shards[0]:
        raise ValueError(
            f"checkpoint {path} holds no {prefix.rstrip('/') or 'policy'}: it was saved by a trainer without one"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)
    for key, value in _flat_entries(model_state, optimizer_state, prefix).items():
        if key not in shards[0]["tensors"] and key not in shards[0]["values"]:
            raise ValueError(f"checkpoint {path} has no {key}: it was saved from another model or optimizer")
        if not isinstance(value, torch.Tensor):
            name, field_name = key.removeprefix(f"{prefix}optimizer/").rsplit("/", 1)
            optimizer_state["state"][name][field_name] = shards[0]["values"][key]
            continue
        local, rows = _local_rows(key, value)
        if local.dim() == 0:
            local.copy_(shards[0]["tensors"][key])
            continue
        # A tensor a rank saved whole (an unsharded model's) covers every row.
        pieces = [
            (shard["rows"].get(key, (0, shard["tensors"][key].shape[0])), shard["tensors"][key]) for shard in shards
        ]
        local.copy_(gather_rows(pieces, rows or (0, local.shape[0])))
    optimizer_state["param_groups"] = shards[0][f"{prefix}param_groups"]
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
