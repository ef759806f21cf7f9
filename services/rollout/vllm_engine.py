"""The rollout contract on vLLM's async engine, run in-process: streamed tokens with logprobs of
the distribution actually sampled from (vLLM's processed mode), abort, pause and resume, and
weight reload from what the weights service delivered. Needs the vLLM virtualenv."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from rlmesh.errors import FailedPrecondition
from services.rollout.engine import Chunk, Engine, EngineRequest, Finish, ParameterSpec, model_parameter_specs, validate_request

if TYPE_CHECKING:
    from services.rollout.config import VllmConfig

log = structlog.get_logger()

_FINISH = {None: Finish.NONE, "stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


@dataclass(slots=True)
class _Tracked:
    """Which weight version produced which of a request's tokens: (first token index, version)
    marks, one per switch while it ran."""

    marks: list[tuple[int, int]]
    emitted: int = 0
    versions: list[int] = field(default_factory=list)

    def versions_for(self, count: int) -> list[int]:
        out = []
        for index in range(self.emitted, self.emitted + count):
            out.append(next(v for start, v in reversed(self.marks) if start <= index))
        self.emitted += count
        return out


class VllmEngine(Engine):
    def __init__(self, model_dir: str | Path, max_batch_size: int, seed: int, config: VllmConfig, weight_version: int = 0) -> None:
        # vLLM reads these at import and engine start: one in-process engine core, CPU KV cache.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.model_dir = str(model_dir)
        self.config = config
        self._max_batch = max_batch_size
        self._seed = seed
        self._version = weight_version
        self._staged: int | None = None
        self._staging_dir = Path(tempfile.mkdtemp(prefix="rlmesh-vllm-weights-"))
        """vLLM's engine core runs in its own process: staged weights reach it as a safetensors file."""
        self._specs = model_parameter_specs(model_dir)
        self._tracked: dict[str, _Tracked] = {}
        self._generated = 0
        self._paused = False
        self._switch = asyncio.Lock()
        self._llm = None
        self._vocab_size = 0
        self._max_len = 0

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def running_requests(self) -> int:
        return len(self._tracked)

    @property
    def generated_tokens(self) -> int:
        return self._generated

    @property
    def paused(self) -> bool:
        return self._paused

    def parameter_specs(self) -> list[ParameterSpec]:
        return self._specs

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_dir,
            dtype=self.config.dtype,
            seed=self._seed,
            max_num_seqs=self._max_batch,
            max_model_len=self.config.max_model_len or None,
            enforce_eager=True,
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        model_config = self._llm.model_config
        self._vocab_size = model_config.get_vocab_size()
        self._max_len = model_config.max_model_len
        log.info("vllm engine ready", model=self.model_dir, dtype=self.config.dtype, max_model_len=self._max_len)

    async def stop(self) -> None:
        if self._llm is not None:
            self.abort()
            self._llm.shutdown()
            self._llm = None
        shutil.rmtree(self._staging_dir, ignore_errors=True)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise FailedPrecondition("engine is not running")
        validate_request(request, self._vocab_size, self._max_len)
        sampling = request.sampling
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=request.remaining_tokens,
            stop_token_ids=sorted(sampling.stop_token_ids),
            # The contract stops on stop_token_ids only, as the torch engine does.
            ignore_eos=True,
            seed=(sampling.seed + len(request.continued_token_ids)) if sampling.seed else None,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = request.request_id
        if request_id in self._tracked:
            raise FailedPrecondition(f"request {request_id} is already running")
        tracked = _Tracked(marks=[(0, self._version)])
        self._tracked[request_id] = tracked
        finish = Finish.NONE
        try:
            prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids + request.continued_token_ids)
            async for output in self._llm.generate(prompt, params, request_id):
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs or [], tokens)]
                finish = _FINISH.get(completion.finish_reason, Finish.STOP)
                if not tokens and finish is Finish.NONE:
                    continue
                self._generated += len(tokens)
                yield Chunk(request_id, tokens, logprobs, tracked.versions_for(len(tokens)), finish)
                if finish is not Finish.NONE:
                    return
            if finish is Finish.NONE:
                yield Chunk(request_id, finish=Finish.ABORT)
        finally:
            self._tracked.pop(request_id, None)
            if finish is Finish.NONE and self._llm is not None:
                await self._llm.abort(request_id)

    def abort(self, request_ids: list[str] | None = None) -> int:
        targets = list(self._tracked) if request_ids is None else [r for r in request_ids if r in self._tracked]
        if targets and self._llm is not None:
            task = asyncio.ensure_future(self._llm.abort(targets))
            task.add_done_callback(lambda t: t.exception() and log.error("vllm abort failed", error=str(t.exception())))
        return len(targets)

    async def pause(self) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        await self._llm.resume_generation()
        self._paused = False

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if version <= self._version:
            raise FailedPrecondition(f"version {version} is not newer than the served version {self._version}")
        self._staged = None
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(self._staging_dir / "model.safetensors"))
        self._staged = version

    async def commit_staged(self, version: int) -> None:
        if self._staged != version:
            raise FailedPrecondition(f"version {version} is not staged (staged: {self._staged})")
        async with self._switch:
            was_paused = self._paused
            if not was_paused:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                self._mark_switch(version)
                await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging_dir)})
                # Cached prefixes were computed by the old weights.
                await self._llm.reset_prefix_cache()
                self._version = version
                self._staged = None
            finally:
                if not was_paused:
                    await self._llm.resume_generation()
        log.info("weights switched", weight_version=version)

    def _mark_switch(self, version: int) -> None:
        """With decoding paused, every token a request has produced so far, delivered to us or
        still waiting in vLLM's output collector, came from the old weights."""
        pending: dict[str, int] = {}
        for state in self._llm.output_processor.request_states.values():
            queued = state.queue.output if state.queue is not None else None
            outputs = getattr(queued, "outputs", None)
            pending[state.external_req_id] = len(outputs[0].token_ids) if outputs else 0
        for request_id, tracked in self._tracked.items():
            tracked.marks.append((tracked.emitted + pending.get(request_id, 0), version))
