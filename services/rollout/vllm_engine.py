"""The rollout contract on vLLM's async engine (its engine core runs in a child process): streamed
tokens with logprobs of the distribution actually sampled from (vLLM's processed mode), abort, pause
and resume, and weight reload from what the weights service delivered. Needs the vLLM virtualenv."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from rlmesh.config import ConfigError
from rlmesh.errors import FailedPrecondition, InvalidArgument
from rlmesh.models.engine_fit import VLLM_CPU_HEAD_SIZES, vllm_cpu_refusal
from rlmesh.models.families import check_model_dir
from services.rollout.engine import (
    Chunk,
    Engine,
    EngineRequest,
    Finish,
    ParameterSpec,
    UpdateMode,
    check_pin,
    model_parameter_specs,
    validate_request,
)

if TYPE_CHECKING:
    from services.rollout.config import VllmConfig

log = structlog.get_logger()

_FINISH = {None: Finish.NONE, "stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


class WorkerExtension:
    """Methods vLLM mixes into its worker in the engine-core process (`worker_extension_cls`),
    called by name through `collective_rpc`."""

    def rlmesh_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        runner = self.model_runner
        model = runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if getattr(runner.model_config.hf_text_config, "tie_word_embeddings", False) and hasattr(
            lm_head, "quant_method"
        ):
            # A tied lm_head has no weights of its own, so the reload skips it; on CPU its GEMM
            # runs on a packed copy of the embedding made at load time, which would keep
            # producing logits from the old weights. Packing again reads the new embedding.
            lm_head.quant_method.process_weights_after_loading(lm_head)


@dataclass(slots=True)
class _Tracked:
    emitted: int = 0
    """Tokens handed out so far."""
    abort_again: bool = False
    """Abort asked for: repeated once at its next output, in case it came before vLLM knew the request."""
    pinned: bool = False
    """Must end on the served version: a reload waits for it."""


def _versions(starts: Sequence[tuple[str, int]], first: int, count: int, fallback: int) -> list[int]:
    """The versions of tokens first..first+count-1 from (version label, first token index) spans."""
    out = []
    for index in range(first, first + count):
        label = next((label for label, start in reversed(starts) if start <= index), None)
        out.append(int(label) if label is not None and label.isdigit() else fallback)
    return out


class VllmEngine(Engine):
    """Update modes on vLLM's own machinery: pause holds its scheduler (`pause_generation(mode="keep")`,
    requests keep their KV blocks); abort-continue preempts every running request after the reload
    (`reset_prefix_cache(reset_running_requests=True)`), so vLLM recomputes its KV from the prompt
    and output tokens under the new weights when scheduled again: still one request, one stream.
    A seeded request keeps its sampling generator across that recompute, so its draws stay
    reproducible but are not those of a fresh continuation (which reseeds, as the torch engine does).
    Pinned requests end before any reload: a commit waits for them (generating, even under a hold),
    and from staging on new ones are refused."""

    def __init__(
        self,
        model_dir: str | Path,
        max_batch_size: int,
        seed: int,
        config: VllmConfig,
        weight_version: int = 0,
        update_mode: UpdateMode = "continue",
    ) -> None:
        super().__init__(max_batch_size, weight_version, update_mode)
        check_model_dir(model_dir)
        # Refused before the instance registers (and before vLLM is imported): its engine core
        # would die on the first batch and every request sent to the instance fail.
        if not torch.cuda.is_available() and (refusal := vllm_cpu_refusal(model_dir)):
            raise ConfigError(refusal)
        # vLLM reads these at import and engine start: CPU KV cache, one thread per engine core
        # (tiny models decode much faster so).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # On CPU vLLM otherwise runs its model worker in a third process (the API's, the engine
        # core's, the worker's), each importing vLLM: some 15 CPU-seconds apiece. With one thread
        # the worker needs no OpenMP set-up of its own, so the engine core hosts it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.model_dir = str(model_dir)
        self.config = config
        self._seed = seed
        self._salt_version = weight_version
        """The version new requests will be scheduled on (ahead of `_version` during a switch)."""
        self._staged: int | None = None
        self._staging_dir = Path(tempfile.mkdtemp(prefix="rlmesh-vllm-weights-"))
        """vLLM's engine core runs in its own process: staged weights reach it as a safetensors file."""
        self._specs = model_parameter_specs(model_dir)
        self._tracked: dict[str, _Tracked] = {}
        self._pinned_ended = asyncio.Event()
        """Set whenever a pinned request ends: a commit waiting for them looks again."""
        self._switch = asyncio.Lock()
        self._llm = None
        self._dead = False
        """vLLM's engine core died: no request can run any more."""
        self._vocab_size = 0
        self._max_len = 0

    @property
    def running_requests(self) -> int:
        return len(self._tracked)

    def parameter_specs(self) -> list[ParameterSpec]:
        return self._specs

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.engine.async_llm import AsyncLLM

        # The list the refusal (here and in `rlmesh up`) checks against must be this vLLM's.
        supported = tuple(CPUAttentionBackend.get_supported_head_sizes())
        if current_platform.is_cpu() and supported != VLLM_CPU_HEAD_SIZES:
            raise ConfigError(
                f"this vLLM's CPU attention takes head sizes {supported}, rlmesh.models.engine_fit lists "
                f"{VLLM_CPU_HEAD_SIZES}: update VLLM_CPU_HEAD_SIZES"
            )

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
            worker_extension_cls=f"{__name__}.WorkerExtension",
        )
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        # The engine core stamps every step's output with this label; it changes only while
        # generation is paused, so each token's version is exactly the weights that produced it.
        await self._llm.update_weight_version(str(self._version))
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
        if self._dead:
            raise FailedPrecondition("engine failed: vLLM's engine core died; this instance is leaving the pool")
        validate_request(request, self._vocab_size, self._max_len)
        sampling = request.sampling
        if sampling.top_p < 1:
            # vLLM's processed logprobs are taken after top-p truncation and renormalisation;
            # the contract (and the trainer's ratio) needs them before it.
            raise InvalidArgument(
                f"request {request.request_id}: top_p {sampling.top_p} is not supported by the vLLM engine "
                "(its logprobs would be of the truncated distribution); use top_p = 1"
            )
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=request.remaining_tokens,
            stop_token_ids=sorted(sampling.stop_token_ids),
            # The contract stops on stop_token_ids only, as the torch engine does.
            ignore_eos=True,
            seed=(sampling.seed + len(request.continued_token_ids)) if sampling.seed else None,
            logprobs=0,
            # vLLM matches stop strings on its detokenized text (special tokens skipped, as the
            # torch engine does); the response's tokens stay as sampled, the text is not used.
            stop=list(sampling.stop) or None,
            detokenize=bool(sampling.stop),
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = request.request_id
        if request_id in self._tracked:
            raise FailedPrecondition(f"request {request_id} is already running")
        check_pin(
            request,
            self._version,
            (self._staged is not None or self._switch.locked() or self._held)
            and not any(t.pinned for t in self._tracked.values()),
        )
        tracked = _Tracked(pinned=request.pinned_version is not None)
        self._tracked[request_id] = tracked
        finish = Finish.NONE
        try:
            prompt = TokensPrompt(
                prompt_token_ids=request.prompt_token_ids + request.continued_token_ids,
                # Prefix-cache blocks computed by one version are never hit by requests of
                # another: the cache cannot be reset while requests hold blocks (a switch
                # mid-generation), and a stale block would silently feed old-weight KV.
                cache_salt=f"rlmesh-v{self._salt_version}",
            )
            async for output in self._outputs(prompt, params, request_id):
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                logprobs = [
                    float(position[token].logprob) for position, token in zip(completion.logprobs or [], tokens)
                ]
                finish = _FINISH.get(completion.finish_reason, Finish.STOP)
                if tracked.abort_again and finish is Finish.NONE:
                    tracked.abort_again = False
                    await self._llm.abort(request_id)
                if not tokens and finish is Finish.NONE:
                    continue
                versions = _versions(
                    self._version_starts(request_id, completion), tracked.emitted, len(tokens), self._version
                )
                tracked.emitted += len(tokens)
                self._generated += len(tokens)
                yield Chunk(request_id, tokens, logprobs, versions, finish)
                if finish is not Finish.NONE:
                    return
            if finish is Finish.NONE:
                yield Chunk(request_id, finish=Finish.ABORT)
        finally:
            self._tracked.pop(request_id, None)
            if tracked.pinned:
                self._pinned_ended.set()
            if finish is Finish.NONE and self._llm is not None:
                await self._llm.abort(request_id)

    async def _outputs(self, prompt, params, request_id: str) -> AsyncIterator:
        """vLLM's outputs of one request. An engine core that died fails the request with a
        clear error and, once, tells the instance, which then leaves the pool and exits so that
        its supervisor starts it again: a dead core answers every later request the same way."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for output in self._llm.generate(prompt, params, request_id):
                yield output
        except EngineDeadError as exc:
            reason = f"vLLM's engine core died ({exc})"
            if not self._dead:
                self._dead = True
                log.error("engine failed", reason=reason)
                if self.on_failure is not None:
                    self.on_failure(reason)
            raise FailedPrecondition(f"engine failed: {reason}") from exc

    def _version_starts(self, request_id: str, completion) -> Sequence[tuple[str, int]]:
        """vLLM's (version label, first token index) spans of a request's tokens: on its last
        output, the finished spans; before, the running state's, which covers exactly the tokens
        delivered so far (the consumer gets every output the processor produced until now)."""
        if completion.weight_versions is not None:
            return [(span.version, span.start) for span in completion.weight_versions]
        processor = self._llm.output_processor
        for internal_id in processor.external_req_ids.get(request_id, ()):
            state = processor.request_states.get(internal_id)
            if state is not None:
                return state.weight_version_starts
        return []

    def abort(self, request_ids: list[str] | None = None) -> int:
        targets = list(self._tracked) if request_ids is None else [r for r in request_ids if r in self._tracked]
        for request_id in targets:
            self._tracked[request_id].abort_again = True
        if targets and self._llm is not None:
            task = asyncio.ensure_future(self._llm.abort(targets))
            task.add_done_callback(lambda t: t.exception() and log.error("vllm abort failed", error=str(t.exception())))
        return len(targets)

    async def pause(self) -> None:
        if not self._held:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        if not self._held:
            await self._llm.resume_generation()
        self._paused = False

    async def hold_for_update(self) -> None:
        # vLLM's scheduler has one pause state: the hold and `pause` share it.
        async with self._switch:
            if not (self._paused or self._held):
                await self._llm.pause_generation(mode="keep", clear_cache=False)
            self._held = True

    async def release_update_hold(self) -> None:
        async with self._switch:
            if self._held and not self._paused:
                await self._llm.resume_generation()
            self._held = False

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if version <= self._version:
            raise FailedPrecondition(f"version {version} is not newer than the served version {self._version}")
        self._staged = None
        save_file(
            {name: tensor.contiguous() for name, tensor in tensors.items()},
            str(self._staging_dir / "model.safetensors"),
        )
        self._staged = version

    async def commit_staged(self, version: int) -> None:
        if self._staged != version:
            raise FailedPrecondition(f"version {version} is not staged (staged: {self._staged})")
        async with self._switch:
            await self._let_pinned_requests_end()
            was_paused = self._paused or self._held
            if not was_paused:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
            # Requests arriving from here on are first scheduled on the new weights.
            self._salt_version = version
            try:
                await self._llm.collective_rpc("rlmesh_reload_weights", kwargs={"weights_path": str(self._staging_dir)})
                await self._llm.update_weight_version(str(version))
                # Frees the old version's cached blocks early. Without abort-continue it fails
                # (harmlessly: the cache salt keeps them from being hit) while paused requests
                # still hold blocks; with it, those requests are preempted to be recomputed.
                await self._llm.reset_prefix_cache(reset_running_requests=self.update_mode == "abort-continue")
                self._version = version
                self._staged = None
            except BaseException:
                self._salt_version = self._version
                raise
            finally:
                if not was_paused:
                    await self._llm.resume_generation()
        log.info("weights switched", weight_version=version)

    async def _let_pinned_requests_end(self) -> None:
        """Waits until no pinned request runs (new ones are refused once a version is staged, unless
        pinned ones of the served version already run: a validation's requests join one hold). A
        hold for this update would keep them from ending, so it is lifted meanwhile; a pause
        someone asked for is not."""
        if not any(t.pinned for t in self._tracked.values()):
            return
        lift_hold = self._held and not self._paused
        if lift_hold:
            await self._llm.resume_generation()
        try:
            while any(t.pinned for t in self._tracked.values()):
                self._pinned_ended.clear()
                await self._pinned_ended.wait()
        finally:
            if lift_hold:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
