"""The supported model families: the layout rules name exactly the parameters of each family's HF
model (real configurations and scaled-down ones, tied or untied, with or without attention
biases), and every component refuses another architecture at start, listing the supported ones."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, MistralConfig

from rlmesh.models.families import FAMILIES, UnsupportedModel, check_model_dir, supported_family
from rlmesh.models.loading import load_causal_lm
from rlmesh.models.random_init import real_config, scaled_config, write_random_model
from rlmesh.models.tp_layout import ModelShape, hf_parameter_shapes, tp_parameter_shapes
from services.rollout.config import VllmConfig
from services.rollout.torch.engine import TorchEngine
from services.rollout.vllm_engine import VllmEngine
from services.trainer.config import TrainerConfig
from services.trainer.ranks.distributed import RankInfo
from services.trainer.ranks.policy import ShardedPolicy

SUPPORTED = "supported: qwen2 (Qwen2ForCausalLM), llama (LlamaForCausalLM), qwen3 (Qwen3ForCausalLM)"


def hf_config(values: dict):
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def meta_parameters(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_layout_names_every_parameter_of_the_real_configuration(family):
    config = hf_config(real_config(family))
    shape = ModelShape.from_hf_config(config)
    assert shape.family == family
    assert hf_parameter_shapes(shape) == meta_parameters(config)
    assert sum(torch.Size(d).numel() for d in tp_parameter_shapes(shape, 2).values()) > 0


def test_the_real_shapes():
    qwen25 = ModelShape.from_hf_config(hf_config(real_config("qwen2")))
    assert (
        qwen25.hidden_size,
        qwen25.num_layers,
        qwen25.num_heads,
        qwen25.num_kv_heads,
        qwen25.intermediate_size,
        qwen25.vocab_size,
        qwen25.tie_word_embeddings,
        qwen25.attention_bias,
    ) == (896, 24, 14, 2, 4864, 151936, True, True)
    assert sum(torch.Size(d).numel() for d in hf_parameter_shapes(qwen25).values()) == 494_032_768
    qwen3 = ModelShape.from_hf_config(hf_config(real_config("qwen3")))
    assert qwen3.head_dim == 128 != qwen3.hidden_size // qwen3.num_heads
    assert qwen3.qk_norm and not qwen3.attention_bias


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_the_layout_names_every_parameter_of_scaled_down_models(family, tied, attention_bias):
    config = hf_config(scaled_config(family, tie_word_embeddings=tied, attention_bias=attention_bias))
    shape = ModelShape.from_hf_config(config)
    assert shape.tie_word_embeddings == tied
    assert shape.attention_bias == (attention_bias or family == "qwen2")
    assert hf_parameter_shapes(shape) == meta_parameters(config)


def test_a_random_model_folder_loads_with_its_tokenizer(tmp_path):
    directory = write_random_model(tmp_path / "qwen3", scaled_config("qwen3", tie_word_embeddings=False), seed=3)
    assert check_model_dir(directory).name == "qwen3"
    model = load_causal_lm(directory)
    assert model.config.vocab_size == 150 and not model.config.tie_word_embeddings
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert not torch.equal(norm, torch.ones_like(norm)), "norm weights should not be the constant HF initialises"
    assert (directory / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_random_model(tmp_path / "small", scaled_config("llama", vocab_size=8))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            GPT2Config(architectures=["GPT2LMHeadModel"]).to_dict(),
            f"model: architecture 'GPT2LMHeadModel' (model_type 'gpt2') is not supported; {SUPPORTED}",
        ),
        (
            MistralConfig(architectures=["MistralForCausalLM"], sliding_window=4096).to_dict(),
            f"architecture 'MistralForCausalLM' (model_type 'mistral') is not supported; {SUPPORTED}",
        ),
        (
            {**scaled_config("llama"), "architectures": ["LlamaForSequenceClassification"]},
            "architecture 'LlamaForSequenceClassification' (model_type 'llama') is not supported",
        ),
        ({"model_type": "gpt_neox"}, "architecture (none named) (model_type 'gpt_neox') is not supported"),
        (scaled_config("llama", mlp_bias=True), "llama with mlp_bias = true is not supported"),
        (
            scaled_config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1),
            "qwen2 with sliding-window attention",
        ),
        (
            hf_config(scaled_config("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=0)),
            "qwen3 with sliding-window",
        ),
    ],
)
def test_other_architectures_and_options_are_refused(values, message):
    with pytest.raises(UnsupportedModel) as caught:
        supported_family(values)
    assert message in str(caught.value)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(
        directory
    )
    return directory


def test_every_component_refuses_an_unsupported_folder_at_start(gpt2_dir):
    expected = (
        f"model folder {gpt2_dir}: architecture 'GPT2LMHeadModel' (model_type 'gpt2') is not supported; {SUPPORTED}"
    )
    with pytest.raises(UnsupportedModel) as caught:
        TorchEngine(gpt2_dir)
    assert str(caught.value) == expected
    with pytest.raises(UnsupportedModel) as caught:
        VllmEngine(gpt2_dir, 4, 0, VllmConfig())
    assert str(caught.value) == expected
    rank = RankInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), control=None)
    with pytest.raises(UnsupportedModel) as caught:
        ShardedPolicy(TrainerConfig(model_dir=str(gpt2_dir)), rank)
    assert str(caught.value) == expected
    config = json.loads((gpt2_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="'gpt2' has no layout rules; supported: qwen2"):
        ModelShape(8, 2, 2, 4, 32, 16, 1, True, False, family=config["model_type"])
