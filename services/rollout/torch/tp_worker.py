"""A tensor-parallel worker process (rank >= 1), started by rank 0's engine: it replays rank 0's
step program on its own shard and serves weight operations on a second thread."""

from __future__ import annotations

import datetime
import json
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch
import torch.distributed as dist

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.lifecycle import die_with_parent, parent_lives
from rlmesh.logging import configure_logging
from rlmesh.transfer.auth import UnprovenPayload
from rlmesh.transfer.base import TransferError
from services.rollout.torch.rank import RankRunner, RankTransfer, RankWeights, build_rank
from services.rollout.torch.tp_group import START_TIMEOUT_SECONDS, receive, send
from services.rollout.torch.tp_model import Collectives

log = structlog.get_logger()

_STEP_OPS = frozenset(
    {"prefill", "decode", "keep", "clear", "switch", "save_prefix", "drop_prefix", "prefill_prefixed"}
)
# Subclasses before their bases: the first match names the error.
_ERROR_KINDS = (
    (UnprovenPayload, "unproven"),
    (TransferError, "transfer"),
    (InvalidArgument, "invalid"),
    (FailedPrecondition, "precondition"),
    (ValueError, "invalid"),
)


def replay_steps(channel: Connection, runner: RankRunner) -> None:
    """Applies rank 0's step program in order until rank 0 closes the channel."""
    while True:
        try:
            op, args = receive(channel)
        except EOFError:
            return
        if op not in _STEP_OPS:
            raise RuntimeError(f"unknown step operation {op!r}")
        getattr(runner, op)(*args)


def serve_weights(channel: Connection, weights: RankWeights) -> None:
    """Answers rank 0's weight operations, one at a time, until rank 0 closes the channel."""
    while True:
        try:
            op, args = receive(channel)
        except EOFError:
            return
        try:
            if op == "prepare":
                manifest = common_pb2.WeightManifest.FromString(args[0])
                reply: tuple[Any, ...] = ("ok", weights.prepare(manifest, *args[1:]))
            elif op in ("write", "verify", "finish", "stage"):
                reply = ("ok", getattr(weights, op)(*args))
            else:
                reply = ("error", "invalid", f"unknown weight operation {op!r}")
        except Exception as exc:
            kind = next((name for error, name in _ERROR_KINDS if isinstance(exc, error)), "internal")
            if kind == "internal":
                log.exception("weight operation failed", op=op)
            reply = ("error", kind, f"rank {weights.rank}: {exc}")
        send(channel, reply)


def main(spec: dict[str, Any]) -> int:
    # If rank 0 dies, so does this rank; if it died already, there is nothing to serve.
    die_with_parent()
    if not parent_lives(spec["parent_pid"]):
        return 1
    rank = spec["rank"]
    configure_logging("info", service="rollout")
    structlog.contextvars.bind_contextvars(tp_rank=rank)
    torch.set_num_threads(spec["threads"])
    steps, weight_channel = Connection(spec["step_fd"]), Connection(spec["weights_fd"])
    try:
        send(steps, ("joining", None))
        store = dist.TCPStore(
            "127.0.0.1",
            spec["store_port"],
            spec["tp"],
            False,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_SECONDS),
        )
        collectives = Collectives.connect(store, rank, spec["tp"])
        runner, weights = build_rank(
            spec["model_dir"],
            collectives,
            RankTransfer(**spec["transfer"]),
            spec["version"],
            dtype=getattr(torch, spec["dtype"]) if spec["dtype"] else None,
        )
        send(steps, ("ready", None))
    except Exception as exc:
        log.exception("tensor-parallel rank failed to start")
        send(steps, ("failed", str(exc)))
        return 1
    threading.Thread(target=serve_weights, args=(weight_channel, weights), name="weights", daemon=True).start()
    try:
        replay_steps(steps, runner)
    finally:
        weights.close()
        collectives.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
