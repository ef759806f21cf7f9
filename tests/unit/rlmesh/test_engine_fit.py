"""Which models the vLLM engine can serve on CPU, read from config.json alone."""

import json

from rlmesh.models.engine_fit import head_size, vllm_cpu_refusal


def test_the_head_size_is_head_dim_where_set_else_the_hidden_size_over_the_heads():
    assert head_size({"hidden_size": 64, "num_attention_heads": 4}) == 16
    assert head_size({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == 32


def test_vllm_on_cpu_refuses_a_head_size_its_attention_lacks_and_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    refusal = vllm_cpu_refusal(tmp_path)
    assert f"cannot serve {tmp_path} on CPU: its attention head size is 16" in refusal and "32, 64, 80" in refusal
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    assert vllm_cpu_refusal(tmp_path) == ""
