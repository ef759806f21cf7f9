"""What the fuzzer sends: generated requests with unknown fields, hints and valid seeds that reach
past validation, and the targeted cases (oversize, NaN and negative values, unknown ids, a wrong
incarnation token, declared sizes no server could hold)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import grpc
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from transformers import AutoConfig

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tp_layout import ModelShape, fsdp_rows, hf_parameter_shapes
from rlmesh.rollout.v1 import rollout_pb2
from rlmesh.transfer.payload import aligned, bucket_checksums, pack_layout
from rlmesh.transfer.shards import layout_to_proto
from rlmesh.weights.v1 import weights_pb2
from tests.fuzz.harness import CRASH_CODES, Harness, Rpc, Wire, contract_rpcs
from tests.fuzz.messages import MessageStrategies

REAL_INSTANCE = "instance-0"
PARKED_BATCH = "fuzz-parked"
"""Accepted for a policy version no instance serves (unless a generated registration claims one), so
its rollout stream waits."""
DELIVERED_BATCH = "fuzz-delivered"
"""Generated and streamed to its end at start: the batch a training step can be reported for."""
PUSHED_VERSION = 1
"""The version the stateful rollout cases begin a weight update for."""


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unknown_fields(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Encoded fields with numbers the message does not define, mostly just past its own: what a
    peer on a newer contract sends, which must be ignored."""
    known = {f.number for f in descriptor.fields}
    top = max(known, default=0)
    numbers = st.one_of(st.integers(top + 1, top + 8), st.integers(1, 2**29 - 1)).filter(
        lambda n: n not in known and not 19000 <= n <= 19999
    )
    one = st.one_of(
        st.builds(lambda n, v: varint(n << 3) + varint(v), numbers, st.integers(0, 2**64 - 1)),
        st.builds(lambda n, b: varint(n << 3 | 1) + b, numbers, st.binary(min_size=8, max_size=8)),
        st.builds(lambda n, b: varint(n << 3 | 2) + varint(len(b)) + b, numbers, st.binary(max_size=32)),
        st.builds(lambda n, b: varint(n << 3 | 5) + b, numbers, st.binary(min_size=4, max_size=4)),
    )
    return st.one_of(st.just(b""), st.lists(one, min_size=1, max_size=3).map(b"".join))


def wires(strategies: MessageStrategies, rpc: Rpc, seed: Message | list[Message] | None) -> st.SearchStrategy:
    """A request of the RPC (for a client-streaming one a sequence of them): generated from scratch,
    or a variant of the RPC's valid `seed`."""
    descriptor = rpc.request.DESCRIPTOR
    one = st.builds(Wire, strategies.message(descriptor), unknown_fields(descriptor))
    if not rpc.client_streaming:
        return (
            one
            if seed is None
            else st.one_of(one, st.builds(Wire, strategies.variants(seed), unknown_fields(descriptor)))
        )
    generated = st.lists(one, max_size=5)
    if seed is None:
        return generated
    kept_or_varied = st.tuples(*(st.one_of(st.just(m), strategies.variants(m)) for m in seed))
    return st.one_of(
        generated,
        st.builds(
            lambda messages, extra: [Wire(m) for m in messages] + extra, kept_or_varied, st.lists(one, max_size=1)
        ),
    )


def oversize(rpc: Rpc, limit: int) -> Wire:
    """A request one byte over `limit`: a single field the message does not define, so only its
    size is wrong."""
    number = max((f.number for f in rpc.request.DESCRIPTOR.fields), default=0) + 1
    tag = varint(number << 3 | 2)
    length = limit + 1 - len(tag) - len(varint(limit))
    raw = tag + varint(length) + bytes(length)
    assert len(raw) == limit + 1
    return Wire(raw=raw)


def hints(harness: Harness) -> dict[str, st.SearchStrategy]:
    """Values mixed into the generic ones by field name: ids that exist, small valid token ids and
    budgets, so generated requests also get past validation into the servers' logic."""
    vocab = int(AutoConfig.from_pretrained(harness.model_dir).vocab_size)
    tokens = st.integers(0, vocab - 1)
    small = st.integers(0, 4)
    return {
        "instance_id": st.sampled_from([REAL_INSTANCE, "fuzz-instance"]),
        "batch_id": st.sampled_from([PARKED_BATCH, DELIVERED_BATCH, "fuzz-batch"]),
        "request_id": st.sampled_from(["fuzz-request", f"{PARKED_BATCH}/p/0@1"]),
        "request_ids": st.sampled_from(["fuzz-request"]),
        "prompt_id": st.sampled_from(["p", "q"]),
        "address": st.sampled_from([harness.address("rollout"), harness.address("trainer"), "127.0.0.1:1"]),
        "token_ids": tokens,
        "prompt_token_ids": tokens,
        "continued_token_ids": tokens,
        "stop_token_ids": tokens,
        "max_tokens": st.integers(1, 8),
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_p": st.sampled_from([0.0, 0.9, 1.0]),
        "n": st.integers(1, 3),
        "micro_batch_groups": small,
        "min_groups": small,
        "tp_rank": small,
        "rank": small,
        "world_size": st.integers(1, 3),
        "version": st.integers(-1, 3),
        "weight_version": st.integers(-1, 3),
        "policy_version": st.integers(-1, 3),
        "base_version": st.integers(-1, 3),
        "pinned_version": st.integers(-1, 3),
    }


def sampling(**fields: float) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 1.0, "top_p": 1.0, "max_tokens": 2, **fields})


def prompts(count: int = 1, **sampling_fields: float) -> list[manager_pb2.Prompt]:
    own = {"sampling": sampling(**sampling_fields)} if sampling_fields else {}
    return [manager_pb2.Prompt(prompt_id=f"p{i}", token_ids=[1, 2, 3], n=2, **own) for i in range(count)]


def parked_batch() -> manager_pb2.SubmitPromptsRequest:
    return manager_pb2.SubmitPromptsRequest(
        batch_id=PARKED_BATCH, policy_version=2**62, prompts=prompts(), sampling=sampling()
    )


def delivered_batch() -> manager_pb2.SubmitPromptsRequest:
    return manager_pb2.SubmitPromptsRequest(
        batch_id=DELIVERED_BATCH, policy_version=0, prompts=prompts(2), sampling=sampling()
    )


def rank_manifest(harness: Harness, version: int) -> common_pb2.WeightManifest:
    """A valid payload layout of the rollout engine's one tensor-parallel rank (all-zero bytes)."""
    specs = harness.mesh.rollouts[0].engine.rank_parameter_specs()
    manifest = pack_layout({spec.name: (spec.shape, spec.dtype) for spec in specs}, version)
    manifest.bucket_crc32.extend(
        bucket_checksums(torch.zeros(manifest.total_bytes, dtype=torch.uint8), manifest.bucket_bytes)
    )
    return manifest


def begin_request(harness: Harness) -> rollout_pb2.BeginWeightUpdateRequest:
    return rollout_pb2.BeginWeightUpdateRequest(
        rank_manifests=[rank_manifest(harness, PUSHED_VERSION)], backend=rollout_pb2.TRANSFER_BACKEND_GRPC
    )


SMALL_MODEL = ModelShape(
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    num_layers=2,
    tie_word_embeddings=True,
    attention_bias=True,
)
"""A layout for the targeted upload cases, which need no model folder."""


def shards_header(shape: ModelShape, version: int, world_size: int = 1, rank: int = 0) -> weights_pb2.ShardsHeader:
    """A valid header of FSDP rank `rank`'s shards of `shape` in float32, whose bytes are all zero."""
    header = weights_pb2.ShardsHeader(version=version, rank=rank, world_size=world_size, layout=layout_to_proto(shape))
    end = 0
    for name, dims in hf_parameter_shapes(shape).items():
        start, stop = fsdp_rows(dims[0], world_size, rank)
        nbytes = (stop - start) * math.prod(dims[1:]) * 4
        header.shards.add(
            name=name,
            dtype=common_pb2.D_TYPE_FLOAT32,
            full_shape=list(dims),
            row_start=start,
            row_end=stop,
            offset=aligned(end),
            nbytes=nbytes,
        )
        end = aligned(end) + nbytes
    header.total_bytes = end
    header.payload_crc32 = zlib.crc32(bytes(end))
    return header


def seeds(harness: Harness) -> dict[str, Message | list[Message]]:
    """A valid request for each RPC that takes more than an empty message. The rollout's weight
    update ones expect version PUSHED_VERSION begun and not yet served: the rollout RPCs are fuzzed
    before the weights service stores a version it could push."""
    upload = shards_header(ModelShape.from_hf_config(AutoConfig.from_pretrained(harness.model_dir)), version=7)
    full = pack_layout({"w": ((16,), torch.float32)}, version=5)
    full.bucket_crc32.append(zlib.crc32(bytes(full.total_bytes)))
    return {
        "manager.RegisterInstance": manager_pb2.RegisterInstanceRequest(
            instance_id="fuzz-instance", address="127.0.0.1:1", max_batch_size=4
        ),
        "manager.Heartbeat": manager_pb2.HeartbeatRequest(instance_id=REAL_INSTANCE),
        "manager.DeregisterInstance": manager_pb2.DeregisterInstanceRequest(instance_id="fuzz-instance"),
        "manager.PublishVersion": manager_pb2.PublishVersionRequest(version=1),
        "manager.SubmitPrompts": manager_pb2.SubmitPromptsRequest(
            batch_id="fuzz-batch", prompts=prompts(2), sampling=sampling()
        ),
        "manager.StreamRollouts": manager_pb2.StreamRolloutsRequest(batch_id=PARKED_BATCH, micro_batch_groups=1),
        "manager.TakeReadyGroups": manager_pb2.TakeReadyGroupsRequest(batch_id=PARKED_BATCH),
        "manager.CancelBatch": manager_pb2.CancelBatchRequest(batch_id=PARKED_BATCH),
        "manager.AcknowledgeRollouts": manager_pb2.AcknowledgeRolloutsRequest(batch_id=PARKED_BATCH),
        "manager.ReportTrainingStep": manager_pb2.ReportTrainingStepRequest(
            batch_id=DELIVERED_BATCH, step_seconds=2, wait_seconds=1
        ),
        "rollout.Generate": rollout_pb2.GenerateRequest(
            request_id="fuzz-generate", prompt_token_ids=[1, 2, 3], sampling=sampling(max_tokens=4)
        ),
        "rollout.Abort": rollout_pb2.AbortRequest(request_ids=["fuzz-generate"]),
        "rollout.BeginWeightUpdate": begin_request(harness),
        # Part of the payload only: a commit must never make the instance serve the all-zero version.
        "rollout.PushWeightChunks": [rollout_pb2.PushWeightChunksRequest(version=PUSHED_VERSION, data=bytes(65536))],
        "rollout.CommitWeightUpdate": rollout_pb2.CommitWeightUpdateRequest(version=PUSHED_VERSION),
        "rollout.Drain": rollout_pb2.DrainRequest(reason="fuzz"),
        "weights.UploadShards": [
            weights_pb2.UploadShardsRequest(header=upload),
            weights_pb2.UploadShardsRequest(chunk=weights_pb2.PayloadChunk(data=bytes(upload.total_bytes))),
        ],
        "weights.UploadWeights": [
            weights_pb2.UploadWeightsRequest(manifest=full),
            weights_pb2.UploadWeightsRequest(chunk=weights_pb2.PayloadChunk(data=bytes(full.total_bytes))),
        ],
    }


@dataclass(frozen=True, slots=True)
class Expected:
    """A targeted case: the request and the statuses a correct server may answer with."""

    rpc: str
    request: Message | list[Message]
    """A list for a client-streaming RPC."""
    codes: frozenset[grpc.StatusCode]
    fragment: str = ""
    """Part of the message that names what was wrong."""
    before: tuple[tuple[str, Message], ...] = ()
    """Calls that set the stage, as (rpc, request)."""


def bad_sampling_cases() -> dict[str, Expected]:
    """NaN, infinite, negative and out-of-range sampling parameters, to the rollout directly and to
    the manager for a whole batch and for one prompt: refused, naming the parameter. A temperature
    too small to divide logits by, and a seed past 63 bits, only the engine can judge."""
    bad = {
        "temperature-nan": {"temperature": math.nan},
        "temperature-inf": {"temperature": math.inf},
        "temperature--inf": {"temperature": -math.inf},
        "temperature-negative": {"temperature": -1.0},
        "top_p-nan": {"top_p": math.nan},
        "top_p-inf": {"top_p": math.inf},
        "top_p-negative": {"top_p": -0.5},
        "top_p-above-1": {"top_p": 1.5},
        "max_tokens-0": {"max_tokens": 0},
    }
    engine_only = {"temperature-denormal": {"temperature": 1e-45}, "seed-2^64-1": {"seed": 2**64 - 1}}
    invalid = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
    cases = {}
    for name, fields in {**bad, **engine_only}.items():
        parameter = name.split("-")[0]
        cases[f"rollout.Generate-{name}"] = Expected(
            "rollout.Generate",
            rollout_pb2.GenerateRequest(
                request_id=f"bad-{name}",
                prompt_token_ids=[1, 2],
                continued_token_ids=[3],
                sampling=sampling(**{"max_tokens": 4, **fields}),
            ),
            invalid,
            parameter,
        )
        if name in engine_only:
            continue
        cases[f"manager.SubmitPrompts-batch-{name}"] = Expected(
            "manager.SubmitPrompts",
            manager_pb2.SubmitPromptsRequest(
                batch_id=f"bad-batch-{name}", prompts=prompts(), sampling=sampling(**fields)
            ),
            invalid,
            parameter,
        )
        cases[f"manager.SubmitPrompts-prompt-{name}"] = Expected(
            "manager.SubmitPrompts",
            manager_pb2.SubmitPromptsRequest(
                batch_id=f"bad-prompt-{name}", prompts=prompts(**fields), sampling=sampling()
            ),
            invalid,
            parameter,
        )
    reports = {
        "negative": {"step_seconds": -1, "wait_seconds": -2},
        "nan": {"step_seconds": math.nan, "wait_seconds": 0},
        "inf": {"step_seconds": math.inf, "wait_seconds": math.inf},
    }
    for name, fields in reports.items():
        cases[f"manager.ReportTrainingStep-{name}"] = Expected(
            "manager.ReportTrainingStep",
            manager_pb2.ReportTrainingStepRequest(batch_id=DELIVERED_BATCH, **fields),
            invalid,
        )
    cases["rollout.Generate-pinned_version--1"] = Expected(
        "rollout.Generate",
        rollout_pb2.GenerateRequest(
            request_id="pinned-negative", prompt_token_ids=[1, 2], sampling=sampling(), pinned_version=-1
        ),
        invalid,
        "pinned_version",
    )
    cases["manager.SubmitPrompts-policy_version--1"] = Expected(
        "manager.SubmitPrompts",
        manager_pb2.SubmitPromptsRequest(
            batch_id="bad-policy", policy_version=-1, prompts=prompts(), sampling=sampling()
        ),
        invalid,
        "policy_version",
    )
    return cases


def unknown_id_cases() -> dict[str, Expected]:
    """Requests naming an instance, batch, request or version that does not exist."""
    not_found = frozenset({grpc.StatusCode.NOT_FOUND})
    refused = frozenset(
        {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}
    )
    ghost = "no-such-instance"
    chunk = rollout_pb2.PushWeightChunksRequest(version=987654, offset=0, data=b"\x00" * 64)
    cases = {
        "manager.Heartbeat": Expected(
            "manager.Heartbeat", manager_pb2.HeartbeatRequest(instance_id=ghost), not_found, ghost
        ),
        "manager.DeregisterInstance": Expected(
            "manager.DeregisterInstance", manager_pb2.DeregisterInstanceRequest(instance_id=ghost), not_found, ghost
        ),
        "manager.StreamRollouts": Expected(
            "manager.StreamRollouts",
            manager_pb2.StreamRolloutsRequest(batch_id="no-such-batch", micro_batch_groups=1),
            not_found,
            "no-such-batch",
        ),
        "manager.TakeReadyGroups": Expected(
            "manager.TakeReadyGroups",
            manager_pb2.TakeReadyGroupsRequest(batch_id="no-such-batch"),
            not_found,
            "no-such-batch",
        ),
        "manager.CancelBatch": Expected(
            "manager.CancelBatch", manager_pb2.CancelBatchRequest(batch_id="no-such-batch"), not_found, "no-such-batch"
        ),
        "manager.ReportTrainingStep": Expected(
            "manager.ReportTrainingStep",
            manager_pb2.ReportTrainingStepRequest(batch_id="no-such-batch", step_seconds=1),
            not_found,
            "no-such-batch",
        ),
        # A long id must come back in the message too, cut short, not lose the answer.
        "manager.CancelBatch-long-id": Expected(
            "manager.CancelBatch", manager_pb2.CancelBatchRequest(batch_id="é" * 100_000), not_found, "bytes cut"
        ),
        "rollout.Generate-long-id": Expected(
            "rollout.Generate",
            rollout_pb2.GenerateRequest(request_id="🙂" * 100_000, sampling=sampling()),
            frozenset({grpc.StatusCode.INVALID_ARGUMENT}),
            "bytes cut",
        ),
        "manager.PublishVersion-older": Expected(
            "manager.PublishVersion", manager_pb2.PublishVersionRequest(version=-5), refused, "-5"
        ),
        "rollout.Abort": Expected(
            "rollout.Abort", rollout_pb2.AbortRequest(request_ids=["no-such-request"]), frozenset({grpc.StatusCode.OK})
        ),
        "rollout.CommitWeightUpdate": Expected(
            "rollout.CommitWeightUpdate", rollout_pb2.CommitWeightUpdateRequest(version=987654), refused, "987654"
        ),
        "rollout.PushWeightChunks": Expected("rollout.PushWeightChunks", chunk, refused, "987654"),
        # Pinned to a version the instance does not serve: ABORTED, for the manager to go elsewhere.
        "rollout.Generate-pinned-version": Expected(
            "rollout.Generate",
            rollout_pb2.GenerateRequest(
                request_id="pinned-ahead", prompt_token_ids=[1, 2], sampling=sampling(), pinned_version=987654
            ),
            frozenset({grpc.StatusCode.ABORTED}),
            "pinned to weight version 987654",
        ),
    }
    return cases


def delivery_cases() -> dict[str, Expected]:
    """Resuming a stream past the groups sent, and acknowledging a batch with groups still to send."""
    invalid = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
    return {
        "manager.StreamRollouts-resume-past-sent": Expected(
            "manager.StreamRollouts",
            manager_pb2.StreamRolloutsRequest(batch_id=PARKED_BATCH, micro_batch_groups=1, resume_from=7),
            invalid,
            "resume_from 7",
        ),
        "manager.TakeReadyGroups-resume-past-sent": Expected(
            "manager.TakeReadyGroups",
            manager_pb2.TakeReadyGroupsRequest(batch_id=PARKED_BATCH, resume_from=2**32 - 1),
            invalid,
            "resume_from 4294967295",
        ),
        "manager.AcknowledgeRollouts-unsent": Expected(
            "manager.AcknowledgeRollouts",
            manager_pb2.AcknowledgeRolloutsRequest(batch_id=PARKED_BATCH),
            frozenset({grpc.StatusCode.FAILED_PRECONDITION}),
            "still to be sent",
        ),
    }


def declared_size_cases() -> dict[str, Expected]:
    """Uploads whose declared sizes would make the weights service list, build or allocate without
    bound (a tiny bucket size, a layout of billions of layers, a huge model a rank holds no rows
    of), and a shared-memory path the file system refuses: refused before any of that."""
    invalid = frozenset({grpc.StatusCode.INVALID_ARGUMENT})

    def manifest(elements: int, bucket_bytes: int, checksums: int) -> common_pb2.WeightManifest:
        return common_pb2.WeightManifest(
            version=9,
            total_bytes=4 * elements,
            bucket_bytes=bucket_bytes,
            bucket_crc32=[0] * checksums,
            tensors=[
                common_pb2.TensorSpec(
                    name="w", dtype=common_pb2.D_TYPE_FLOAT32, shape=[elements], offset=0, nbytes=4 * elements
                )
            ],
        )

    def upload(header: weights_pb2.ShardsHeader) -> list[weights_pb2.UploadShardsRequest]:
        return [weights_pb2.UploadShardsRequest(header=header)]

    layers = shards_header(SMALL_MODEL, version=9)
    layers.layout.num_hidden_layers = 2**32 - 1
    empty_rank = shards_header(replace(SMALL_MODEL, vocab_size=2**31), version=9, world_size=2**32 - 1, rank=2**32 - 2)
    long_path = shards_header(SMALL_MODEL, version=9)
    long_path.shm_path = "/dev/shm/" + "x" * 300
    return {
        "weights.UploadWeights-2^60-elements-in-1-byte-buckets": Expected(
            "weights.UploadWeights",
            [weights_pb2.UploadWeightsRequest(manifest=manifest(2**60, 1, 0))],
            invalid,
            "buckets",
        ),
        "weights.UploadWeights-4Mi-buckets-with-their-checksums": Expected(
            "weights.UploadWeights",
            [weights_pb2.UploadWeightsRequest(manifest=manifest(2**20, 1, 2**22))],
            invalid,
            "buckets",
        ),
        "weights.UploadShards-2^32-layers": Expected("weights.UploadShards", upload(layers), invalid, "parameters"),
        "weights.UploadShards-1TiB-model-rank-without-rows": Expected(
            "weights.UploadShards", upload(empty_rank), invalid, "over the limit"
        ),
        "weights.UploadShards-shm-path-too-long": Expected(
            "weights.UploadShards", upload(long_path), invalid, "shm_path"
        ),
    }


INCARNATION_FIELD = "incarnation_token"


def wrong_incarnation_cases() -> dict[str, Expected]:
    """Every request that carries an incarnation token (none until a contract has the field), with
    the real instance's id and a token it was never given: refused, except that registering again is
    how a restarted process joins, where any answer but a crash is right."""
    refused = frozenset(
        {
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.ALREADY_EXISTS,
        }
    )
    bases = {
        "rollout.Generate": rollout_pb2.GenerateRequest(
            request_id="wrong-incarnation", prompt_token_ids=[1], sampling=sampling()
        )
    }
    cases = {}
    for rpc in contract_rpcs():
        field = rpc.request.DESCRIPTOR.fields_by_name.get(INCARNATION_FIELD)
        if field is None:
            continue
        request = rpc.request()
        request.CopyFrom(bases.get(rpc.key, request))
        if "instance_id" in rpc.request.DESCRIPTOR.fields_by_name:
            request.instance_id = REAL_INSTANCE
        setattr(request, INCARNATION_FIELD, _wrong_value(field))
        codes = frozenset(grpc.StatusCode) - CRASH_CODES if rpc.name == "RegisterInstance" else refused
        cases[rpc.key] = Expected(rpc.key, request, codes)
        if "instance_id" in rpc.request.DESCRIPTOR.fields_by_name and rpc.name != "RegisterInstance":
            # The refusal quotes the id: a long one must not make it too large to arrive.
            long_id = "a" * 100_000
            register = manager_pb2.RegisterInstanceRequest(instance_id=long_id, address="127.0.0.1:1", max_batch_size=1)
            request = rpc.request(instance_id=long_id, **{INCARNATION_FIELD: _wrong_value(field)})
            cases[f"{rpc.key}-long-id"] = Expected(
                rpc.key, request, refused, before=(("manager.RegisterInstance", register),)
            )
    return cases


def _wrong_value(field: FieldDescriptor):
    if field.type == FieldDescriptor.TYPE_STRING:
        return "not-a-token-the-manager-gave"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return b"not-a-token-the-manager-gave"
    return 0xDEADBEEF
