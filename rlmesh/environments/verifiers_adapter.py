"""Environments written for `verifiers` (0.4, `verifiers.v1`) run unchanged (`environment.verifiers`):
verifiers' own loader builds the taskset, its rows are the task's prompts, and each episode runs
verifiers' chat program against its session's base URL on the manager's gateway, tools and all;
the taskset's rewards score the episode."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from rlmesh.chat.gateway_client import KEY_HEADER, trust_environment
from rlmesh.tasks.base import PromptSource, TaskPrompt

HARNESS_ID = "rlmesh_verifiers"
"""The harness episodes run with (the package rlmesh_verifiers): no package is fetched per episode."""
INDEX_FIELD = "verifiers_index"
"""A prompt's metadata field holding its row's position in the taskset."""


class VerifiersError(ValueError):
    """The verifiers environment cannot be loaded; the message says why."""


@dataclass(frozen=True, slots=True)
class VerifiersOutcome:
    """How an episode ended: its reward, or why it failed."""

    reward: float
    error: str = ""
    timed_out: bool = False


@cache
def _load(taskset: str, args_json: str, search_path: tuple[str, ...]) -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersError(
            f"environment.verifiers needs the verifiers package, 0.4.0 (rlmesh's `verifiers` "
            f"extra; `make setup` installs it): {exc}"
        ) from exc
    # The taskset's tool servers run as processes of their own, importing it from the job's folder.
    for folder in reversed(search_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([*search_path, *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        config = vf.resolve_env_config(
            {
                "taskset": {"id": taskset, **json.loads(args_json)},
                "agent": {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}},
            }
        )
        return vf.load_environment(config)
    except Exception as exc:  # noqa: BLE001 - whatever the user's taskset raises stops the job with its message
        raise VerifiersError(f"verifiers taskset {taskset!r}: {type(exc).__name__}: {exc}") from exc


def load_verifiers(taskset: str, args: Mapping[str, Any], search_path: Sequence[str] = ()) -> Any:
    """The verifiers environment of `taskset` (an importable module exporting one Taskset), its
    config fields from `args`; one per process."""
    return _load(taskset, json.dumps(dict(args), sort_keys=True), tuple(search_path))


def _prompt(index: int, data: Any) -> TaskPrompt:
    prompt = data.prompt
    metadata = {INDEX_FIELD: index}
    if isinstance(prompt, str) or prompt is None:
        return TaskPrompt(f"task-{index}", text=prompt or "", metadata=metadata)
    return TaskPrompt(
        f"task-{index}",
        messages=[m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt],
        metadata=metadata,
    )


class VerifiersSource(PromptSource):
    """The taskset's rows in a seeded order that changes every pass; `holdout` of them set aside
    (seeded) as the held-out prompts."""

    def __init__(self, environment: Any, holdout: int, seed: int) -> None:
        prompts = [_prompt(index, task.data) for index, task in enumerate(environment.taskset)]
        if holdout >= len(prompts):
            raise VerifiersError(f"eval.holdout {holdout} leaves no training rows of the taskset's {len(prompts)}")
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        held = set(order[:holdout])
        self._held_out = [p for i, p in enumerate(prompts) if i in held]
        self._prompts = [p for i, p in enumerate(prompts) if i not in held]
        self.seed = seed
        self._order: tuple[int, list[int]] = (-1, [])
        """The last pass's order of the training rows."""

    def prompt_at(self, position: int) -> TaskPrompt:
        epoch, index = divmod(position, len(self._prompts))
        if self._order[0] != epoch:
            order = list(range(len(self._prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._prompts[self._order[1][index]]

    def held_out(self, count: int) -> list[TaskPrompt]:
        return self._held_out[:count]


class VerifiersEpisodes:
    """Runs a verifiers environment's episodes in this process's event loop: its shared resources
    (tool servers, interception) start with the first episode and stop with `close`."""

    def __init__(self, environment: Any) -> None:
        self.environment = environment
        self.tasks = list(environment.taskset)
        self._serving: Any = None
        self._starting = asyncio.Lock()

    async def run(
        self, index: int, base_url: str, model: str, deadline_seconds: float, key: str = ""
    ) -> VerifiersOutcome:
        """One episode of row `index`, its model calls sent to `base_url` with the session's `key`."""
        import verifiers.v1 as vf

        await self._start()
        # verifiers sets the bearer key of its upstream calls from an environment variable, one for
        # the process: each episode's own key goes in the gateway's key header instead.
        client = vf.EvalClientConfig(
            base_url=base_url, api_key_var="RLMESH_VERIFIERS_NO_KEY", headers={KEY_HEADER: key} if key else {}
        )
        context = vf.ModelContext(model=model, client=client)
        (slot,) = self.environment.slots(self.tasks[index], 1)
        try:
            episode = await asyncio.wait_for(self.environment.run_slot(slot, context), deadline_seconds)
        finally:
            await self._forget_client(base_url)
        trace = episode.traces[-1] if episode.traces else None
        error = episode.last_error or (trace.last_error if trace is not None else None)
        if not episode.ok or trace is None or error is not None:
            return VerifiersOutcome(
                0.0, f"{error.type}: {error.message}" if error is not None else "the episode left no trace"
            )
        return VerifiersOutcome(trace.reward, timed_out=trace.is_timeout)

    async def _start(self) -> None:
        async with self._starting:
            if self._serving is None:
                # The clients verifiers makes trust what SSL_CERT_FILE names: with the mesh's TLS, the
                # gateway's CA beside the usual roots.
                os.environ.update(trust_environment())
                serving = self.environment.serving()
                await serving.__aenter__()
                self._serving = serving

    async def _forget_client(self, base_url: str) -> None:
        """Verifiers keeps a client per endpoint until it stops serving; each episode has its own
        base URL (its session), so its client goes when the episode does."""
        interception = getattr(self.environment, "_interception", None)
        for server in getattr(interception, "servers", ()):
            for key in [k for k in server.clients if base_url in k]:
                await server.clients.pop(key).close()

    async def close(self) -> None:
        if self._serving is not None:
            serving, self._serving = self._serving, None
            await serving.__aexit__(None, None, None)
