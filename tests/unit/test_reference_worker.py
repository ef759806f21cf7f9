"""The frozen reference in a process of its own: its log-probabilities are the trainer's
`token_logprobs`, a micro-batch carrying them trains as the colocated reference does, it dies with
the process that started it, a crash is reported by name, and the placement setting is checked."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlmesh.settings.handover import trainer_settings
from rlmesh.config import ConfigError
from rlmesh.job import AlgorithmSection, load_job, parse_value
from rlmesh.settings.trainer import REFERENCE_APART, REFERENCE_COLOCATED
from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from services.trainer.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.config import TrainerConfig
from services.trainer.distributed import RankInfo
from services.trainer.policy import ShardedPolicy
from services.trainer.reference import ReferenceWorker, ReferenceWorkerError, response_logprobs

TEMPERATURES = (0.6, 1.0, 1.3)


def digit_samples(model_dir: Path, count: int, seed: int = 3) -> list[TrainingSample]:
    """Prompts of 2 to 9 tokens, responses of 1 to 7, each drawn at one of TEMPERATURES."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))) + "=").ids
        response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(0, 6)))).ids + [eos]
        samples.append(TrainingSample(prompt, response, [rng.uniform(-3.0, -0.5) for _ in response], rng.uniform(-1.5, 1.5),
                                      TEMPERATURES[index % len(TEMPERATURES)]))
    return samples


def expected_logprobs(model_dir: Path, samples: list[TrainingSample], pad_id: int) -> list[list[float]]:
    """`token_logprobs` of the folder's model on the samples' micro-batch, at each response token."""
    batch = build_micro_batch(samples, pad_id)
    with torch.no_grad():
        logprobs = token_logprobs(load_causal_lm(model_dir), batch)
    return [row[batch.response_mask[i].bool()].tolist() for i, row in enumerate(logprobs)]


def assert_close(actual: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


async def test_the_worker_computes_the_trainers_token_logprobs_of_the_frozen_model(model_dir):
    pad_id = load_tokenizer(model_dir).token_to_id(PAD_TOKEN)
    samples = digit_samples(model_dir, 12)
    expected = expected_logprobs(model_dir, samples, pad_id)
    assert len({len(s.prompt_ids) for s in samples}) > 3 and len({s.temperature for s in samples}) == 3
    # In chunks of a few samples (other padding widths) in this process, then in the worker.
    assert_close(response_logprobs(load_causal_lm(model_dir), samples, pad_id, forward_samples=5), expected)
    worker = await ReferenceWorker.start(str(model_dir), pad_id)
    try:
        # Several requests in flight at once are answered each with its own samples.
        first, second, empty = await asyncio.gather(worker.logprobs(samples[:7]), worker.logprobs(samples[7:]), worker.logprobs([]))
        assert_close(first + second, expected)
        assert empty == []
        # At another temperature the answer changes accordingly.
        hotter = [replace(s, temperature=2.0) for s in samples[:3]]
        assert_close(await worker.logprobs(hotter), expected_logprobs(model_dir, hotter, pad_id))
    finally:
        await worker.close()
    assert worker.process.returncode == 0
    with pytest.raises(ReferenceWorkerError, match="was closed"):
        await worker.logprobs(samples)


async def test_a_failed_request_and_a_crash_are_reported_naming_the_reference_worker(model_dir):
    pad_id = load_tokenizer(model_dir).token_to_id(PAD_TOKEN)
    samples = digit_samples(model_dir, 2)
    worker = await ReferenceWorker.start(str(model_dir), pad_id)
    try:
        beyond_vocabulary = TrainingSample([1, 10**6], [2], [0.0], 0.0)
        with pytest.raises(ReferenceWorkerError, match=rf"reference worker \(pid {worker.pid}\) failed: IndexError"):
            await worker.logprobs([beyond_vocabulary])
        assert len(await worker.logprobs(samples)) == 2, "a failed request leaves the worker serving"
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(ReferenceWorkerError, match=rf"reference worker \(pid {worker.pid}\) was killed by SIGKILL"):
            await worker.logprobs(samples)
    finally:
        await worker.close()
    with pytest.raises(ReferenceWorkerError, match="does-not-exist holds no config.json|exited with code 1"):
        await ReferenceWorker.start(str(model_dir / "does-not-exist"), pad_id)


PARENT = textwrap.dedent("""
    import asyncio, sys
    from services.trainer.reference import ReferenceWorker

    async def main():
        worker = await ReferenceWorker.start(sys.argv[1], 0)
        print("worker", worker.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_worker_dies_when_the_process_that_started_it_is_killed(model_dir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(next(line for line in parent.stdout if line.startswith("worker ")).split()[1])
        assert not gone(worker_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5.0
        while not gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(worker_pid), "the reference worker outlived the trainer that started it"
    finally:
        parent.kill()
        parent.wait()


def make_policy(model_dir: Path, tmp_path: Path, rank: RankInfo, placement) -> ShardedPolicy:
    config = TrainerConfig(model_dir=str(model_dir), output_dir=str(tmp_path), prompts_per_step=2, group_size=4,
                           micro_batch_groups=1, placement=placement, kl_coef=0.1)
    return ShardedPolicy(config, rank)


def gradients(policy: ShardedPolicy) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in policy.model.named_parameters()}


def test_a_micro_batch_carrying_reference_logprobs_trains_as_the_colocated_reference(model_dir, tmp_path, rank):
    colocated = make_policy(model_dir, tmp_path, rank, REFERENCE_COLOCATED)
    apart = make_policy(model_dir, tmp_path, rank, REFERENCE_APART)
    assert colocated.reference is not None and apart.reference is None, "with the reference apart the ranks load no copy"
    samples = digit_samples(model_dir, 8)
    # The policy moves away from the reference first, so the KL term has a gradient of its own.
    for policy in (colocated, apart):
        policy.backward([replace(s, reference_logprobs=[-1.0] * len(s.response_ids)) for s in samples[:4]])
        policy.optimizer_step()
    with_reference = [replace(s, reference_logprobs=r)
                      for s, r in zip(samples, response_logprobs(load_causal_lm(model_dir), samples, apart.pad_id))]
    expected = colocated.backward(samples)
    given = apart.backward(with_reference)
    assert given.kl > 1e-4, "the step did not move the policy from the reference"
    assert given.loss == pytest.approx(expected.loss, abs=1e-6)
    assert given.kl == pytest.approx(expected.kl, abs=1e-7)
    for name, gradient in gradients(colocated).items():
        torch.testing.assert_close(gradients(apart)[name], gradient, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="must carry its reference_logprobs"):
        apart.backward(samples)


def test_the_placement_keeps_logp_with_train_and_puts_the_reference_in_or_apart(tmp_path):
    assert AlgorithmSection().placement == [["train", "logp"], ["ref_logp"]]
    AlgorithmSection(placement=[["ref_logp"], ["logp", "train"]])
    AlgorithmSection(placement=[["logp", "ref_logp", "train"]])
    with pytest.raises(ValueError, match=r"logp apart from train: logp \(the proximal policy's log-probabilities\) needs the live"):
        AlgorithmSection(placement=[["train"], ["logp", "ref_logp"]])
    with pytest.raises(ValueError, match=r"exactly once .* repeated: \['train'\], missing: \['ref_logp'\]"):
        AlgorithmSection(placement=[["train", "logp"], ["train"]])
    with pytest.raises(ValueError, match="exactly once"):
        AlgorithmSection(placement=[["train", "logp", "ref_logp"], []])
    with pytest.raises(ValueError, match="'train', 'logp' or 'ref_logp'"):
        AlgorithmSection(placement=[["train", "logp", "critic"]])
    with pytest.raises(ValueError, match="logp apart from train"):
        TrainerConfig(model_dir="m", placement=[["train", "ref_logp"], ["logp"]])
    # Only meaningful with a KL penalty.
    assert TrainerConfig(model_dir="m", kl_coef=0.05).reference_apart
    assert not TrainerConfig(model_dir="m", kl_coef=0.05, placement=REFERENCE_COLOCATED).reference_apart
    assert not TrainerConfig(model_dir="m").reference_apart
    # `rlmesh up --set algorithm.placement=...` reaches the trainer's config.
    job, base = load_job(None, {"algorithm.kl_coef": 0.05, "algorithm.placement": parse_value('[["train", "logp", "ref_logp"]]')})
    config = TrainerConfig(**trainer_settings(job, base, tmp_path, tmp_path))
    assert config.placement == REFERENCE_COLOCATED and not config.reference_apart
    with pytest.raises(ConfigError, match="algorithm.placement: .*logp apart from train"):
        load_job(None, {"algorithm.placement": parse_value('[["train"], ["logp"], ["ref_logp"]]')})
