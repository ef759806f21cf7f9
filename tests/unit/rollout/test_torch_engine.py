"""The torch engine on a real model: agreement with HF greedy decoding and with the trainer's
log-probabilities, continuous batching, continuation, stop and length handling, chunks of several
tokens (stream_interval), abort, pause and resume, the weight switch between decode steps and what
running requests do at it (update modes), requests pinned to a version, which hold the switch
back until they end, and background requests, decoded at the lowest CPU priority while alone."""

import asyncio
import os
import threading
import time

import pytest
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import Aborted, FailedPrecondition, InvalidArgument
from rlmesh.lifecycle import CAP_SYS_ADMIN, SessionPriority, effective_capabilities
from rlmesh.models.loading import load_causal_lm, trainable_tensors
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from rlmesh.transfer.payload import pack, stream_chunks
from services.rollout.engine import EngineRequest, Finish, Sampling
from services.rollout.torch.engine import TorchEngine
from services.rollout.weight_update import WeightUpdater
from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from tests.support.engines import engine_output
from tests.support.waiting import wait_for


@pytest.fixture
async def engine(model_dir):
    engine = TorchEngine(model_dir, max_batch_size=32, seed=1)
    await engine.start()
    yield engine
    await engine.stop()


def prompts(model_dir, texts):
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.encode(t).ids for t in texts], tokenizer.token_to_id(EOS_TOKEN)


def hold_decoding(engine, after_tokens: int, acted: threading.Event) -> None:
    """Once the engine generated `after_tokens` tokens, its decode steps wait until the test sets
    `acted`. The decode thread outruns a loaded event loop: a test that acts on a running request
    from the loop must find it still running."""
    run = engine._group.run

    def held(op, *args):
        if op == "decode" and engine.generated_tokens >= after_tokens:
            assert acted.wait(10), "the test never acted on the held request"
        return run(op, *args)

    engine._group.run = held


async def test_greedy_batch_matches_hf_generate(engine, model_dir):
    ids, eos = prompts(model_dir, ["1234=", "98765432=", "50="])
    results = await asyncio.gather(
        *[
            engine_output(
                engine,
                EngineRequest(f"r{i}", p, Sampling(temperature=0, max_tokens=10, stop_token_ids=frozenset({eos}))),
            )
            for i, p in enumerate(ids)
        ]
    )
    model = load_causal_lm(model_dir)
    for prompt, (tokens, _, _, finish) in zip(ids, results):
        expected = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=eos,
            pad_token_id=load_tokenizer(model_dir).token_to_id(PAD_TOKEN),
        )[0, len(prompt) :].tolist()
        assert tokens == expected[: len(tokens)]
        assert finish is (Finish.STOP if tokens[-1] == eos else Finish.LENGTH)


async def test_sampling_logprobs_match_the_trainer(engine, model_dir):
    ids, eos = prompts(model_dir, ["31415=", "2718="])
    results = await asyncio.gather(
        *[
            engine_output(
                engine,
                EngineRequest(f"s{i}", p, Sampling(temperature=0.7, max_tokens=8, stop_token_ids=frozenset({eos}))),
            )
            for i, p in enumerate(ids)
        ]
    )
    samples = [TrainingSample(p, r[0], r[1], 0.0) for p, r in zip(ids, results)]
    batch = build_micro_batch(samples, pad_id=0)
    with torch.no_grad():
        trainer_logprobs = token_logprobs(load_causal_lm(model_dir), batch, temperature=0.7)
    mask = batch.response_mask.bool()
    assert torch.allclose(trainer_logprobs[mask], batch.behaviour_logprobs[mask], atol=1e-4)


async def test_length_limit_and_abort(engine, model_dir):
    ids, _ = prompts(model_dir, ["1111="])
    tokens, logprobs, versions, finish = await engine_output(
        engine, EngineRequest("len", ids[0], Sampling(temperature=1.0, max_tokens=3))
    )
    assert len(tokens) == len(logprobs) == len(versions) == 3 and finish is Finish.LENGTH

    async def abort_soon():
        while engine.running_requests == 0:
            await asyncio.sleep(0.001)
        count = engine.abort(["long"])
        aborted.set()
        return count

    aborted = threading.Event()
    hold_decoding(engine, engine.generated_tokens + 1, aborted)
    long_request = EngineRequest("long", ids[0], Sampling(temperature=1.0, max_tokens=50))
    (tokens, _, _, finish), _ = await asyncio.gather(engine_output(engine, long_request), abort_soon())
    assert finish is Finish.ABORT and len(tokens) < 50


async def test_bad_requests_are_refused(engine, model_dir):
    with pytest.raises(InvalidArgument, match="empty"):
        await engine_output(engine, EngineRequest("x", [], Sampling()))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        await engine_output(engine, EngineRequest("x", [10_000], Sampling()))
    with pytest.raises(InvalidArgument, match="positions"):
        await engine_output(engine, EngineRequest("x", [1], Sampling(max_tokens=10_000)))


async def test_weights_switch_between_decode_steps(engine, model_dir):
    ids, _ = prompts(model_dir, ["123="])
    new_weights = {name: torch.zeros_like(t) for name, t in trainable_tensors(load_causal_lm(model_dir)).items()}
    with pytest.raises(FailedPrecondition):
        await engine.commit_staged(1)
    await asyncio.to_thread(engine.stage_weights, 1, new_weights)
    assert engine.weight_version == 0
    await engine.commit_staged(1)
    assert engine.weight_version == 1
    tokens, logprobs, versions, _ = await engine_output(
        engine, EngineRequest("after", ids[0], Sampling(temperature=0, max_tokens=4))
    )
    assert versions == [1, 1, 1, 1]
    # All-zero weights give uniform logits: every token has probability 1/vocab.
    assert logprobs[0] == pytest.approx(
        -torch.log(torch.tensor(float(len(new_weights["model.embed_tokens.weight"])))).item(), abs=1e-5
    )
    with pytest.raises(FailedPrecondition, match="not newer"):
        engine.stage_weights(1, new_weights)


async def test_a_request_running_during_a_switch_reports_both_versions(engine, model_dir):
    ids, _ = prompts(model_dir, ["5555="])
    weights = trainable_tensors(load_causal_lm(model_dir))
    await asyncio.to_thread(engine.stage_weights, 1, weights)
    # Without the hold, a loaded machine once decoded all 40 tokens before the commit was asked for.
    committing = threading.Event()
    hold_decoding(engine, 3, committing)
    request = EngineRequest("during", ids[0], Sampling(temperature=1.0, max_tokens=40))
    versions = []
    async for chunk in engine.generate(request):
        versions += chunk.weight_versions
        if len(versions) >= 3 and not committing.is_set():
            commit = asyncio.create_task(engine.commit_staged(1))
            await asyncio.sleep(0)  # the commit asks for the switch in its first step; then decoding goes on
            committing.set()
            await commit
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)


async def test_a_short_request_joining_late_finishes_before_the_long_one(engine, model_dir):
    ids, _ = prompts(model_dir, ["123=", "4="])
    order: list[str] = []

    async def run(request_id, prompt, max_tokens):
        tokens, _, _, finish = await engine_output(
            engine, EngineRequest(request_id, prompt, Sampling(temperature=1.0, max_tokens=max_tokens))
        )
        order.append(request_id)
        return tokens, finish

    long_task = asyncio.create_task(run("long", ids[0], 55))
    while engine.generated_tokens < 2:
        await asyncio.sleep(0.001)
    seen = 0
    async for chunk in engine.generate(EngineRequest("probe", ids[1], Sampling(temperature=1.0, max_tokens=3))):
        seen += len(chunk.token_ids)
    # The probe joined a batch already decoding "long" and left it after 3 tokens.
    assert seen == 3 and not long_task.done()
    tokens, finish = await long_task
    assert len(tokens) == 55 and finish is Finish.LENGTH


async def test_greedy_tokens_do_not_depend_on_batch_mates(engine, model_dir):
    ids, _ = prompts(model_dir, ["2468=", "13579135=", "7="])
    alone = await engine_output(engine, EngineRequest("alone", ids[0], Sampling(temperature=0, max_tokens=12)))

    async def joins_later():
        await asyncio.sleep(0.01)
        return await engine_output(engine, EngineRequest("late", ids[0], Sampling(temperature=0, max_tokens=12)))

    results = await asyncio.gather(
        engine_output(engine, EngineRequest("mate1", ids[1], Sampling(temperature=1.0, max_tokens=50))),
        joins_later(),
        engine_output(engine, EngineRequest("mate2", ids[2], Sampling(temperature=1.0, max_tokens=30))),
    )
    late = results[1]
    assert late[0] == alone[0]
    assert late[1] == pytest.approx(alone[1], abs=1e-4)


async def test_continuation_picks_up_where_the_first_attempt_stopped(engine, model_dir):
    ids, _ = prompts(model_dir, ["86420="])
    whole, whole_logprobs, _, finish = await engine_output(
        engine, EngineRequest("whole", ids[0], Sampling(temperature=0, max_tokens=10))
    )
    assert finish is Finish.LENGTH
    rest, rest_logprobs, _, finish = await engine_output(
        engine, EngineRequest("rest", ids[0], Sampling(temperature=0, max_tokens=10), continued_token_ids=whole[:4])
    )
    assert finish is Finish.LENGTH
    assert rest == whole[4:]
    assert rest_logprobs == pytest.approx(whole_logprobs[4:], abs=1e-4)
    with pytest.raises(InvalidArgument, match="nothing to generate"):
        await engine_output(
            engine, EngineRequest("none", ids[0], Sampling(max_tokens=4), continued_token_ids=whole[:4])
        )


async def test_abort_one_leaves_the_others_running(engine, model_dir):
    ids, _ = prompts(model_dir, ["111=", "222="])
    victim = asyncio.create_task(
        engine_output(engine, EngineRequest("victim", ids[0], Sampling(temperature=1.0, max_tokens=55)))
    )
    aborted = threading.Event()
    hold_decoding(engine, 10, aborted)
    survivor = asyncio.create_task(
        engine_output(engine, EngineRequest("survivor", ids[1], Sampling(temperature=1.0, max_tokens=50)))
    )
    while engine.generated_tokens < 10:
        await asyncio.sleep(0.001)
    assert engine.abort(["victim", "unknown"]) == 1
    aborted.set()
    tokens, logprobs, versions, finish = await victim
    assert finish is Finish.ABORT and 0 < len(tokens) < 55 and len(tokens) == len(logprobs) == len(versions)
    tokens, _, _, finish = await survivor
    assert finish is Finish.LENGTH and len(tokens) == 50


async def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks_and_an_abort_loses_none(model_dir):
    ids, _ = prompts(model_dir, ["4321="])
    seeded = Sampling(temperature=1.0, max_tokens=11, seed=7)

    async def chunks(engine, request):
        return [chunk async for chunk in engine.generate(request)]

    by_interval = {}
    for interval in (1, 4):
        engine = TorchEngine(model_dir, max_batch_size=8, seed=1, stream_interval=interval)
        await engine.start()
        try:
            by_interval[interval] = await chunks(engine, EngineRequest(f"s{interval}", ids[0], seeded))
            aborted = asyncio.create_task(
                chunks(engine, EngineRequest("cut", ids[0], Sampling(temperature=1.0, max_tokens=50)))
            )
            while engine.generated_tokens < 11 + 6 and not aborted.done():
                await asyncio.sleep(0.001)
            engine.abort(["cut"])
            cut = await aborted
            # Every token the engine decoded for the request reaches the caller, streamed or not.
            assert sum(len(c.token_ids) for c in cut) == engine.generated_tokens - 11
            assert cut[-1].finish is Finish.ABORT
        finally:
            await engine.stop()
    one, four = by_interval[1], by_interval[4]
    assert [t for c in four for t in c.token_ids] == [t for c in one for t in c.token_ids]
    assert [x for c in four for x in c.logprobs] == pytest.approx([x for c in one for x in c.logprobs])
    # Chunks the caller was too busy to take leave merged, so at least the interval but the last.
    assert all(len(c.token_ids) >= 4 for c in four[:-1]) and len(four) <= 3
    with pytest.raises(ValueError, match="stream_interval"):
        TorchEngine(model_dir, stream_interval=0)


async def test_pause_holds_every_request_and_resume_finishes_them(engine, model_dir):
    ids, _ = prompts(model_dir, ["31=", "4159=", "26="])
    tasks = [
        asyncio.create_task(engine_output(engine, EngineRequest(f"p{i}", p, Sampling(temperature=1.0, max_tokens=50))))
        for i, p in enumerate(ids)
    ]
    while engine.generated_tokens < 6:
        await asyncio.sleep(0.001)
    await engine.pause()
    assert engine.paused
    frozen = engine.generated_tokens
    late = asyncio.create_task(
        engine_output(engine, EngineRequest("late", ids[0], Sampling(temperature=1.0, max_tokens=5)))
    )
    await asyncio.sleep(0.3)
    assert engine.generated_tokens == frozen and not any(t.done() for t in tasks + [late])
    await engine.resume()
    results = await asyncio.gather(*tasks, late)
    assert [len(r[0]) for r in results] == [50, 50, 50, 5]
    assert all(r[3] is Finish.LENGTH for r in results)


async def test_abort_all_while_paused_returns_partial_tokens(engine, model_dir):
    ids, _ = prompts(model_dir, ["9="])
    task = asyncio.create_task(
        engine_output(engine, EngineRequest("held", ids[0], Sampling(temperature=1.0, max_tokens=55)))
    )
    while engine.generated_tokens < 5:
        await asyncio.sleep(0.001)
    await engine.pause()
    assert engine.abort() == 1
    tokens, _, _, finish = await task
    assert finish is Finish.ABORT and len(tokens) >= 5
    await engine.resume()


# Update modes: what a request running across a weight push does. ---------------------------------


def record_steps(engine, decode_seconds=0.0):
    """Records every step operation the engine runs on its model and KV cache; `decode_seconds`
    slows each decode step, so a request reliably spans a push."""
    steps = []
    run = engine._group.run

    def recording(op, *args):
        steps.append((op, args))
        if op == "decode":
            time.sleep(decode_seconds)
        return run(op, *args)

    engine._group.run = recording
    return steps


def recomputed_contexts(steps):
    """The token rows of every prefill recorded (each one a prompt and the tokens before it)."""
    return [row.tolist() for op, args in steps if op == "prefill" for row in args[0]]


@pytest.fixture
def new_weights(model_dir):
    return {name: tensor * 0.5 for name, tensor in trainable_tensors(load_causal_lm(model_dir)).items()}


@pytest.fixture
async def mode_engine(model_dir, request):
    """An engine in the update mode the test is parametrised with, and its weight updater (gRPC chunks)."""
    engine = TorchEngine(model_dir, max_batch_size=8, seed=1, update_mode=request.param)
    # Long enough that a loaded machine still checks the hold within it.
    updater = WeightUpdater(engine, engine.ranks, frozenset({"grpc"}), pause_limit=1.0)
    await engine.start()
    yield engine, updater
    await engine.stop()
    updater.close()


async def begin_push(updater, version, tensors, corrupt=False):
    manifest, payload = pack(tensors, version)
    await updater.begin(manifest, [], "grpc")
    if corrupt:
        payload[10] ^= 0xFF
    for offset, data in stream_chunks(payload, manifest.total_bytes):
        await updater.receive(0, version, offset, data, common_pb2.COMPRESSION_NONE, 0, -1)


async def wait_for_tokens(engine, count, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.generated_tokens < count:
        assert time.monotonic() < deadline, f"{engine.generated_tokens} tokens generated, waited for {count}"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("mode_engine", ["continue"], indirect=True)
async def test_continue_mode_decodes_through_the_push_and_keeps_the_kv_cache(mode_engine, model_dir, new_weights):
    engine, updater = mode_engine
    steps = record_steps(engine, decode_seconds=0.01)
    ids, _ = prompts(model_dir, ["5555="])
    task = asyncio.create_task(
        engine_output(engine, EngineRequest("spanning", ids[0], Sampling(temperature=1.0, max_tokens=50)))
    )
    await wait_for_tokens(engine, 3)
    await begin_push(updater, 1, new_weights)
    await wait_for_tokens(engine, engine.generated_tokens + 2)
    steps.clear()
    await updater.commit(1)
    tokens, _, versions, finish = await task
    assert finish is Finish.LENGTH and len(tokens) == 50
    assert 0 in versions and 1 in versions and versions == sorted(versions)
    assert recomputed_contexts(steps) == []


@pytest.mark.parametrize("mode_engine", ["pause"], indirect=True)
async def test_pause_mode_holds_every_step_from_the_push_begin_to_its_commit(mode_engine, model_dir, new_weights):
    engine, updater = mode_engine
    steps = record_steps(engine, decode_seconds=0.01)
    ids, _ = prompts(model_dir, ["5555=", "77="])
    held = asyncio.create_task(
        engine_output(engine, EngineRequest("held", ids[0], Sampling(temperature=1.0, max_tokens=50)))
    )
    await wait_for_tokens(engine, 3)
    manifest, payload = pack(new_weights, 1)
    await updater.begin(manifest, [], "grpc")
    before = engine.generated_tokens
    late = asyncio.create_task(
        engine_output(engine, EngineRequest("late", ids[1], Sampling(temperature=1.0, max_tokens=5)))
    )
    for offset, data in stream_chunks(payload, manifest.total_bytes):
        await updater.receive(0, 1, offset, data, common_pb2.COMPRESSION_NONE, 0, -1)
    await asyncio.sleep(0.2)
    assert engine.generated_tokens == before and not late.done()
    assert engine.held_for_update and not engine.paused
    steps.clear()
    await updater.commit(1)
    tokens, _, versions, finish = await held
    late_tokens, _, late_versions, _ = await late
    assert finish is Finish.LENGTH and len(tokens) == 50
    assert versions == [0] * before + [1] * (50 - before)
    # The request that arrived during the hold was queued, then generated on the new weights.
    assert len(late_tokens) == 5 and late_versions == [1] * 5
    # The held request kept its KV cache: the only prefill after the switch is the late prompt.
    assert recomputed_contexts(steps) == [ids[1]] and "clear" not in [op for op, _ in steps]
    assert not engine.held_for_update


@pytest.mark.parametrize("mode_engine", ["pause"], indirect=True)
async def test_a_failed_or_abandoned_push_in_pause_mode_resumes_on_the_old_version(mode_engine, model_dir, new_weights):
    engine, updater = mode_engine
    record_steps(engine, decode_seconds=0.01)
    ids, _ = prompts(model_dir, ["9="])
    task = asyncio.create_task(
        engine_output(engine, EngineRequest("survivor", ids[0], Sampling(temperature=1.0, max_tokens=50)))
    )
    await wait_for_tokens(engine, 3)
    await begin_push(updater, 1, new_weights, corrupt=True)
    assert engine.held_for_update
    with pytest.raises(FailedPrecondition, match="crc32"):
        await updater.commit(1)
    assert not engine.held_for_update
    await wait_for_tokens(engine, engine.generated_tokens + 2)
    # A push begun and then never committed: its sender is gone. The hold ends at the pause limit.
    await begin_push(updater, 1, new_weights)
    before = engine.generated_tokens
    await asyncio.sleep(0.15)
    assert engine.held_for_update and engine.generated_tokens == before
    await wait_for_tokens(engine, before + 2, timeout=4.0)
    assert not engine.held_for_update
    tokens, _, versions, finish = await task
    assert finish is Finish.LENGTH and len(tokens) == 50 and versions == [0] * 50
    assert engine.weight_version == 0


@pytest.mark.parametrize("mode_engine", ["abort-continue"], indirect=True)
async def test_abort_continue_recomputes_a_running_request_on_the_new_weights(mode_engine, model_dir, new_weights):
    engine, _ = mode_engine
    steps = record_steps(engine, decode_seconds=0.01)
    ids, _ = prompts(model_dir, ["5555="])
    await asyncio.to_thread(engine.stage_weights, 1, new_weights)
    sampling = Sampling(temperature=1.0, max_tokens=40, seed=7)
    tokens, logprobs, versions, finish = [], [], [], None
    async for chunk in engine.generate(EngineRequest("spanning", ids[0], sampling)):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        finish = chunk.finish
        if len(tokens) >= 3 and engine.weight_version == 0:
            steps.clear()
            await engine.commit_staged(1)
    switch = versions.index(1)
    assert finish is Finish.LENGTH and len(tokens) == 40
    assert versions == [0] * switch + [1] * (40 - switch)
    # Its KV cache was dropped and rebuilt from the prompt and every token it had.
    assert "clear" in [op for op, _ in steps]
    assert recomputed_contexts(steps) == [ids[0] + tokens[:switch]]
    # Seeded, it drew what a fresh request continued from those tokens on the new weights draws.
    fresh, fresh_logprobs, fresh_versions, _ = await engine_output(
        engine, EngineRequest("fresh", ids[0], sampling, continued_token_ids=tokens[:switch])
    )
    assert fresh == tokens[switch:] and fresh_versions == [1] * len(fresh)
    assert fresh_logprobs == pytest.approx(logprobs[switch:], abs=1e-4)


# Pinned requests: every token from exactly one version. --------------------------------------------


@pytest.mark.parametrize("mode_engine", ["continue", "pause", "abort-continue"], indirect=True)
async def test_a_pinned_request_spanning_a_commit_ends_on_its_version_and_the_switch_follows_at_once(
    mode_engine, model_dir, new_weights
):
    engine, updater = mode_engine
    steps = record_steps(engine, decode_seconds=0.01)
    ids, _ = prompts(model_dir, ["5555=", "77="])
    pinned = asyncio.create_task(
        engine_output(
            engine, EngineRequest("pinned", ids[0], Sampling(temperature=1.0, max_tokens=40), pinned_version=0)
        )
    )
    await wait_for_tokens(engine, 3)
    mate = asyncio.create_task(
        engine_output(engine, EngineRequest("mate", ids[1], Sampling(temperature=1.0, max_tokens=60)))
    )
    await begin_push(updater, 1, new_weights)
    commit = asyncio.create_task(updater.commit(1))
    await wait_for(lambda: engine._swap is not None, 10, "the switch to be held back", interval=0.001)
    # While pinned requests hold the switch back, another of their version joins the hold: a
    # validation's requests all run on its version.
    _, _, late_versions, _ = await engine_output(
        engine, EngineRequest("late", ids[1], Sampling(max_tokens=4), pinned_version=0)
    )
    assert late_versions == [0] * 4
    before = engine.generated_tokens
    await wait_for_tokens(engine, before + 4)
    # Held back, not halted: the pinned request goes on decoding (in pause mode too) while the commit waits.
    assert not commit.done() and not pinned.done() and engine.weight_version == 0
    tokens, _, versions, finish = await pinned
    await commit
    assert finish is Finish.LENGTH and len(tokens) == 40 and versions == [0] * 40
    ops = [op for op, _ in steps]
    # The step after the pinned request left the batch switched.
    assert ops[ops.index("switch") - 1] == "keep"
    assert engine.weight_version == 1
    _, _, mate_versions, _ = await mate
    assert mate_versions[0] == 0 and mate_versions[-1] == 1 and mate_versions == sorted(mate_versions)
    # abort-continue recomputed the mate only: no prefill ever held the pinned request's tokens.
    pinned_contexts = [ids[0] + tokens[:k] for k in range(1, len(tokens) + 1)]
    assert not any(row[-len(c) :] == c for row in recomputed_contexts(steps) for c in pinned_contexts)


async def test_a_pinned_request_for_a_version_not_served_is_refused(engine, model_dir, new_weights):
    ids, _ = prompts(model_dir, ["123="])
    with pytest.raises(Aborted, match="pinned to weight version 1; this instance serves version 0"):
        await engine_output(engine, EngineRequest("future", ids[0], Sampling(max_tokens=4), pinned_version=1))
    with pytest.raises(InvalidArgument, match="pinned_version must be >= 0"):
        await engine_output(engine, EngineRequest("negative", ids[0], Sampling(max_tokens=4), pinned_version=-1))
    _, _, versions, _ = await engine_output(
        engine, EngineRequest("served", ids[0], Sampling(max_tokens=4), pinned_version=0)
    )
    assert versions == [0] * 4
    await asyncio.to_thread(engine.stage_weights, 1, new_weights)
    # A newer version is staged: admitting the request would hold its switch back.
    with pytest.raises(Aborted, match="switching"):
        await engine_output(engine, EngineRequest("staged", ids[0], Sampling(max_tokens=4), pinned_version=0))
    await engine.commit_staged(1)
    with pytest.raises(Aborted, match="serves version 1"):
        await engine_output(engine, EngineRequest("past", ids[0], Sampling(max_tokens=4), pinned_version=0))
    assert engine.running_requests == 0


async def test_a_commit_given_up_while_a_pinned_request_holds_it_back_is_withdrawn(engine, model_dir, new_weights):
    """Its caller's deadline ran out: the version stays staged, and nothing switches behind the next push."""
    ids, _ = prompts(model_dir, ["9="])
    record_steps(engine, decode_seconds=0.01)
    pinned = asyncio.create_task(
        engine_output(
            engine, EngineRequest("pinned", ids[0], Sampling(temperature=1.0, max_tokens=30), pinned_version=0)
        )
    )
    await wait_for_tokens(engine, 3)
    await asyncio.to_thread(engine.stage_weights, 1, new_weights)
    commit = asyncio.create_task(engine.commit_staged(1))
    await wait_for(lambda: engine._swap is not None, 10, "the switch to be held back", interval=0.001)
    commit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await commit
    _, _, versions, _ = await pinned
    assert versions == [0] * 30 and engine._swap is None
    await asyncio.sleep(0.05)
    assert engine.weight_version == 0
    await engine.commit_staged(1)
    assert engine.weight_version == 1


async def test_background_requests_decode_at_the_lowest_priority_only_while_alone(engine, model_dir):
    """While every sequence in the batch is background work (a validation), the process's session
    runs at nice 19; a training request joining brings it back at once, and so does the end."""
    if not SessionPriority().usable or not os.access(SessionPriority.AUTOGROUP, os.W_OK):
        pytest.skip("this kernel shows no autogroup priority, or does not let it be written")
    if not effective_capabilities() >> CAP_SYS_ADMIN & 1:
        pytest.skip(
            "without CAP_SYS_ADMIN the kernel defers a change for up to 100 ms (test_background_priority covers that)"
        )
    before = SessionPriority.read()
    priority_at_decode: list[tuple[frozenset[str], int]] = []
    run = engine._group.run

    def recording(op, *args):
        if op == "decode":
            running = frozenset(s.request.request_id for s in engine._batch.rows)
            priority_at_decode.append((running, SessionPriority.read()))
            time.sleep(0.002)
        return run(op, *args)

    engine._group.run = recording
    ids, _ = prompts(model_dir, ["111=", "222="])
    background = asyncio.create_task(
        engine_output(
            engine, EngineRequest("validation", ids[0], Sampling(temperature=1.0, max_tokens=50), background=True)
        )
    )
    while engine.generated_tokens < 5:
        await asyncio.sleep(0.001)
    training = await engine_output(engine, EngineRequest("training", ids[1], Sampling(temperature=1.0, max_tokens=10)))
    await background
    assert training[3] is Finish.LENGTH
    alone = {nice for running, nice in priority_at_decode if running == {"validation"}}
    shared = {nice for running, nice in priority_at_decode if "training" in running}
    assert alone == {19}
    assert shared == {before}
    assert SessionPriority.read() == before


async def test_a_sessions_next_turn_prefills_only_its_new_tokens_and_samples_the_same(model_dir):
    """The prefix cache: turn 2 of a session reuses turn 1's KV cache and gives what a full prefill gives."""
    ids, eos = prompts(model_dir, ["1234=", "5="])
    sampling = Sampling(temperature=0, max_tokens=6, stop_token_ids=frozenset({eos}))
    cached, plain = (
        TorchEngine(model_dir, max_batch_size=8, seed=1),
        TorchEngine(model_dir, max_batch_size=8, seed=1, prefix_cache_bytes=0),
    )
    await cached.start()
    await plain.start()
    try:
        first = await engine_output(cached, EngineRequest("t0", ids[0], sampling, cache_key="session"))
        assert list(cached.prefix_cache) == ["session"]
        second_prompt = ids[0] + first[0] + ids[1]
        reused = await engine_output(cached, EngineRequest("t1", second_prompt, sampling, cache_key="session"))
        full = await engine_output(plain, EngineRequest("t1", second_prompt, sampling, cache_key="session"))
        assert cached.prefix_cache.hits == 1 and cached.prefix_cache.tokens_reused == len(ids[0]) + len(first[0]) - 1
        assert plain.prefix_cache.hits == 0
        assert reused[0] == full[0] and reused[1] == pytest.approx(full[1], abs=1e-3)
        # A context that does not extend the kept one (an edited history) is prefilled whole.
        edited = await engine_output(cached, EngineRequest("t2", ids[1] + ids[0], sampling, cache_key="session"))
        assert cached.prefix_cache.hits == 1 and edited[3] in (Finish.STOP, Finish.LENGTH)
    finally:
        await cached.stop()
        await plain.stop()


@pytest.mark.parametrize("mode_engine", ["continue"], indirect=True)
async def test_a_turn_decoded_across_a_switch_keeps_no_prefix_cache_of_mixed_versions(
    mode_engine, model_dir, new_weights
):
    """update_mode continue: a turn that went on decoding through a switch holds KV of both versions;
    none of it is kept for the session's next turn, which is prefilled whole on the new weights and
    matches an engine that never cached; a turn run wholly on the new version is kept and reused."""
    engine, updater = mode_engine
    run = engine._group.run

    def switch_mid_turn(op, *args):
        # The turn decodes its first tokens on version 0, then waits for the switch to be committed.
        if op == "decode" and engine.generated_tokens >= 3 and engine.weight_version == 0:
            deadline = time.monotonic() + 10
            while engine._swap is None:
                assert time.monotonic() < deadline, "the switch was never committed"
                time.sleep(0.001)
        return run(op, *args)

    engine._group.run = switch_mid_turn
    ids, eos = prompts(model_dir, ["5555=", "7="])
    sampling = Sampling(temperature=0, max_tokens=8)
    first = asyncio.create_task(engine_output(engine, EngineRequest("t0", ids[0], sampling, cache_key="session")))
    await wait_for_tokens(engine, 3)
    await begin_push(updater, 1, new_weights)
    await updater.commit(1)
    tokens, _, versions, _ = await first
    assert versions[0] == 0 and versions[-1] == 1, "the turn spans the switch"
    assert list(engine.prefix_cache) == [], "a turn whose KV is partly version 0's is not kept under version 1"
    second_prompt = ids[0] + tokens + ids[1]
    second = await engine_output(engine, EngineRequest("t1", second_prompt, sampling, cache_key="session"))
    assert engine.prefix_cache.hits == 0 and set(second[2]) == {1}
    plain = TorchEngine(model_dir, max_batch_size=8, seed=1, prefix_cache_bytes=0)
    await plain.start()
    try:
        plain.stage_weights(1, new_weights)
        await plain.commit_staged(1)
        full = await engine_output(plain, EngineRequest("t1", second_prompt, sampling))
    finally:
        await plain.stop()
    assert second[0] == full[0] and second[1] == pytest.approx(full[1], abs=1e-3)
    # The second turn ran wholly on version 1: kept, and the third turn reuses it.
    assert list(engine.prefix_cache) == ["session"]
    third = await engine_output(
        engine, EngineRequest("t2", second_prompt + second[0] + ids[1], sampling, cache_key="session")
    )
    assert engine.prefix_cache.hits == 1 and set(third[2]) == {1}
