"""One tensor-parallel rank's model: a HF causal LM built for its share of the heads, the MLP and
the padded vocabulary, whose row-parallel outputs, embeddings and logits meet through gloo."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlmesh.models.loading import weights_dtype
from rlmesh.models.tp_layout import ModelShape, tp_parameter_shapes

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
"""How long a rank waits for the others at rendezvous and in one collective before failing."""


class Collectives:
    """The collectives of one engine's ranks; with a single rank there is nothing to exchange."""

    def __init__(self, group: dist.ProcessGroupGloo | None, rank: int, size: int) -> None:
        self.group = group
        self.rank = rank
        self.size = size

    @classmethod
    def single(cls) -> Collectives:
        return cls(None, 0, 1)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int) -> Collectives:
        """Joins the group; blocks until every rank joined. The group is not torch's default one,
        so several engines can live in one process (tests)."""
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = COLLECTIVE_TIMEOUT
        return cls(dist.ProcessGroupGloo(dist.PrefixStore("rlmesh-tp", store), rank, size, options), rank, size)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place."""
        if self.group is not None:
            self.group.allreduce([tensor]).wait()

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the last dimension, in rank order."""
        if self.group is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class VocabParallelEmbedding(torch.nn.Embedding):
    """Rows [start, start + rows) of the padded vocabulary; ids outside embed to zero on this rank
    and the sum over ranks is the full embedding."""

    def __init__(self, rows: int, hidden: int, start: int, collectives: Collectives, dtype: torch.dtype) -> None:
        super().__init__(rows, hidden, dtype=dtype)
        self.start = start
        self.collectives = collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.collectives.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        self.collectives.all_reduce(out)
        return out


class ParallelLMHead(torch.nn.Linear):
    """This rank's rows of the padded vocabulary; the logits of all ranks are gathered and cut to
    the real vocabulary, so every rank returns full logits."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, collectives: Collectives, dtype: torch.dtype) -> None:
        super().__init__(hidden, rows, bias=False, dtype=dtype)
        self.vocab_size = vocab_size
        self.collectives = collectives

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather_last(F.linear(hidden, self.weight))[..., : self.vocab_size]


class RowParallelLinear(torch.nn.Linear):
    """This rank's slice of the input dimension: outputs are partial sums, added up over the ranks.
    A bias (whole on every rank) is added by rank 0 alone, before the sum, as vLLM does."""

    def __init__(self, linear: torch.nn.Linear, collectives: Collectives) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.collectives = collectives

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = F.linear(inputs, self.weight, self.bias if self.collectives.rank == 0 else None)
        self.collectives.all_reduce(out)
        return out


def build_rank_model(config: PretrainedConfig, collectives: Collectives) -> PreTrainedModel:
    """The HF model of rank `collectives.rank` (weights left uninitialised; see `RankLayout.load`). HF's own
    attention, RoPE, q/k norms and KV cache run on the rank's heads."""
    # Imported here: transformers' modeling code costs seconds to import, and an instance whose
    # engine builds no model (synthetic) need not pay for it.
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    tp, rank = collectives.size, collectives.rank
    shape = ModelShape.from_hf_config(config)
    shape.check_tp(tp)
    rank_config = copy.deepcopy(config)
    rank_config.num_attention_heads = shape.num_heads // tp
    rank_config.num_key_value_heads = shape.kv_heads_per_rank(tp)
    rank_config.intermediate_size = shape.intermediate_size // tp
    rank_config.head_dim = shape.head_dim
    rank_config.vocab_size = shape.padded_vocab // tp
    # Only used for training gradients, and it may lie outside this rank's vocabulary rows.
    rank_config.pad_token_id = None
    dtype = weights_dtype(config)
    rows = shape.padded_vocab // tp
    # Every parameter is overwritten by the rank's payload: a random init would only cost time
    # (about 5 s per copy of half of a 0.5 B model).
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(rank_config, dtype=dtype)
        model.model.embed_tokens = VocabParallelEmbedding(rows, shape.hidden_size, rank * rows, collectives, dtype)
        model.lm_head = ParallelLMHead(rows, shape.hidden_size, shape.vocab_size, collectives, dtype)
    if shape.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if tp > 1:
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, collectives)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, collectives)
    model.eval()
    return model


class RankLayout:
    """Where the tensors of a rank's payload go in the rank model: fused qkv and gate_up are split
    into the HF modules' q/k/v and gate/up parameters, the rest maps by name."""

    def __init__(self, shape: ModelShape, tp: int) -> None:
        self.shapes = tp_parameter_shapes(shape, tp)
        d = shape.head_dim
        q, kv, inter = shape.num_heads // tp * d, shape.kv_heads_per_rank(tp) * d, shape.intermediate_size // tp
        self.targets: dict[str, list[tuple[str, int, int]]] = {}
        """payload tensor -> (rank model parameter, first row, end row)"""
        fused = {
            "qkv_proj": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
            "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
        }
        for name, dims in self.shapes.items():
            module = name.split(".")[-2]
            parts = fused.get(module, ((module, 0, dims[0]),))
            self.targets[name] = [(name.replace(f".{module}.", f".{part}."), start, end) for part, start, end in parts]

    def check(self, model: torch.nn.Module) -> None:
        """Raises ValueError unless the payload fills every parameter of `model` exactly."""
        params = dict(model.named_parameters())
        covered = {target for entries in self.targets.values() for target, _, _ in entries}
        if covered != params.keys():
            odd = sorted(covered ^ params.keys())[:5]
            raise ValueError(f"the model's parameters do not follow the tensor-parallel layout rules: {odd}")
        for name, entries in self.targets.items():
            for target, start, end in entries:
                want = (end - start, *self.shapes[name][1:])
                if tuple(params[target].shape) != want:
                    raise ValueError(f"{target}: shape {tuple(params[target].shape)}, the layout gives {want}")

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        for target, start, end in self.targets[name]:
            params[target].copy_(tensor[start:end])
