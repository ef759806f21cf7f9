"""The frozen reference policy in a process of its own (placement: `ref_logp` apart), started by
rank 0: it computes each group's reference log-probabilities as soon as the group is scored, while
the ranks train on other groups. It talks to rank 0 over its stdin and stdout, and dies with it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any, BinaryIO

import structlog
import torch

from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.ranks.child_process import (
    ChildProcess,
    end_child,
    frame,
    how_it_ended,
    next_frame,
    read_frame,
    start_child,
    write_frame,
)

log = structlog.get_logger()

FORWARD_SAMPLES = 32
"""Most samples in one forward of the reference."""
CLOSE_SECONDS = 30.0
"""How long a closing worker may take to exit after its stdin closed before it is killed (torch's
teardown takes seconds of CPU, and a busy host gives it a fraction of a core)."""


class ReferenceWorkerError(RuntimeError):
    """The reference worker failed a request, or is gone."""


@torch.inference_mode()
def response_logprobs(
    model: torch.nn.Module, samples: Sequence[TrainingSample], pad_id: int, forward_samples: int = FORWARD_SAMPLES
) -> list[list[float]]:
    """Per sample, the log-probability of each response token under `model` at the sample's
    temperature: `token_logprobs` on the samples' micro-batch, at most `forward_samples` at a time."""
    scored: list[list[float]] = []
    for first in range(0, len(samples), forward_samples):
        chunk = list(samples[first : first + forward_samples])
        logprobs = token_logprobs(model, build_micro_batch(chunk, pad_id))
        for row, sample in zip(logprobs, chunk):
            start = len(sample.prompt_ids) - 1
            scored.append(row[start : start + len(sample.response_ids)].tolist())
    return scored


def serve(model_dir: str, pad_id: int, threads: int, parent_pid: int, requests: BinaryIO, replies: BinaryIO) -> None:
    """The worker's loop: answers each request (a list of (prompt ids, response ids, temperature))
    in order until its stdin closes."""
    from rlmesh.lifecycle import die_with_parent, parent_lives
    from rlmesh.models.loading import load_causal_lm

    die_with_parent()
    if not parent_lives(parent_pid):  # the trainer died before the request took effect
        return
    # Ctrl-C reaches the whole process group: the trainer decides, and this process ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    model = load_causal_lm(model_dir)
    model.requires_grad_(False)
    write_frame(replies, ("ready", os.getpid()))
    while (request := read_frame(requests)) is not None:
        try:
            samples = [
                TrainingSample(prompt, response, [0.0] * len(response), 0.0, temperature)
                for prompt, response, temperature in request
            ]
            reply: tuple[str, Any] = ("ok", response_logprobs(model, samples, pad_id))
        except Exception as exc:  # noqa: BLE001 - the trainer raises it, naming this worker
            reply = ("error", f"{type(exc).__name__}: {exc}")
        write_frame(replies, reply)


class ReferenceWorker:
    """Rank 0's handle on the reference process. Requests are answered in the order they are sent;
    several may be in flight (one per batch of groups being scored)."""

    def __init__(self, process: ChildProcess) -> None:
        self.process = process
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting: deque[asyncio.Future] = deque()
        """One future per request sent and not yet answered, in sending order."""
        self._failure: ReferenceWorkerError | None = None
        self._closing = False
        self._reader = asyncio.create_task(self._read(), name="reference worker replies")

    @classmethod
    async def start(
        cls, model_dir: str, pad_id: int, threads: int = 1, timeout_seconds: float = 120.0
    ) -> ReferenceWorker:
        """Starts the process and waits until it holds the model."""
        process = await start_child(
            "services.trainer.ranks.reference",
            "--model-dir",
            str(model_dir),
            "--pad-id",
            str(pad_id),
            "--threads",
            str(threads),
            "--parent-pid",
            str(os.getpid()),
        )
        worker = cls(process)
        try:
            await asyncio.wait_for(asyncio.shield(worker._ready), timeout_seconds)
        except TimeoutError:
            await worker.close()
            raise ReferenceWorkerError(
                f"the reference worker (pid {process.pid}) did not load {model_dir} within {timeout_seconds:g} s"
            ) from None
        except BaseException:
            await worker.close()
            raise
        log.info("reference worker ready", pid=process.pid, model_dir=str(model_dir), threads=threads)
        return worker

    @property
    def pid(self) -> int:
        return self.process.pid

    async def logprobs(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """Per sample, the frozen reference's log-probability of each response token at the sample's
        temperature (as `token_logprobs` computes the policy's)."""
        if self._failure is not None:
            raise self._failure
        if not samples:
            return []
        reply = asyncio.get_running_loop().create_future()
        self._waiting.append(reply)
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(frame([(s.prompt_ids, s.response_ids, s.temperature) for s in samples]))
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is gone: the reader says why, through `reply`
        scored = await reply
        if len(scored) != len(samples):
            raise ReferenceWorkerError(f"the reference worker answered {len(scored)} samples for {len(samples)}")
        return scored

    async def close(self) -> None:
        """Closes its stdin, which ends it; kills it if it does not exit in time."""
        self._closing = True
        await end_child(self.process, CLOSE_SECONDS)
        await self._reader

    async def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        while (message := await next_frame(stdout)) is not None:
            kind, value = message
            if kind == "ready":
                self._ready.set_result(value)
                continue
            reply = self._waiting.popleft()
            if reply.done():  # its caller was cancelled
                continue
            if kind == "ok":
                reply.set_result(value)
            else:
                reply.set_exception(ReferenceWorkerError(f"the reference worker (pid {self.pid}) failed: {value}"))
        code = await self.process.wait()
        ending = how_it_ended(code)
        if self._closing:
            self._failure = ReferenceWorkerError(f"the reference worker (pid {self.pid}) was closed")
        else:
            self._failure = ReferenceWorkerError(
                f"the reference worker (pid {self.pid}) {ending}; its error, if any, is in the trainer's log"
            )
        for future in (self._ready, *self._waiting):
            if not future.done():
                future.set_exception(self._failure)
        self._waiting.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description="The trainer's frozen reference policy (started by rank 0).")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--pad-id", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    # Replies travel on the original stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(args.model_dir, args.pad_id, args.threads, args.parent_pid, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
