"""Properties of the tensor-parallel layout rules of every family (Qwen2, Llama, Qwen3; tied or
untied, with or without attention biases) and the FSDP → TP resharding plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.models.families import FAMILIES
from rlmesh.models.tp_layout import (
    ModelShape,
    apply_copies,
    fsdp_rows,
    full_slices,
    hf_parameter_shapes,
    reshard_plan,
    shard_full_tensors,
    tp_parameter_shapes,
    tp_slices,
)


@st.composite
def shapes_and_tp(draw):
    """Model shapes that split over tp ranks, with tp in 1..8 and KV heads fewer or more than tp."""
    tp = draw(st.sampled_from([1, 2, 4, 8]) | st.integers(1, 8))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8) if (tp % k == 0 if tp > k else k % tp == 0)]))
    group = draw(st.integers(1, 3))
    heads = kv_heads * group
    while heads % tp:
        heads += kv_heads
    shape = ModelShape(
        hidden_size=draw(st.integers(1, 6)) * 4,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4])),
        intermediate_size=tp * draw(st.integers(1, 4)),
        vocab_size=draw(st.integers(1, 300)),
        num_layers=draw(st.integers(1, 2)),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        family=draw(st.sampled_from(sorted(FAMILIES))),
    )
    if shape.padded_vocab % tp:
        tp = 1
    return shape, tp


def random_full(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(dims, generator=generator) for name, dims in hf_parameter_shapes(shape).items()}


def vllm_reference_shard(
    full: dict[str, torch.Tensor], shape: ModelShape, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """vLLM's slicing written out directly from its conventions, independently of the plan."""
    d, inter = shape.head_dim, shape.intermediate_size // tp
    q_per_rank = shape.num_heads // tp
    if tp <= shape.num_kv_heads:
        kv_heads = list(range(rank * shape.num_kv_heads // tp, (rank + 1) * shape.num_kv_heads // tp))
    else:
        kv_heads = [rank // (tp // shape.num_kv_heads)]
    vocab_rows = shape.padded_vocab // tp

    def heads(tensor: torch.Tensor, indices: list[int]) -> torch.Tensor:
        return torch.cat([tensor[h * d : (h + 1) * d] for h in indices])

    def vocab(tensor: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(shape.padded_vocab, *tensor.shape[1:])
        padded[: shape.vocab_size] = tensor
        return padded[rank * vocab_rows : (rank + 1) * vocab_rows]

    out = {"model.embed_tokens.weight": vocab(full["model.embed_tokens.weight"])}
    q_heads = list(range(rank * q_per_rank, (rank + 1) * q_per_rank))
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        kinds = ["weight", "bias"] if shape.attention_bias else ["weight"]
        for kind in kinds:
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(
                [
                    heads(full[f"{p}self_attn.q_proj.{kind}"], q_heads),
                    heads(full[f"{p}self_attn.k_proj.{kind}"], kv_heads),
                    heads(full[f"{p}self_attn.v_proj.{kind}"], kv_heads),
                ]
            )
        out[f"{p}self_attn.o_proj.weight"] = full[f"{p}self_attn.o_proj.weight"].chunk(tp, dim=1)[rank]
        # Row-parallel bias: whole on every rank (rank 0 adds it); q/k norms act per head: whole too.
        for name in ("self_attn.o_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if p + name in full:
                out[p + name] = full[p + name]
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            [
                full[f"{p}mlp.gate_proj.weight"][rank * inter : (rank + 1) * inter],
                full[f"{p}mlp.up_proj.weight"][rank * inter : (rank + 1) * inter],
            ]
        )
        out[f"{p}mlp.down_proj.weight"] = full[f"{p}mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = full[f"{p}{norm}.weight"]
    out["model.norm.weight"] = full["model.norm.weight"]
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    return out


def fsdp_shards(full: dict[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    """What each FSDP2 rank holds: torch.chunk along dim 0, ranks past the last chunk hold nothing."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name, tensor in full.items():
        chunks = tensor.chunk(world, dim=0)
        for rank in range(world):
            shards[rank][name] = chunks[rank] if rank < len(chunks) else tensor[:0]
    return shards


def merge_ranks(ranks: list[dict[str, torch.Tensor]], shape: ModelShape, tp: int) -> dict[str, torch.Tensor]:
    """Reassembles full tensors from every rank's shards (KV heads replicated across ranks are
    taken from the first rank that holds them)."""
    d, inter = shape.head_dim, shape.intermediate_size // tp
    q_rows, kv_rows = shape.num_heads // tp * d, shape.kv_heads_per_rank(tp) * d
    full: dict[str, torch.Tensor] = {}
    full["model.embed_tokens.weight"] = torch.cat([r["model.embed_tokens.weight"] for r in ranks])[: shape.vocab_size]
    kv_owner = sorted({shape.kv_head_start(tp, r): r for r in reversed(range(tp))}.items())
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        for kind in ["weight", "bias"] if shape.attention_bias else ["weight"]:
            fused = [r[f"{p}self_attn.qkv_proj.{kind}"] for r in ranks]
            full[f"{p}self_attn.q_proj.{kind}"] = torch.cat([f[:q_rows] for f in fused])
            full[f"{p}self_attn.k_proj.{kind}"] = torch.cat([fused[r][q_rows : q_rows + kv_rows] for _, r in kv_owner])
            full[f"{p}self_attn.v_proj.{kind}"] = torch.cat([fused[r][q_rows + kv_rows :] for _, r in kv_owner])
        full[f"{p}self_attn.o_proj.weight"] = torch.cat([r[f"{p}self_attn.o_proj.weight"] for r in ranks], dim=1)
        for name in ("self_attn.o_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if p + name in ranks[0]:
                full[p + name] = ranks[0][p + name]
        full[f"{p}mlp.gate_proj.weight"] = torch.cat([r[f"{p}mlp.gate_up_proj.weight"][:inter] for r in ranks])
        full[f"{p}mlp.up_proj.weight"] = torch.cat([r[f"{p}mlp.gate_up_proj.weight"][inter:] for r in ranks])
        full[f"{p}mlp.down_proj.weight"] = torch.cat([r[f"{p}mlp.down_proj.weight"] for r in ranks], dim=1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            full[f"{p}{norm}.weight"] = ranks[0][f"{p}{norm}.weight"]
    full["model.norm.weight"] = ranks[0]["model.norm.weight"]
    if not shape.tie_word_embeddings:
        full["lm_head.weight"] = torch.cat([r["lm_head.weight"] for r in ranks])[: shape.vocab_size]
    return full


def build_rank(
    full: dict[str, torch.Tensor], shape: ModelShape, fsdp_world: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    outputs = {name: torch.zeros(dims) for name, dims in tp_parameter_shapes(shape, tp).items()}
    rows = {name: t.shape[0] for name, t in full.items()}
    apply_copies(reshard_plan(tp_slices(shape, tp, rank), rows, fsdp_world), fsdp_shards(full, fsdp_world), outputs)
    return outputs


@settings(max_examples=60)
@given(shapes_and_tp(), st.integers(1, 8), st.integers(0, 2**16))
def test_tp_shards_built_from_fsdp_shards_reassemble_to_the_full_tensors(case, fsdp_world, seed):
    shape, tp = case
    full = random_full(shape, seed)
    ranks = [build_rank(full, shape, fsdp_world, tp, r) for r in range(tp)]
    merged = merge_ranks(ranks, shape, tp)
    assert merged.keys() == full.keys()
    for name in full:
        assert torch.equal(merged[name], full[name]), name


@settings(max_examples=60)
@given(shapes_and_tp(), st.integers(1, 8), st.integers(0, 2**16))
def test_each_rank_matches_vllm_slicing_conventions(case, fsdp_world, seed):
    shape, tp = case
    full = random_full(shape, seed)
    for rank in range(tp):
        built = build_rank(full, shape, fsdp_world, tp, rank)
        expected = vllm_reference_shard(full, shape, tp, rank)
        assert built.keys() == expected.keys()
        for name in expected:
            assert torch.equal(built[name], expected[name]), (name, rank)


@settings(max_examples=60)
@given(shapes_and_tp(), st.integers(1, 8))
def test_each_rank_receives_only_its_own_bytes(case, fsdp_world):
    """Summed over ranks, the plan moves the model's bytes once plus only what replication
    (norms, KV heads when tp > kv_heads) and vocabulary padding require: never tp × the model."""
    shape, tp = case
    rows = {name: dims[0] for name, dims in hf_parameter_shapes(shape).items()}
    moved = 0
    for rank in range(tp):
        for copy in reshard_plan(tp_slices(shape, tp, rank), rows, fsdp_world):
            width = copy.cols[1] - copy.cols[0] if copy.cols else 1
            moved += (copy.rows[1] - copy.rows[0]) * width
    h, d = shape.hidden_size, shape.head_dim
    per_layer = 2 * h + shape.output_bias * h + shape.qk_norm * 2 * d
    replicated = shape.num_layers * per_layer + h
    kv = 2 * shape.num_layers * shape.kv_heads_per_rank(tp) * d * (h + shape.attention_bias)
    kv_total = kv * tp
    kv_unique = 2 * shape.num_layers * shape.num_kv_heads * d * (h + shape.attention_bias)
    total = sum(torch.Size(dims).numel() for dims in hf_parameter_shapes(shape).values())
    assert moved == total + (tp - 1) * replicated + (kv_total - kv_unique)
    per_rank = sum(torch.Size(dims).numel() for dims in tp_parameter_shapes(shape, tp).values())
    vocab_tensors = 1 if shape.tie_word_embeddings else 2
    assert per_rank * tp == moved + vocab_tensors * (shape.padded_vocab - shape.vocab_size) * h


@given(st.integers(0, 1000), st.integers(1, 8))
def test_fsdp_rows_partition_dim0_like_torch_chunk(rows, world):
    tensor = torch.arange(rows)
    chunks = tensor.chunk(world) if rows else ()
    for rank in range(world):
        start, end = fsdp_rows(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert tensor[start:end].tolist() == expected


def test_padding_rows_are_zero_and_tied_embeddings_send_no_lm_head():
    shape = ModelShape(
        hidden_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        intermediate_size=8,
        vocab_size=14,
        num_layers=1,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    full = random_full(shape, 0)
    last = shard_full_tensors(full, shape, 2, 1)
    assert "lm_head.weight" not in last
    assert last["model.embed_tokens.weight"].shape == (32, 8)
    assert torch.count_nonzero(last["model.embed_tokens.weight"]) == 0  # vocab 14 < 32: rank 1 holds only padding
    first = shard_full_tensors(full, shape, 2, 0)
    assert torch.equal(first["model.embed_tokens.weight"][:14], full["model.embed_tokens.weight"])
    assert torch.count_nonzero(first["model.embed_tokens.weight"][14:]) == 0


def test_full_layout_is_the_identity():
    shape = ModelShape(
        hidden_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        intermediate_size=8,
        vocab_size=14,
        num_layers=2,
        tie_word_embeddings=False,
        attention_bias=False,
        family="llama",
    )
    full = random_full(shape, 1)
    outputs = {name: torch.zeros_like(t) for name, t in full.items()}
    apply_copies(
        reshard_plan(full_slices(shape), {n: t.shape[0] for n, t in full.items()}, 3), fsdp_shards(full, 3), outputs
    )
    assert all(torch.equal(outputs[n], full[n]) for n in full)


@pytest.mark.parametrize(
    ("kwargs", "tp", "message"),
    [
        ({"num_heads": 6}, 4, "6 attention heads do not split over 4 ranks"),
        ({"intermediate_size": 6}, 4, "intermediate size 6 does not split over 4 ranks"),
        ({"num_kv_heads": 3, "num_heads": 24}, 8, "8 ranks cannot replicate"),
        ({}, 0, "at least 1"),
    ],
)
def test_layouts_that_do_not_split_are_refused_with_the_reason(kwargs, tp, message):
    base = dict(
        hidden_size=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=2,
        intermediate_size=8,
        vocab_size=14,
        num_layers=1,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    shape = ModelShape(**{**base, **kwargs})
    with pytest.raises(ValueError, match=message):
        tp_parameter_shapes(shape, tp)


def test_unknown_family_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"'gpt2' has no layout rules; supported: qwen2 \(Qwen2ForCausalLM\), llama"):
        ModelShape(8, 4, 2, 2, 8, 14, 1, True, True, family="gpt2")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention_bias", [False, True])
def test_family_tensors(family, attention_bias):
    """Qwen2's q/k/v biases come without an o_proj bias; Llama's and Qwen3's attention_bias puts one
    on all four; Qwen3 alone has q/k norms of head_dim, replicated on every rank."""
    shape = ModelShape(
        hidden_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        intermediate_size=8,
        vocab_size=14,
        num_layers=1,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
        family=family,
    )
    hf = hf_parameter_shapes(shape)
    tp = tp_parameter_shapes(shape, 2)
    p = "model.layers.0.self_attn."
    assert (p + "q_proj.bias" in hf) == attention_bias
    assert (p + "o_proj.bias" in hf) == (attention_bias and family != "qwen2")
    assert (p + "q_norm.weight" in hf) == (p + "k_norm.weight" in hf) == (family == "qwen3")
    for name in ("o_proj.bias", "q_norm.weight", "k_norm.weight"):
        assert tp.get(p + name) == hf.get(p + name)
