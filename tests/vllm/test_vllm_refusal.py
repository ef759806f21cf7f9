"""A model vLLM's CPU attention cannot serve: the vLLM rollout instance refuses it at start, naming
its head size, instead of registering and failing every request sent to it."""

from rlmesh.launch.ports import free_port
from rlmesh.models.engine_fit import VLLM_CPU_HEAD_SIZES
from tests.support.processes import stop_process_group
from tests.support.vllm_rollout import spawn_vllm_rollout

REFUSAL_SECONDS = 30


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_at_start(vllm_python, model_dir, tmp_path):
    log = tmp_path / "vllm-rollout.log"
    process, _ = spawn_vllm_rollout(vllm_python, model_dir, f"127.0.0.1:{free_port()}", log)
    try:
        code = process.wait(REFUSAL_SECONDS)
    finally:
        stop_process_group(process)
    text = log.read_text()
    assert code == 2, text
    assert f"cannot serve {model_dir} on CPU: its attention head size is 16" in text
    assert f"takes head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only" in text
