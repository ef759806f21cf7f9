"""The FSDP2 trainer as real rank processes (a gloo process group, or one rank alone) against a real
weights service: two ranks train exactly like one, each hands over only its own rows (never a
full tensor), and a sharded checkpoint resumes on two ranks (and on one) to the state saved.

The ranks run tests/integration/trainer/fsdp_trainer_worker.py, which drives them through rank 0's
commands as the service does. One module-scoped set of runs feeds every test here."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from rlmesh.models.loading import load_causal_lm
from rlmesh.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer
from rlmesh.models.tp_layout import fsdp_rows
from rlmesh.transfer.payload import ALIGNMENT
from rlmesh.transfer.shards import SHM_DIR, shard_views
from services.trainer.ranks.batching import TrainingSample, build_micro_batch, token_logprobs
from services.trainer.ranks.handoff import SLOT_PREFIX, mesh_tag
from tests.support.meshes import build_mesh, stop_mesh

WORKER = "tests.integration.trainer.fsdp_trainer_worker"
RUN_TIMEOUT = 120


def make_samples(model_dir: Path) -> list[list[TrainingSample]]:
    """Two micro-batches of one group of 8 samples each, of mixed lengths, with behaviour logprobs
    near the policy's own (the PPO ratio mostly inside the clip range, some tokens clipped)."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(7)
    model = load_causal_lm(model_dir)
    micro_batches = []
    for _ in range(2):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 8)))
        prompt = tokenizer.encode(f"{digits}=").ids
        samples = []
        for _ in range(8):
            response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 7)))).ids + [eos]
            samples.append(TrainingSample(prompt, response, [0.0] * len(response), rng.uniform(-1.5, 1.5)))
        batch = build_micro_batch(samples, tokenizer.token_to_id(PAD_TOKEN))
        with torch.no_grad():
            logprobs = token_logprobs(model, batch, temperature=1.0)
        for i, sample in enumerate(samples):
            start = len(sample.prompt_ids) - 1
            exact = logprobs[i, start : start + len(sample.response_ids)]
            sample.behaviour_logprobs = (
                exact + 0.15 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(i))
            ).tolist()
        micro_batches.append(samples)
    return micro_batches


async def run_ranks(rank_runner, ranks: int, spec: dict, directory: Path) -> dict:
    """Runs the worker on `ranks` processes (a process group when more than one) and returns rank 0's result."""
    spec_path = directory / f"spec-{spec['scenario']}-{ranks}.json"
    spec["result"] = str(directory / f"result-{spec['scenario']}-{ranks}.pt")
    spec_path.write_text(json.dumps(spec))
    await asyncio.to_thread(
        rank_runner.run, WORKER, [str(spec_path)], ranks, directory, RUN_TIMEOUT, distributed=ranks > 1
    )
    return torch.load(spec["result"], weights_only=False)


def stored_shards(store) -> dict:
    """What the weights service holds of its latest version: each rank's header and shard tensors."""
    snapshot = store.latest
    return {
        "version": snapshot.version,
        "headers": [type(h).FromString(h.SerializeToString()) for h in snapshot.headers],
        "shards": [
            {name: view.clone() for name, view in shard_views(h, s).items()}
            for h, s in zip(snapshot.headers, snapshot.shards)
        ],
    }


@pytest.fixture(scope="module")
def runs(rank_runner, model_dir, tmp_path_factory):
    """train on 1 rank, train on 2 ranks (shared memory), resume on 2 ranks (stream) and on 1."""
    directory = tmp_path_factory.mktemp("fsdp")
    samples_path = directory / "samples.pt"
    torch.save(make_samples(model_dir), samples_path)

    async def scenario() -> dict:
        mesh = await build_mesh(model_dir, "tcp", instances=0)
        try:
            base = {"model_dir": str(model_dir), "weights_address": mesh.weights_address, "samples": str(samples_path)}
            out = {}
            one = {
                **base,
                "output_dir": str(directory / "one"),
                "handoff": "shm",
                "scenario": "train",
                "versions": [1, 2],
            }
            out["train1"] = await run_ranks(rank_runner, 1, one, directory)
            out["stored1"] = stored_shards(mesh.weights.store)
            two = {
                **base,
                "output_dir": str(directory / "two"),
                "handoff": "shm",
                "scenario": "train",
                "versions": [3, 4],
            }
            out["train2"] = await run_ranks(rank_runner, 2, two, directory)
            out["stored2"] = stored_shards(mesh.weights.store)
            out["resume2"] = await run_ranks(
                rank_runner, 2, {**two, "handoff": "stream", "scenario": "resume", "versions": [5]}, directory
            )
            out["stored_stream"] = stored_shards(mesh.weights.store)
            out["resume1"] = await run_ranks(rank_runner, 1, {**two, "scenario": "resume", "versions": [6]}, directory)
            out["output_two"] = directory / "two"
            return out
        finally:
            await stop_mesh(mesh)

    return asyncio.run(scenario())


def test_two_ranks_take_the_same_step_as_one(runs, model_dir):
    one, two = runs["train1"], runs["train2"]
    initial = dict(load_causal_lm(model_dir).named_parameters())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for a, b in zip(one["stats"], two["stats"]):
        assert a.tokens == b.tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
        assert a.kl == pytest.approx(b.kl, rel=1e-4, abs=1e-7)
        assert a.clip_fraction == pytest.approx(b.clip_fraction, abs=1e-6)
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    assert one["params"].keys() == two["params"].keys()
    assert any(s.clip_fraction > 0 for s in one["stats"]), "no token was clipped: the clip statistics went untested"
    learning_rate, noisy, total = 3e-4, 0, 0
    for name, param in one["params"].items():
        # After one Adam step exp_avg is 0.1 x the clipped gradient: the gradients agree tightly.
        gradient = one["optimizer"][name]["exp_avg"] / 0.1
        torch.testing.assert_close(
            two["optimizer"][name]["exp_avg"] / 0.1, gradient, rtol=1e-4, atol=1e-8, msg=f"{name} gradient"
        )
        torch.testing.assert_close(
            two["optimizer"][name]["exp_avg_sq"],
            one["optimizer"][name]["exp_avg_sq"],
            rtol=1e-4,
            atol=1e-12,
            msg=f"{name} exp_avg_sq",
        )
        # Adam's first step moves a weight by lr * g / (|g| + 1e-8): about lr wherever the gradient
        # is above float32 noise, and there the ranks agree to a few roundings. Where |g| is at the
        # noise level (~1e-10, against gradients of ~1e-2) that ratio amplifies rounding, so those
        # weights are only bounded by the step size, and must be rare.
        assert (param - initial[name].detach()).abs().max() > 1e-4, f"{name} did not move"
        signal = gradient.abs() > 1e-7
        torch.testing.assert_close(two["params"][name][signal], param[signal], rtol=0, atol=2e-6, msg=name)
        assert (two["params"][name] - param).abs().max() <= 2 * learning_rate
        noisy += int((~signal).sum())
        total += param.numel()
    assert noisy < total * 1e-3, f"{noisy} of {total} weights have gradients at the noise level"
    assert one["eval"].greedy == two["eval"].greedy


def test_each_rank_hands_over_exactly_its_rows_and_never_a_full_tensor(runs):
    for key, world, result in (
        ("stored1", 1, runs["train1"]),
        ("stored2", 2, runs["train2"]),
        ("stored_stream", 2, runs["resume2"]),
    ):
        stored = runs[key]
        assert stored["version"] == result["publish"][-1].version
        headers = stored["headers"]
        assert [h.rank for h in headers] == list(range(world)) and all(h.world_size == world for h in headers)
        model_bytes = sum(p.numel() * p.element_size() for p in result["params"].values())
        for header, shards in zip(headers, stored["shards"]):
            assert {spec.name for spec in header.shards} == set(result["params"])  # tied lm_head once, as embed_tokens
            for spec in header.shards:
                assert (spec.row_start, spec.row_end) == fsdp_rows(spec.full_shape[0], world, header.rank), spec.name
                if world > 1:
                    assert spec.row_end - spec.row_start < spec.full_shape[0], (
                        f"{spec.name}: a full tensor in rank {header.rank}'s payload"
                    )
                # The bytes the service holds are this rank's rows of the trainer's parameters.
                full = result["params"][spec.name]
                assert torch.equal(shards[spec.name], full[spec.row_start : spec.row_end]), spec.name
            # About 1/N of the model each: its rows plus alignment padding, nothing more.
            assert (
                model_bytes / world - ALIGNMENT * len(header.shards)
                <= header.total_bytes
                <= model_bytes / world + ALIGNMENT * len(header.shards)
            )
            assert bool(header.shm_path) == (key != "stored_stream")
        publishes = result["publish"]
        assert all(sum(p.rank_bytes) == sum(h.total_bytes for h in headers) for p in publishes[-1:])
    # Shared memory: two slots per rank named after the mesh and the process, removed at exit.
    slots = runs["train2"]["slots"]
    tag = mesh_tag(str(runs["output_two"]))
    assert len(slots) == 2 and all(
        Path(s).name.startswith(f"{SLOT_PREFIX}-{tag}-{runs['train2']['pid']}-r0-") for s in slots
    )
    assert not list(SHM_DIR.glob(f"{SLOT_PREFIX}-{tag}-*")), "a rank left its shared memory behind"


def test_a_sharded_checkpoint_resumes_to_the_state_saved(runs):
    saved = runs["train2"]
    checkpoint = Path(saved["checkpoint"])
    assert {p.name for p in checkpoint.glob("shards_rank*.pt")} == {"shards_rank0.pt", "shards_rank1.pt"}
    assert "trainer_state.pt" in {p.name for p in checkpoint.iterdir()}
    for resumed in (runs["resume2"], runs["resume1"]):
        assert (resumed["state"].step, resumed["state"].version, resumed["state"].task_cursors) == (
            1,
            4,
            {"increment": 32},
        )
        for name, param in saved["params"].items():
            assert torch.equal(resumed["params"][name], param), name
        for name, state in saved["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(resumed["optimizer"][name][key], value), f"{name} {key}"
    # The last checkpoint also holds the whole policy as an HF folder any engine loads.
    exported = load_causal_lm(checkpoint)
    for name, param in exported.named_parameters():
        assert torch.equal(param, saved["params"][name]), name
    assert (checkpoint / "tokenizer.json").is_file()
