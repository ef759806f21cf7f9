"""Rank 0's side of a tensor-parallel engine: its own rank, the worker processes of ranks
1..T-1, the step program they replay in lockstep, and their weight channels."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.forking.helpers import WarmHelper, start_helper
from rlmesh.transfer.auth import UnprovenPayload
from rlmesh.transfer.base import TransferError
from services.rollout.torch.rank import CPU, RankPort, RankTransfer, RankWeights, build_rank
from services.rollout.torch.tp_model import Collectives

log = structlog.get_logger()

START_TIMEOUT_SECONDS = 180.0
"""Time for a worker to import torch and build its model on a busy machine."""
STOP_TIMEOUT_SECONDS = 10.0
WORKER_MODULE = "services.rollout.torch.tp_worker"


def to_wire(value: Any) -> Any:
    """Tensors travel as numpy arrays: pickling a small tensor costs ~20x more."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(to_wire(v) for v in value)
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(from_wire(v) for v in value)
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    return value


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(pickle.dumps(to_wire(message), protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> Any:
    return from_wire(pickle.loads(connection.recv_bytes()))


_ERRORS: dict[str, type[Exception]] = {
    "transfer": TransferError,
    "invalid": InvalidArgument,
    "precondition": FailedPrecondition,
    "unproven": UnprovenPayload,
}


class Worker:
    """One worker process (rank >= 1) seen from rank 0: its step channel, which carries the step
    program, and its weight channel, a request/reply channel served on the worker by a thread
    of its own so that loading never waits on decoding."""

    def __init__(self, rank: int, spec: dict[str, Any], on_exit: Callable[[int, int], None]) -> None:
        self.rank = rank
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self.stopping = False
        step, self._step_child = socket.socketpair()
        weights, self._weights_child = socket.socketpair()
        self.step = Connection(step.detach())
        self.weights = Connection(weights.detach())
        self._spec = {
            **spec,
            "rank": rank,
            "parent_pid": os.getpid(),
            "step_fd": self._step_child.fileno(),
            "weights_fd": self._weights_child.fileno(),
        }
        self.process: subprocess.Popen | WarmHelper | None = None
        started = threading.Event()
        # PR_SET_PDEATHSIG fires when the thread that forked the child ends: the supervising
        # thread forks it and lives exactly as long as it. (One the warm fork server forks ends
        # when this process's connection to its keeper closes.)
        self._supervisor = threading.Thread(
            target=self._supervise, args=(started,), name=f"tp-worker-{rank}", daemon=True
        )
        self._supervisor.start()
        started.wait()
        if self.process is None:
            raise RuntimeError(f"tensor-parallel rank {rank} could not be started")

    def _supervise(self, started: threading.Event) -> None:
        try:
            args = [json.dumps(self._spec)]
            env = {**os.environ, "OMP_NUM_THREADS": str(self._spec["threads"])}
            fds = (self._step_child.fileno(), self._weights_child.fileno())
            self.process = start_helper(WORKER_MODULE, args, env, {fd: fd for fd in fds}) or subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, *args], pass_fds=fds, stdin=subprocess.DEVNULL, env=env
            )
        finally:
            self._step_child.close()
            self._weights_child.close()
            started.set()
        code = self.process.wait()
        if not self.stopping:
            self._on_exit(self.rank, code)

    def expect(self, what: str, deadline: float) -> None:
        """Waits for the worker's start-up message `what` on its step channel."""
        while not self.step.poll(0.1):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank} exited with code {self.process.returncode} while starting"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel rank {self.rank} did not start within {START_TIMEOUT_SECONDS:.0f} s"
                )
        message = receive(self.step)
        if message[0] != what:
            raise RuntimeError(f"tensor-parallel rank {self.rank} failed to start: {message[1]}")

    def call(self, op: str, *args: Any) -> Any:
        """One weight operation on the worker (blocking; one at a time)."""
        with self._lock:
            try:
                send(self.weights, (op, args))
                reply = receive(self.weights)
            except (OSError, EOFError) as exc:
                raise TransferError(f"tensor-parallel rank {self.rank} is gone: {exc}") from exc
        if reply[0] == "ok":
            return reply[1]
        raise _ERRORS.get(reply[1], TransferError)(reply[2])

    # The weight operations of a rank, as RankWeights offers them in-process.
    def prepare(
        self,
        manifest: common_pb2.WeightManifest,
        load: bool,
        after_version: int,
        keep_base: bool = False,
        proven_at_commit: bool = False,
    ) -> RankPort:
        return self.call("prepare", manifest.SerializeToString(), load, after_version, keep_base, proven_at_commit)

    def write(
        self,
        version: int,
        offset: int,
        data: bytes,
        compression: int = common_pb2.COMPRESSION_NONE,
        raw_bytes: int = 0,
        base_version: int = -1,
    ) -> None:
        self.call("write", version, offset, data, compression, raw_bytes, base_version)

    def verify(self, version: int, timeout: float, proof: bytes = b"") -> list[int]:
        return self.call("verify", version, timeout, proof)

    def finish(self, version: int) -> None:
        self.call("finish", version)

    def stage(self, tensors: Mapping[str, torch.Tensor], after_version: int) -> None:
        self.call("stage", dict(tensors), after_version)

    def stop(self) -> None:
        self.stopping = True
        self.step.close()
        self.weights.close()
        if self.process is None:
            return
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel worker did not stop; killing it", tp_rank=self.rank)
            self.process.kill()
        self._supervisor.join()


class TensorParallelGroup:
    """Every rank of one engine. `run` is the step program: rank 0's decode thread calls it for
    each operation on the model and KV cache; it goes to every worker first, then runs on rank
    0, and the collectives inside the forward passes keep the ranks in step. Sampling happens on
    rank 0 only; the tokens reach the workers as arguments of the next step."""

    def __init__(
        self,
        model_dir: str | Path,
        tp: int,
        transfer: RankTransfer,
        version: int,
        threads: int,
        on_failure: Callable[[str], None],
        device: torch.device = CPU,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.tp = tp
        self._on_failure = on_failure
        self.failure = ""
        self._failing = threading.Lock()
        self.workers: list[Worker] = []
        self.weights: RankWeights | None = None
        self.collectives = Collectives.single()
        self._store: dist.TCPStore | None = None
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        try:
            if tp > 1:
                self._store = dist.TCPStore(
                    "127.0.0.1",
                    0,
                    tp,
                    True,
                    timeout=datetime.timedelta(seconds=START_TIMEOUT_SECONDS),
                    wait_for_workers=False,
                )
                spec = {
                    "model_dir": str(model_dir),
                    "tp": tp,
                    "store_port": self._store.port,
                    "version": version,
                    "threads": threads,
                    "transfer": asdict(transfer),
                    "dtype": str(dtype).removeprefix("torch.") if dtype else "",
                }
                for rank in range(1, tp):
                    self.workers.append(Worker(rank, spec, self._worker_exited))
                for worker in self.workers:
                    worker.expect("joining", deadline)
                self.collectives = Collectives.connect(self._store, 0, tp)
            self.runner, self.weights = build_rank(model_dir, self.collectives, transfer, version, device, dtype)
            for worker in self.workers:
                worker.expect("ready", deadline)
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> list[RankWeights | Worker]:
        """Each rank's receiving end of weight pushes, in rank order."""
        return [self.weights, *self.workers]

    def run(self, op: str, *args: Any) -> Any:
        if self.failure:
            raise RuntimeError(self.failure)
        for worker in self.workers:
            try:
                send(worker.step, (op, args))
            except OSError as exc:
                self._fail(f"tensor-parallel rank {worker.rank} is gone: {exc}")
                raise RuntimeError(self.failure) from exc
        try:
            return getattr(self.runner, op)(*args)
        except Exception as exc:
            if self.workers:
                # The workers went on with this step (or a collective failed): the ranks are out of step for good.
                self._fail(f"tensor-parallel step {op} failed: {exc}")
            raise

    def _worker_exited(self, rank: int, code: int) -> None:
        self._fail(f"tensor-parallel rank {rank} exited with code {code}")

    def _fail(self, reason: str) -> None:
        """From the decode thread or a supervising thread, whichever notices first."""
        with self._failing:
            if self.failure:
                return
            self.failure = reason
        log.error("tensor-parallel group failed", reason=reason)
        self._on_failure(reason)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.weights is not None:
            self.weights.close()
        self.collectives.close()
        self._store = None
