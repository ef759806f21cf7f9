"""The frozen reference in a process of its own: its log-probabilities are the trainer's
`token_logprobs`, it dies with the process that started it, and a crash is reported by name."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import PAD_TOKEN, load_tokenizer
from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.ranks.reference import ReferenceWorker, ReferenceWorkerError, response_logprobs
from tests.support.samples import digit_samples

FP32_UNIT_ROUNDOFF = 2.0**-24


def expected_logprobs(model_dir: Path, samples: list[TrainingSample], pad_id: int) -> tuple[list[list[float]], float]:
    """`token_logprobs` of the folder's model on the samples' micro-batch, at each response token,
    and the tolerance for the same figures computed at other padding widths.

    Another padding width gives the matrix products other shapes, and with them another blocking
    of their sums, so the same fp32 reductions add their terms in another order. Under the usual
    model of rounding (each addition off by a random fraction of an ulp), a reduction over n terms
    then moves its result by about sqrt(n) * u relative to its size (u = 2^-24, the fp32 unit
    roundoff), and the relative errors of the reductions a value flows through add in quadrature:
    over the forward pass, about sqrt(N) * u with N the terms of every reduction on its path (per
    layer: the q, k, v and o projections, gate and up over the hidden size, attention over the
    positions, down over the intermediate size; then the LM head). A log-probability is
    z_t/T - logsumexp(z/T): the logits' errors reach it at most twice, scaled by 1/T. Hence
    2 * sqrt(N) * u * max|z/T|; about 5e-5 for the tiny model (N = 2560, max|z/T| = 8). Reordered
    sums differed by 1e-6 here and 2.9e-6 on an AMD EPYC; a wrong mask, position or temperature
    moves log-probabilities by more than 1e-2."""
    batch = build_micro_batch(samples, pad_id)
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = token_logprobs(model, batch)
    config = model.config
    terms = (
        config.num_hidden_layers * (6 * config.hidden_size + config.intermediate_size + config.max_position_embeddings)
        + config.hidden_size
    )
    scaled = logits / batch.temperatures.view(-1, 1, 1)
    largest = scaled[batch.attention_mask.bool()].abs().max().item()
    tolerance = 2 * math.sqrt(terms) * FP32_UNIT_ROUNDOFF * largest
    return [row[batch.response_mask[i].bool()].tolist() for i, row in enumerate(logprobs)], tolerance


def assert_close(actual: list[list[float]], expected: list[list[float]], tolerance: float) -> None:
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=tolerance)


async def test_the_worker_computes_the_trainers_token_logprobs_of_the_frozen_model(model_dir):
    pad_id = load_tokenizer(model_dir).token_to_id(PAD_TOKEN)
    samples = digit_samples(model_dir, 12)
    expected, tolerance = expected_logprobs(model_dir, samples, pad_id)
    assert len({len(s.prompt_ids) for s in samples}) > 3 and len({s.temperature for s in samples}) == 3
    # In chunks of a few samples (other padding widths) in this process, then in the worker.
    assert_close(response_logprobs(load_causal_lm(model_dir), samples, pad_id, forward_samples=5), expected, tolerance)
    worker = await ReferenceWorker.start(str(model_dir), pad_id)
    try:
        # Several requests in flight at once are answered each with its own samples.
        first, second, empty = await asyncio.gather(
            worker.logprobs(samples[:7]), worker.logprobs(samples[7:]), worker.logprobs([])
        )
        assert_close(first + second, expected, tolerance)
        assert empty == []
        # At another temperature the answer changes accordingly.
        hotter = [replace(s, temperature=2.0) for s in samples[:3]]
        assert_close(await worker.logprobs(hotter), *expected_logprobs(model_dir, hotter, pad_id))
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
    from services.trainer.ranks.reference import ReferenceWorker

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
