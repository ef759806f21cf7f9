"""Tensor-parallel layout rules of the supported families (Qwen2, Llama, Qwen3; vLLM's conventions)
and the resharding plan from FSDP shards (rows of dim 0) to the bytes each tensor-parallel rank needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rlmesh.models.families import Family, family_named, supported_family

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of embed_tokens and lm_head to a multiple of this before splitting it."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the layout rules need to know of a model."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v carry a bias (and, outside Qwen2, o_proj too: see `Family.fixed_qkv_bias`)."""
    family: str = "qwen2"

    def __post_init__(self) -> None:
        family_named(self.family)
        for field_name in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_layers",
        ):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be at least 1, got {getattr(self, field_name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING

    @property
    def rules(self) -> Family:
        return family_named(self.family)

    @property
    def output_bias(self) -> bool:
        """o_proj carries a bias (full on every rank, added once after the row-parallel sum)."""
        return self.attention_bias and not self.rules.fixed_qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.rules.qk_norm

    @classmethod
    def from_hf_config(cls, config, source: str = "model") -> ModelShape:
        """Raises UnsupportedModel (a ValueError) for a family or option without layout rules."""
        family = supported_family(config, source)
        heads = int(config.num_attention_heads)
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            attention_bias=family.fixed_qkv_bias or bool(getattr(config, "attention_bias", False)),
            family=family.name,
        )

    def check_tp(self, tp: int) -> None:
        """Raises ValueError unless the model splits evenly over `tp` ranks."""
        if tp < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{self.num_heads} attention heads do not split over {tp} ranks")
        if self.intermediate_size % tp:
            raise ValueError(f"intermediate size {self.intermediate_size} does not split over {tp} ranks")
        if self.padded_vocab % tp:
            raise ValueError(f"padded vocabulary {self.padded_vocab} does not split over {tp} ranks")
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            raise ValueError(f"{tp} ranks cannot replicate {self.num_kv_heads} KV heads evenly")
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split over {tp} ranks")

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(1, self.num_kv_heads // tp)

    def kv_head_start(self, tp: int, rank: int) -> int:
        """First KV head of a rank; when there are fewer KV heads than ranks each is replicated."""
        if tp <= self.num_kv_heads:
            return rank * self.num_kv_heads // tp
        return rank // (tp // self.num_kv_heads)


def hf_parameter_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model under its HF name, tied ones once (as the trainer has them)."""
    h, d = shape.hidden_size, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (shape.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (shape.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (shape.num_kv_heads * d, h)
        if shape.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (shape.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (shape.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (shape.num_kv_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, shape.num_heads * d)
        if shape.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if shape.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (shape.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (shape.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, shape.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return shapes


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows [rows) and columns [cols) of a full tensor that land at row `dest_row` of a rank's
    tensor `dest` (all of its columns). `cols` is None for 1-D tensors and whole rows."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    dest: str
    dest_row: int


def tp_parameter_shapes(shape: ModelShape, tp: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one rank (the same shapes on every rank), in payload order."""
    shape.check_tp(tp)
    h, d = shape.hidden_size, shape.head_dim
    q_rows = shape.num_heads // tp * d
    kv_rows = shape.kv_heads_per_rank(tp) * d
    inter = shape.intermediate_size // tp
    vocab_rows = shape.padded_vocab // tp
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_rows, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.qkv_proj.weight"] = (q_rows + 2 * kv_rows, h)
        if shape.attention_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = (q_rows + 2 * kv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if shape.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if shape.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_rows, h)
    return shapes


def tp_slices(shape: ModelShape, tp: int, rank: int) -> list[Slice]:
    """Where every byte of rank `rank`'s tensors comes from. Rows no slice covers (the vocabulary
    padding) are zero."""
    shape.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside [0, {tp})")
    h, d = shape.hidden_size, shape.head_dim
    q_rows = shape.num_heads // tp * d
    kv_rows = shape.kv_heads_per_rank(tp) * d
    kv_start = shape.kv_head_start(tp, rank) * d
    inter = shape.intermediate_size // tp
    vocab_rows = shape.padded_vocab // tp
    vocab_start = rank * vocab_rows
    vocab_end = min(vocab_start + vocab_rows, shape.vocab_size)
    slices: list[Slice] = []

    def vocab(source: str, dest: str) -> None:
        if vocab_end > vocab_start:
            slices.append(Slice(source, (vocab_start, vocab_end), (0, h), dest, 0))

    vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        qkv = [
            ("q_proj", rank * q_rows, q_rows, 0),
            ("k_proj", kv_start, kv_rows, q_rows),
            ("v_proj", kv_start, kv_rows, q_rows + kv_rows),
        ]
        for proj, start, rows, at in qkv:
            slices.append(
                Slice(f"{p}self_attn.{proj}.weight", (start, start + rows), (0, h), f"{p}self_attn.qkv_proj.weight", at)
            )
            if shape.attention_bias:
                slices.append(
                    Slice(f"{p}self_attn.{proj}.bias", (start, start + rows), None, f"{p}self_attn.qkv_proj.bias", at)
                )
        slices.append(
            Slice(
                f"{p}self_attn.o_proj.weight",
                (0, h),
                (rank * q_rows, (rank + 1) * q_rows),
                f"{p}self_attn.o_proj.weight",
                0,
            )
        )
        if shape.output_bias:
            slices.append(Slice(f"{p}self_attn.o_proj.bias", (0, h), None, f"{p}self_attn.o_proj.bias", 0))
        if shape.qk_norm:
            for norm in ("q_norm", "k_norm"):
                slices.append(Slice(f"{p}self_attn.{norm}.weight", (0, d), None, f"{p}self_attn.{norm}.weight", 0))
        slices.append(
            Slice(
                f"{p}mlp.gate_proj.weight", (rank * inter, (rank + 1) * inter), (0, h), f"{p}mlp.gate_up_proj.weight", 0
            )
        )
        slices.append(
            Slice(
                f"{p}mlp.up_proj.weight",
                (rank * inter, (rank + 1) * inter),
                (0, h),
                f"{p}mlp.gate_up_proj.weight",
                inter,
            )
        )
        slices.append(
            Slice(f"{p}mlp.down_proj.weight", (0, h), (rank * inter, (rank + 1) * inter), f"{p}mlp.down_proj.weight", 0)
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            slices.append(Slice(f"{p}{norm}.weight", (0, h), None, f"{p}{norm}.weight", 0))
    slices.append(Slice("model.norm.weight", (0, h), None, "model.norm.weight", 0))
    if not shape.tie_word_embeddings:
        vocab("lm_head.weight", "lm_head.weight")
    return slices


def full_slices(shape: ModelShape) -> list[Slice]:
    """The identity layout: every full tensor to itself (engines that slice weights themselves)."""
    return [
        Slice(name, (0, dims[0]), (0, dims[1]) if len(dims) == 2 else None, name, 0)
        for name, dims in hf_parameter_shapes(shape).items()
    ]


def fsdp_rows(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of dim 0 that FSDP2 gives `rank` (torch.chunk: ceil-sized chunks, trailing ones short or empty)."""
    chunk = -(-num_rows // world)
    return min(rank * chunk, num_rows), min((rank + 1) * chunk, num_rows)


@dataclass(frozen=True, slots=True)
class Copy:
    """Rows [rows) (relative to the shard) and columns [cols) of FSDP rank `fsdp_rank`'s shard of
    `source` go to row `dest_row` of the destination tensor `dest`."""

    fsdp_rank: int
    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    dest: str
    dest_row: int


def reshard_plan(slices: list[Slice], source_rows: Mapping[str, int], fsdp_world: int) -> list[Copy]:
    """Splits each slice by the FSDP shards that hold its rows: the copies that build one rank's
    tensors from FSDP shards, without ever assembling a full tensor."""
    copies = []
    for piece in slices:
        start, end = piece.rows
        for fsdp_rank in range(fsdp_world):
            shard_start, shard_end = fsdp_rows(source_rows[piece.source], fsdp_world, fsdp_rank)
            low, high = max(start, shard_start), min(end, shard_end)
            if low < high:
                copies.append(
                    Copy(
                        fsdp_rank,
                        piece.source,
                        (low - shard_start, high - shard_start),
                        piece.cols,
                        piece.dest,
                        piece.dest_row + low - start,
                    )
                )
    return copies


def apply_copies(
    copies: list[Copy], shards: list[Mapping[str, torch.Tensor]], outputs: Mapping[str, torch.Tensor]
) -> None:
    """Runs a plan: `shards[k]` are FSDP rank k's local tensors, `outputs` the zeroed destinations."""
    for copy in copies:
        block = shards[copy.fsdp_rank][copy.source][copy.rows[0] : copy.rows[1]]
        if copy.cols is not None:
            block = block[:, copy.cols[0] : copy.cols[1]]
        outputs[copy.dest][copy.dest_row : copy.dest_row + block.shape[0]].copy_(block)


def shard_full_tensors(
    full: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors cut from full tensors (one FSDP rank holding everything)."""
    dtype = next(iter(full.values())).dtype
    outputs = {name: torch.zeros(dims, dtype=dtype) for name, dims in tp_parameter_shapes(shape, tp).items()}
    rows = {name: tensor.shape[0] for name, tensor in full.items()}
    apply_copies(reshard_plan(tp_slices(shape, tp, rank), rows, 1), [full], outputs)
    return outputs
