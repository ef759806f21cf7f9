"""The model families rlmesh runs (trainer, torch engine, vLLM engine, weights service), what
tensors each has, and the check that refuses any other architecture at start."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmesh.config import ConfigError


class UnsupportedModel(ConfigError):
    """A model folder or configuration of an architecture (or option) with no layout rules: a
    service given one stops at start with this message (see rlmesh.entrypoint)."""


@dataclass(frozen=True, slots=True)
class Family:
    """What the layout rules need to know of a family beyond the shape numbers."""

    name: str
    architecture: str
    """The HF causal-LM class of the family (`architectures` in config.json)."""
    fixed_qkv_bias: bool
    """q/k/v always carry a bias and o_proj never (Qwen2); otherwise the config's `attention_bias`
    puts a bias on all four projections (Llama, Qwen3)."""
    qk_norm: bool
    """An RMSNorm over head_dim on each query and key head (Qwen3): `self_attn.q_norm.weight` and
    `self_attn.k_norm.weight`, replicated on every tensor-parallel rank."""

    def label(self) -> str:
        return f"{self.name} ({self.architecture})"

    @property
    def modeling_module(self) -> str:
        """The transformers module that defines the family's model classes."""
        return f"transformers.models.{self.name}.modeling_{self.name}"


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("qwen2", "Qwen2ForCausalLM", fixed_qkv_bias=True, qk_norm=False),
        Family("llama", "LlamaForCausalLM", fixed_qkv_bias=False, qk_norm=False),
        Family("qwen3", "Qwen3ForCausalLM", fixed_qkv_bias=False, qk_norm=True),
    )
}


def supported_list() -> str:
    return ", ".join(family.label() for family in FAMILIES.values())


def family_named(name: str) -> Family:
    """The family of a layout's `family` field; raises UnsupportedModel naming the supported ones."""
    family = FAMILIES.get(name)
    if family is None:
        raise UnsupportedModel(f"model family {name!r} has no layout rules; supported: {supported_list()}")
    return family


def supported_family(config: Any, source: str = "model") -> Family:
    """The family of a HF configuration (a PretrainedConfig or config.json's dict). Raises
    UnsupportedModel, naming `source` and the supported families, for another architecture or
    for an option the layout rules and engines do not implement."""
    values: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
    model_type = values.get("model_type")
    architectures = list(values.get("architectures") or [])
    family = FAMILIES.get(model_type or "")
    # A folder of another head on the same backbone (e.g. ...ForSequenceClassification) is no causal LM.
    if family is None or (architectures and family.architecture not in architectures):
        shown = ", ".join(repr(a) for a in architectures) or "(none named)"
        raise UnsupportedModel(
            f"{source}: architecture {shown} (model_type {model_type!r}) is not supported; "
            f"supported: {supported_list()}"
        )
    if values.get("mlp_bias"):
        raise UnsupportedModel(
            f"{source}: {family.name} with mlp_bias = true is not supported (no layout rule for MLP biases)"
        )
    # The torch engine merges KV caches of full attention only; a window would need its own cache.
    if values.get("use_sliding_window") or "sliding_attention" in (values.get("layer_types") or ()):
        raise UnsupportedModel(f"{source}: {family.name} with sliding-window attention is not supported")
    return family


def is_model_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a whole HF-format model: its config, weights and tokenizer."""
    directory = Path(directory)
    return all(
        (directory / name).is_file()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def check_model_dir(directory: str | Path) -> Family:
    """The family of a HF model folder, read from its config.json alone (before any weight is loaded)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no config.json: not a HF-format model folder")
    return supported_family(json.loads(path.read_text()), source=f"model folder {directory}")
