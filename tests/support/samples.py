"""Sample inputs on the tiny digit model: prompts, sampling parameters, and training samples
(single or in micro-batches, with rewards) with behaviour log-probabilities near the model's own."""

from __future__ import annotations

import random
from pathlib import Path

from rlmesh.common.v1 import common_pb2
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from services.trainer.ranks.batching import TrainingSample

NO_STOP = common_pb2.SamplingParams(temperature=1.0, max_tokens=55)
"""Sampling without a stop token: every response runs to 55 tokens, long enough to interrupt."""
DIGIT_PROMPTS = ["1234=", "98765432=", "50=", "7="]


def prompt_batch(model_dir, count: int) -> list[tuple[str, list[int]]]:
    """`count` (prompt id p0, p1, ..., token ids) pairs."""
    tokenizer = load_tokenizer(model_dir)
    return [(f"p{i}", tokenizer.encode(f"{1000 + 37 * i}=").ids) for i in range(count)]


def sampling(model_dir, max_tokens: int = 8) -> common_pb2.SamplingParams:
    eos = load_tokenizer(model_dir).token_to_id(EOS_TOKEN)
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[eos])


SAMPLE_TEMPERATURES = (0.6, 1.0, 1.3)


def digit_samples(model_dir: Path, count: int, seed: int = 3) -> list[TrainingSample]:
    """Prompts of 2 to 9 tokens, responses of 1 to 7, each drawn at one of SAMPLE_TEMPERATURES."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))) + "=").ids
        response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(0, 6)))).ids + [eos]
        samples.append(
            TrainingSample(
                prompt,
                response,
                [rng.uniform(-3.0, -0.5) for _ in response],
                rng.uniform(-1.5, 1.5),
                SAMPLE_TEMPERATURES[index % len(SAMPLE_TEMPERATURES)],
            )
        )
    return samples


def micro_batches(model_dir, count: int, size: int = 4) -> list[list[TrainingSample]]:
    """Groups of digit prompts and responses with behaviour log-probabilities near the model's own."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(5)
    batches = []
    for _ in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))) + "=").ids
        samples = []
        for _ in range(size):
            response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))).ids + [eos]
            behaviour = [rng.uniform(-3.0, -0.5) for _ in response]
            samples.append(TrainingSample(prompt, response, behaviour, rng.uniform(-1.5, 1.5)))
        batches.append(samples)
    return batches


def rewarded_micro_batches(model_dir, count: int) -> list[list[TrainingSample]]:
    """`micro_batches` with every other response rewarded 1 (on its last token)."""
    batches = micro_batches(model_dir, count)
    for batch in batches:
        for index, sample in enumerate(batch):
            sample.reward = float(index % 2)
    return batches
