"""Random-init model folders of each supported family, built from the family's real configuration
(scaled down, or at full size) with the character tokenizer, so tests never download a model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlmesh.models.families import FAMILIES, supported_family
from rlmesh.models.tokenizer import (
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    build_char_tokenizer,
    build_text_tokenizer,
    save_chat_tokenizer,
    save_tokenizer,
)

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
    # Llama-3.2-1B
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
    # Qwen3-0.6B: head_dim 128 is not hidden_size / heads (64).
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
}

_SMALL = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 150,
    # About 1/sqrt(hidden), as 0.02 is at the real sizes: logits spread enough for greedy
    # decoding to wander over the vocabulary instead of repeating one token.
    "initializer_range": 0.09,
}
SCALED_DOWN: dict[str, dict[str, Any]] = {
    # Each keeps its family's GQA ratio, MLP ratio and head_dim relation; vLLM's CPU attention
    # needs head_dim >= 32, and 150 tokens pad to 192, so both of two TP ranks hold real rows.
    "qwen2": {**_SMALL, "intermediate_size": 704, "num_key_value_heads": 2},
    "llama": {**_SMALL, "intermediate_size": 512, "num_key_value_heads": 1, "head_dim": 32},
    "qwen3": {**_SMALL, "intermediate_size": 384, "num_key_value_heads": 2, "head_dim": 64},
}


def real_config(family: str) -> dict[str, Any]:
    """config.json values of the family's reference model (see REAL_CONFIGS)."""
    if family not in REAL_CONFIGS:
        raise ValueError(f"no reference configuration for family {family!r}; known: {', '.join(FAMILIES)}")
    return copy.deepcopy(REAL_CONFIGS[family])


def scaled_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The reference configuration with small sizes (SCALED_DOWN), then `overrides`."""
    return {**real_config(family), **SCALED_DOWN[family], **overrides}


def write_random_model(
    directory: str | Path,
    values: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    chat: bool = False,
) -> Path:
    """Writes config.json, model.safetensors and the character tokenizer of a random-init model.
    Norm weights and biases, which HF initialises to constants, get noise too, so a norm or bias
    routed to the wrong place changes the outputs. `device`: where the random init runs (a GPU
    initialises a model of billions of parameters in seconds). `chat`: the printable-ASCII
    tokenizer with the ChatML template, `<|im_end|>` its EOS, as a chat model's folder has."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_text_tokenizer() if chat else build_char_tokenizer()
    if values["vocab_size"] < tokenizer.get_vocab_size():
        raise ValueError(
            f"vocab_size {values['vocab_size']} is smaller than the tokenizer's {tokenizer.get_vocab_size()} tokens"
        )
    bos_id, pad_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    eos_id = tokenizer.token_to_id(IM_END_TOKEN) if chat else bos_id
    values = {**values, "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    supported_family(config, f"random {model_type} model")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.mul_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(directory, safe_serialization=True)
    if chat:
        save_chat_tokenizer(tokenizer, directory, model_max_length=config.max_position_embeddings)
    else:
        save_tokenizer(tokenizer, directory)
    return directory
