"""A broken instance is isolated, not retried forever: real manager and rollout processes, one
instance whose engine fails every request after its first few (as one whose engine core died
while its server stayed up). It is quarantined, every sample finishes on the healthy one, nothing
is lost or duplicated, and the failures cost a few log lines, not one per request."""

import json
import shutil

from bench.common import BenchMesh, InstanceSpec, check_exactly_once
from rlmesh.common.v1 import common_pb2
from rlmesh.logging import REPEAT_WINDOW_SECONDS, REPEATS_PER_WINDOW

SYNTHETIC = {
    "ENGINE__SYNTHETIC__LENGTH": "uniform",
    "ENGINE__SYNTHETIC__MEAN_TOKENS": "20",
    "ENGINE__SYNTHETIC__THROUGHPUT_TOKENS_PER_SECOND": "20000",
    "ENGINE__SYNTHETIC__MIN_STEP_SECONDS": "0.001",
    "ENGINE__SYNTHETIC__STREAM_INTERVAL": "4",
    "ENGINE__MAX_BATCH_SIZE": "64",
}
STEPS, PROMPTS, GROUP_SIZE = 4, 32, 4
LOG_LIMIT_BYTES = 1 << 20


def lines_of(path, event: str) -> list[dict]:
    return [line for line in map(json.loads, path.read_text().splitlines()) if line.get("event") == event]


async def test_an_instance_failing_every_request_is_quarantined_and_its_samples_finish_elsewhere():
    broken = InstanceSpec("broken", settings={**SYNTHETIC, "ENGINE__SYNTHETIC__FAIL_AFTER_REQUESTS": "3"})
    async with BenchMesh([InstanceSpec("healthy", settings=SYNTHETIC), broken]) as mesh:
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=40)
        seconds, finished_on_broken = 0.0, 0
        for step in range(STEPS):
            result = await mesh.run_step(f"step{step}", PROMPTS, GROUP_SIZE, sampling)
            seconds += result.seconds
            assert check_exactly_once(result, PROMPTS, GROUP_SIZE) == (0, 0)
            assert all(sample.token_ids for sample in result.samples)
            finished_on_broken += sum(sample.instance_ids[-1] == "broken" for sample in result.samples)
        # Its engine served its first 3 requests; every other sample finished on the healthy one.
        assert finished_on_broken <= 3
        status = {i.instance_id: i for i in (await mesh.status()).instances}
        assert status["broken"].quarantines >= 1 and status["healthy"].quarantines == 0
        manager_log, broken_log = mesh.log_dir / "manager.log", mesh.log_dir / "broken.log"
        quarantined = lines_of(manager_log, "instance quarantined: its requests fail one after another")
        assert quarantined and quarantined[0]["instance_id"] == "broken" and quarantined[0]["seconds"] == 1.0
        # Hundreds of requests failed; each event is written a few times per window at most.
        windows = seconds / REPEAT_WINDOW_SECONDS + 1
        for path, event in ((manager_log, "request failed; it continues elsewhere"), (broken_log, "request failed")):
            assert len(lines_of(path, event)) <= REPEATS_PER_WINDOW * windows
            assert path.stat().st_size < LOG_LIMIT_BYTES
    # Kept when an assertion failed: the logs explain it.
    shutil.rmtree(mesh.log_dir, ignore_errors=True)
