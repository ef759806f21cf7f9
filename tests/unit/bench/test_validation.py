"""The simulator's check against real `rlmesh up` runs (bench/simulation/calibration.py and
validation.py): what it reads from a run's metrics and the weights service's log, the scenario it
builds from them, the job it runs, and the simulator's announcement and push delays."""

import json
from datetime import UTC, datetime

import pytest

from bench.common import RESULTS
from bench.scale import VALIDATION_TARGET, split_result
from bench.simulation import scenarios
from bench.simulation.calibration import DecodeSpeed, calibrate
from bench.simulation.trainer import TrainerModel
from bench.simulation.validation import SYNTHETIC, instance_model, job_settings
from bench.simulation.world import Scenario, Simulation
from rlmesh.job import Job, load_job, parse_value

START = 1_800_000_000.0
SAMPLES = 128


def step_record(step: int, seconds: float, wait: float, length: float) -> dict:
    return {
        "step": step,
        "time": START + step,
        "step_seconds": seconds,
        "rollout_wait_seconds": wait,
        "response_length": length,
        "weight_version": float(step),
    }


def pushed(version: int, instance: str, after: float) -> str:
    stamp = datetime.fromtimestamp(START + version + after, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": "pushed", "instance_id": instance, "weight_version": version, "timestamp": stamp})


def run_of(steps: int = 10) -> tuple[list[dict], list[str]]:
    """A run whose step s waits s/100 s, trains 0.2 s on 8-token responses, is announced 0.05 s and
    served by instance a 0.03 s, by b 0.03 + s/1000 s after it ends."""
    records, log = [], [json.dumps({"event": "version stored", "weight_version": 1})]
    for step in range(1, steps + 1):
        records.append(step_record(step, 0.2 + step / 100, step / 100, 8.0))
        records.append({"step": step, "time": START + step + 0.05, "publish_seconds": 0.04})
        log += [pushed(step, "a", 0.03), pushed(step, "b", 0.03 + step / 1000)]
    return records, log


def test_a_run_gives_the_trainer_busy_time_per_token_and_the_weight_plane_delays_of_its_measured_steps():
    records, log = run_of()
    calibration = calibrate(records, log, SAMPLES)
    assert calibration.steps == 10
    assert calibration.measured_steps == [5, 6, 7, 8, 9]
    assert calibration.real_step_seconds == pytest.approx([0.25, 0.26, 0.27, 0.28, 0.29])
    assert calibration.real_wait_seconds == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09])
    assert calibration.trainer_seconds_per_token == pytest.approx(0.2 / (8 * SAMPLES))
    assert calibration.response_length_mean == 8.0
    assert calibration.announce_seconds == pytest.approx(0.05)
    assert calibration.shared_push_seconds == pytest.approx((0.03, 0.03), abs=1e-4)
    assert calibration.push_seconds == pytest.approx((0.0, 0.009), abs=1e-4)
    assert sorted(calibration.push_delays) == [5, 6, 7, 8, 9]


def test_the_real_mesh_is_the_default_job_s_step_with_the_run_s_speeds_and_no_declared_knee():
    records, log = run_of()
    calibration = calibrate(records, log, SAMPLES)
    job = Job()
    instance = instance_model("synthetic", job, calibration, None)
    scenario = scenarios.real_mesh(instance, calibration, 3, job)
    assert scenario.fleet == 3 and scenario.steps == 10
    assert scenario.max_staleness == job.algorithm.max_staleness
    assert (scenario.trainer.prompts_per_step, scenario.trainer.group_size) == (16, 8)
    assert scenario.trainer.max_tokens == job.tasks[0].max_tokens
    assert scenario.trainer.announce_seconds == calibration.announce_seconds
    assert scenario.push_seconds == calibration.push_seconds
    assert instance.throughput == SYNTHETIC.throughput_tokens_per_second
    assert instance.lengths == SYNTHETIC and instance.declared_saturation_batch_size == 0
    torch = instance_model("torch", job, calibration, DecodeSpeed(1000.0, 128, 16000.0))
    assert torch.min_step_seconds == pytest.approx(1e-3) and torch.throughput == 16000.0
    assert torch.lengths.length == "uniform" and torch.lengths.mean_tokens == 8.0
    assert torch.stream_interval == job.rollout.engine.stream_interval


def test_the_synthetic_validation_job_is_a_job_rlmesh_up_takes():
    settings = job_settings("synthetic", 30)
    job, _ = load_job(None, {key: parse_value(value) for key, value in (s.split("=", 1) for s in settings)})
    assert job.rollout.engine.kind == "synthetic"
    assert job.rollout.engine.synthetic == SYNTHETIC
    assert job.algorithm.eval_every == job.algorithm.checkpoint_every == 30
    assert not any("engine" in setting for setting in job_settings("torch", 30))


def timeline(scenario: Scenario) -> tuple[list[float], list[tuple[float, int]], dict[str, dict[int, float]]]:
    """The step ends, (time, version) as the manager learned each published version, and when each
    instance first reported each version."""
    simulation = Simulation(scenario, "steady", seed=3)
    published, switched = [], {}
    publish, heartbeat = simulation.state.publish, simulation.state.heartbeat

    def learn(version, *args, **kwargs):
        published.append((simulation.now, version))
        return publish(version, *args, **kwargs)

    def beat(instance_id, version, *args, **kwargs):
        switched.setdefault(instance_id, {}).setdefault(version, simulation.now)
        return heartbeat(instance_id, version, *args, **kwargs)

    simulation.state.publish, simulation.state.heartbeat = learn, beat
    simulation.run()
    return simulation.trainer.accounts.step_ends, published, switched


def test_the_manager_learns_a_version_its_announcement_after_the_step_and_pushes_share_their_upload():
    instance = scenarios.synthetic_instance(SYNTHETIC, 256)
    trainer = TrainerModel(4, 2, 12, seconds_per_token=0.01, announce_seconds=0.05)
    scenario = Scenario(
        fleet=3,
        instance=instance,
        trainer=trainer,
        steps=4,
        max_staleness=1,
        tick_seconds=0.002,
        push_seconds=(0.0, 0.004),
        shared_push_seconds=(0.1, 0.2),
    )
    ends, published, switched = timeline(scenario)
    # The run ends with its last step: the last version is never announced nor pushed.
    assert [version for _, version in published] == [1, 2, 3]
    for (at, _), end in zip(published, ends, strict=False):
        assert at - end == pytest.approx(0.05, abs=0.003)
    for version, end in enumerate(ends[:-1], start=1):
        times = [by_version[version] for by_version in switched.values()]
        assert len(times) == 3
        assert 0.1 <= min(times) - end <= 0.2 + 0.003
        assert max(times) - min(times) <= 0.004 + 0.003


def test_either_part_of_the_scale_results_can_be_run_again_keeping_the_other():
    result = json.loads((RESULTS / "scale.json").read_text())
    fleets, validation = split_result(result)
    assert VALIDATION_TARGET not in fleets["targets"] and "validation" not in fleets["settings"]
    assert list(validation["targets"]) == [VALIDATION_TARGET]
    assert {**fleets["targets"], **validation["targets"]} == result["targets"]
    assert {**fleets["settings"], **validation["settings"]} == result["settings"]
    assert (fleets["figures"], validation["baseline"], validation["ratios"]) == (
        result["figures"],
        result["baseline"],
        result["ratios"],
    )
