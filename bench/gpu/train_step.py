"""One GRPO training step of the trainer's sharded policy on one device (one rank): step time,
peak GPU memory, tokens per second and the publish's copy of the shards to host memory."""

from __future__ import annotations

import gc
import math
import statistics
import tempfile
import threading
import time
from pathlib import Path

import structlog
import torch

from services.trainer.config import TrainerConfig
from services.trainer.ranks.batching import TrainingSample
from services.trainer.ranks.distributed import init_distributed, shutdown_distributed
from services.trainer.ranks.handoff import ShardHandoff, mesh_tag
from services.trainer.ranks.policy import ShardedPolicy

log = structlog.get_logger()

PROMPT_TOKENS = 64


def synthetic_samples(count: int, tokens: int, vocab_size: int, generator: torch.Generator) -> list[TrainingSample]:
    """`count` samples of `tokens` tokens (a prompt of up to PROMPT_TOKENS, the rest response) with
    random ids, advantages and behaviour log-probabilities near a uniform policy's."""
    prompt = min(PROMPT_TOKENS, tokens // 2)
    response = tokens - prompt
    if prompt < 1 or response < 1:
        raise ValueError(f"tokens must be at least 2, got {tokens}")
    uniform = -math.log(vocab_size)
    samples = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()
        behaviour = (uniform + torch.rand(response, generator=generator) - 0.5).tolist()
        advantage = float(torch.randn((), generator=generator))
        samples.append(TrainingSample(ids[:prompt], ids[prompt:], behaviour, advantage))
    return samples


def measure_grpo_step(
    model_dir: Path, device: str, samples: int, tokens: int, micro_batch_samples: int, steps: int = 3
) -> dict:
    """`steps` training steps of `samples` samples of `tokens` tokens each, `micro_batch_samples` per
    forward/backward, then the optimizer step and the publish's pack (on CUDA the copy to pinned
    memory, which lands in a worker thread while the next step computes, as in the trainer).
    Returns the median step seconds (the first step left out as warm-up when steps > 1), the
    peak GPU memory (0 on CPU), tokens per second, the median pack seconds and the precision."""
    if steps < 1 or samples < 1 or micro_batch_samples < 1:
        raise ValueError("steps, samples and micro_batch_samples must be at least 1")
    cuda = torch.device(device).type == "cuda"
    backend = "nccl" if cuda else "gloo"
    rank = init_distributed(backend, 600.0)
    policy, handoff = None, None
    try:
        with tempfile.TemporaryDirectory(prefix="rlmesh-train-step-") as output:
            config = TrainerConfig(model_dir=str(model_dir), output_dir=output, distributed_backend=backend)
            policy = ShardedPolicy(config, rank)
            # Nothing is uploaded: only the pack (the copy out of the device) is measured.
            handoff = ShardHandoff(
                None, policy.shape, rank.rank, rank.world_size, "stream", mesh_tag(output), 60.0, policy.weights_dtype
            )
            generator = torch.Generator().manual_seed(config.seed)
            batch = synthetic_samples(samples, tokens, policy.shape.vocab_size, generator)
            if cuda:
                torch.cuda.reset_peak_memory_stats(rank.device)
            step_seconds, packs = [], []
            landing: threading.Thread | None = None
            for step in range(steps):
                _synchronize(cuda)
                started = time.perf_counter()
                for first in range(0, samples, micro_batch_samples):
                    policy.backward(batch[first : first + micro_batch_samples])
                policy.optimizer_step()
                # The last version's copy landed in the meantime; the staging buffer is free again.
                if landing is not None:
                    landing.join()
                packed = handoff.pack(step + 1, policy.local_shards())
                policy.guard_writes(packed.copied)
                packs.append(packed)
                landing = threading.Thread(target=handoff.land_now, args=(packed,), name="land")
                landing.start()
                if cuda:
                    # The compute stream only: the copy out goes on behind the next step.
                    torch.cuda.current_stream(rank.device).synchronize()
                step_seconds.append(time.perf_counter() - started)
                log.info("training step", step=step, seconds=round(step_seconds[-1], 4))
            landing.join()
            measured = step_seconds[1:] if steps > 1 else step_seconds
            median = statistics.median(measured)
            return {
                "step_seconds": median,
                "peak_memory_gib": torch.cuda.max_memory_allocated(rank.device) / 2**30 if cuda else 0.0,
                "tokens_per_second": samples * tokens / median,
                "pack_seconds": statistics.median(p.pack_seconds for p in (packs[1:] if steps > 1 else packs)),
                "precision": "bf16" if policy.compute_dtype == torch.bfloat16 else "fp32",
                "weights_dtype": str(policy.weights_dtype).removeprefix("torch."),
                "publish_bytes": packs[-1].header.total_bytes,
                "device": str(rank.device),
            }
    finally:
        if handoff is not None:
            handoff.close()
        # The next call (another model) starts with this one's device memory and process group gone.
        policy, handoff = None, None
        gc.collect()
        shutdown_distributed()
        if cuda:
            torch.cuda.empty_cache()


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
