"""Resumable sharded checkpoints: the policy and optimizer with torch.distributed.checkpoint (each
rank writes its own shards; a checkpoint saved by N ranks loads on any number of ranks), the step
and weight version, each rank's RNG state, and on request the whole policy as an HF folder.

Layout: `checkpoints/step_NNNNNN/` holds `.metadata` and `__<rank>_0.distcp` (DCP),
`rng_rank<r>.pt`, `pipeline.pkl` (rank 0's steps in flight), `trainer_state.pt` (written last), and with an export `config.json`,
`model.safetensors` and the tokenizer. A save goes to `step_NNNNNN.partial/` and is renamed when
complete; the newest KEEP checkpoints are kept.

Every function here is collective when a process group is initialised: every rank calls it, in
the same order. Without a process group it runs on a plain (unsharded) model."""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

log = structlog.get_logger()

KEEP = 2
STATE_FILE = "trainer_state.pt"
PIPELINE_FILE = "pipeline.pkl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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


def _begin(directory: Path, step: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    """The checkpoint's folder and the `.partial` one it is written to (made empty by rank 0)."""
    target = directory / f"step_{step:06d}"
    partial = target.with_suffix(".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(group)
    torch.save(torch.get_rng_state(), partial / f"rng_rank{_rank()}.pt")
    return target, partial


def _complete(directory: Path, target: Path, partial: Path, state: TrainerState, world_size: int) -> None:
    """Rank 0, once every rank's shards are written: the state, then the rename, then pruning."""
    if state.pipeline:
        (partial / PIPELINE_FILE).write_bytes(state.pipeline)
    torch.save({"step": state.step, "version": state.version, "task_cursors": dict(state.task_cursors),
                "world_size": world_size}, partial / STATE_FILE)
    shutil.rmtree(target, ignore_errors=True)
    # Rename last so a crash mid-save never leaves a checkpoint that looks complete.
    partial.rename(target)
    for old in sorted(directory.glob("step_??????"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    export_hf: bool = False, tokenizer_dir: Path | None = None,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Saves every rank's shards, and returns when they are on disk; with `export_hf` rank 0 also
    writes the whole policy as an HF folder (the only place the full model is gathered, offloaded
    to CPU). `group` is a gloo group for barriers (None: the default group)."""
    target, partial = _begin(directory, state.step, group)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial, no_dist=not dist.is_initialized())
    full = (get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if export_hf else None)
    if _rank() == 0:
        if full is not None:
            export_hf_folder(partial, model, full, tokenizer_dir)
        _complete(directory, target, partial, state, _world())
    _barrier(group)
    return target


class BackgroundCheckpoints:
    """Checkpoints that training does not wait for: the shards are copied to memory (staged) at
    once, then written by a background thread while training goes on; rank 0 completes the
    checkpoint (state, rename) once every rank has written. One is written at a time: a new one
    first waits for the last.

    `group` is a gloo group used by nothing else: the write's collectives (planning, the final
    gather of every rank's results) then never interleave with training's."""

    def __init__(self, directory: Path, group: dist.ProcessGroup | None) -> None:
        """`group` None: one process alone, whose write needs no collective."""
        if group is None and _world() > 1:
            raise ValueError("background checkpoints of several ranks need a process group of their own")
        self.directory = directory
        self.group = group
        self._writing: Future | None = None
        self._completing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
             barrier_group: dist.ProcessGroup | None = None) -> Path:
        """Starts writing a checkpoint; returns its folder (complete once `wait` returns)."""
        self.wait()
        target, partial = _begin(self.directory, state.step, barrier_group)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        written = dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial,
                                 process_group=self.group, no_dist=self.group is None)
        world_size = _world()
        if _rank() == 0:
            # Rank 0's save ends after it gathered every rank's write results and wrote .metadata.
            self._writing = self._completing.submit(lambda: (written.result(), _complete(self.directory, target, partial, state,
                                                                                            world_size)))
        else:
            self._writing = written
        return target

    def wait(self) -> None:
        """Until the checkpoint being written (if any) is complete; raises what failed it."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def close(self) -> None:
        self.wait()
        self._completing.shutdown()


def export_hf_folder(path: Path, model: torch.nn.Module, full_state: dict[str, torch.Tensor],
                     tokenizer_dir: Path | None = None) -> None:
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
    complete = [p for p in sorted(directory.glob("step_??????")) if (p / STATE_FILE).is_file() and (p / ".metadata").is_file()]
    if not complete and any((p / STATE_FILE).is_file() for p in directory.glob("step_??????")):
        log.warning("ignoring checkpoints without sharded (DCP) state: written by an older trainer", directory=str(directory))
    return complete[-1] if complete else None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Loads the policy and optimizer into this rank's shards (resharded if the checkpoint was
    saved by another number of ranks) and this rank's RNG state if the checkpoint has one."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    saved = torch.load(path / STATE_FILE, weights_only=True)
    if saved.get("world_size", _world()) != _world():
        log.info("resharded a checkpoint", checkpoint=str(path), saved_ranks=saved["world_size"], ranks=_world())
    return TrainerState(step=saved["step"], version=saved["version"], task_cursors=dict(saved.get("task_cursors", {})))
