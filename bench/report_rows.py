"""The rows of the benchmarks page (bench/report.py): for each results file in bench/results, what
each row reads from it, and the targets the row is judged by."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a table: what a run measured against what, read from its results.

    The texts are templates: `{path:spec}` is the value at `path` (keys joined by dots) in the
    results, or in their `section` when the row names one, formatted by `spec` (bench/report.py's
    `formatted`)."""

    result: str
    """The results' file name in bench/results, without `.json`."""
    measures: str
    figure: str
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    judged_by: tuple[str, ...] = ()
    """Keys of the results' targets (or of KEPT_TARGETS) the row is met by; none: reported only."""
    section: str = ""


KEPT_TARGETS = {
    "fuzz": {"crashes": 0, "hangs": 0, "unanswered": 0, "without_message": 0},
    "fuzz.gateway": {
        "server_errors": 0,
        "hangs": 0,
        "unanswered": 0,
        "without_message": 0,
        "misnamed_field": 0,
        "strangers_served": 0,
        "stream_errors": 0,
        "gateway_restarts": 0,
    },
    "gpu": {"parity.holds": True, "short_job.rises": True},
}
"""Targets of the runs that write none of their own (the fuzz tests assert these; bench.gpu reports)."""

SERVING = (
    Row(
        "relay",
        "tok/s via the manager to the trainer, {settings.instances} synthetic instances",
        "{figures.relay_tokens_per_second_median:s4} tok/s",
        "the torch engine: {baseline.torch_engine_tokens_per_second:s4} tok/s",
        "{ratios.relay_over_torch_engine:.1f}×",
        "≥ 10×",
        ("relay_over_torch_engine >= 10",),
    ),
    Row(
        "relay",
        "the same, the manager's journal on",
        "{figures.journaled_relay_tokens_per_second_median:s4} tok/s",
        "journal off: {figures.relay_tokens_per_second_median:s4} tok/s",
        "{ratios.journaled_over_in_memory_relay:.2f}×",
        "≥ 0.8×",
        ("journaled_over_in_memory_relay >= 0.8",),
    ),
    Row(
        "relay",
        "the same, authorization on",
        "{figures.authorized_relay_tokens_per_second_median:s4} tok/s",
        "off: {baseline.insecure_relay_tokens_per_second_median:s4} tok/s",
        "{ratios.authorized_over_insecure_relay:.3f}×",
        "≥ 0.95×",
        ("authorized_over_insecure_relay >= 0.95",),
    ),
    Row(
        "balance",
        "a step's makespan, instance speeds {settings.speeds:.2f}",
        "{figures.balanced_makespan_seconds:.1f} s",
        "ideal {figures.balanced_ideal_seconds:.1f} s; round-robin {baseline.round_robin_makespan_seconds:.1f} s",
        "{ratios.balanced_makespan_over_ideal:.3f}× ideal",
        "≤ 1.15× ideal, nothing lost",
        ("balanced_makespan_over_ideal <= 1.15", "nothing lost or duplicated"),
    ),
    Row(
        "failure",
        "a step, one of {settings.instances} instances killed at half its tokens",
        "{figures.step_seconds_with_kill:.1f} s; {figures.tokens_regenerated} tokens regenerated, "
        "{figures.samples_lost} samples lost, {figures.samples_duplicated} duplicated",
        "no failure: {baseline.step_seconds_without_failure:.1f} s",
        "{ratios.step_time_with_kill_over_without:.2f}×",
        "≤ 1.6×, none lost, duplicated or regenerated",
        ("0 regenerated, 0 lost, 0 duplicated", "step time <= 1.6x"),
    ),
)

WEIGHT_PLANE = (
    Row(
        "weights",
        "a bf16 model pushed via TCP by {settings.trainer_ranks} trainer ranks to {settings.instances} "
        "instances × TP {settings.tensor_parallel}",
        "{figures.tcp_none_gbps:.2f} GB/s",
        "a raw socket: {baseline.raw_socket_gbps:.2f} GB/s",
        "{ratios.tcp_none_vs_raw_socket:.2f}×",
        "≥ 0.8×",
        ("tcp_none_vs_raw_socket",),
    ),
    Row(
        "weights",
        "the same push as a sparse delta, {settings.changed_fraction:%0} % of values new",
        "{figures.tcp_delta_gbps:.2f} GB/s effective",
        "as above",
        "{ratios.tcp_delta_vs_raw_socket:.2f}×",
        "≥ 5×",
        ("tcp_delta_vs_raw_socket",),
    ),
    Row(
        "weights",
        "generation on both instances while pushed",
        "{figures.tokens_per_second_during_push:.1f} tok/s",
        "without a push: {figures.tokens_per_second_without_push:.1f} tok/s",
        "{ratios.generation_during_push_vs_without:.2f}×",
        "≥ 0.9×",
        ("generation_during_push_vs_without",),
    ),
)

CHECKPOINT_TARGET = "{}: normal / {} step >= 0.9 (same_run, means)"
ASYNC = (
    Row(
        "async",
        "trainer steps an hour at η = 4 against η = 0, long-tailed lengths",
        "{figures.steps_per_hour_eta4:s3} steps/h",
        "η = 0: {baseline.steps_per_hour_eta0:s3}",
        "{ratios.eta4_over_eta0:.2f}×",
        "≥ 2.8× at some η ≤ 4",
        ("eta<=4 over eta0 >= 2.8",),
    ),
    Row(
        "checkpoint",
        "a step with a background checkpoint, a {figures.larger_checkpoint_mb:s3} MB / "
        "{figures.tiny_checkpoint_mb:.1f} MB model",
        "{figures.larger_checkpoint_step_seconds_mean:.2f} s / {figures.tiny_checkpoint_step_seconds_mean:.3f} s",
        "other steps: {baseline.larger_same_run_normal_step_seconds_mean:.2f} s / "
        "{baseline.tiny_same_run_normal_step_seconds_mean:.3f} s",
        "{ratios.larger_same_run_normal_over_checkpoint_step:.2f}× / "
        "{ratios.tiny_same_run_normal_over_checkpoint_step:.2f}×",
        "≥ 0.9×",
        tuple(CHECKPOINT_TARGET.format(model, "checkpoint") for model in ("larger", "tiny")),
    ),
    Row(
        "checkpoint",
        "the step after it",
        "{figures.larger_following_step_seconds_mean:.2f} s / {figures.tiny_following_step_seconds_mean:.3f} s",
        "as above",
        "{ratios.larger_same_run_normal_over_following_step:.2f}× / "
        "{ratios.tiny_same_run_normal_over_following_step:.2f}×",
        "≥ 0.9×",
        tuple(CHECKPOINT_TARGET.format(model, "following") for model in ("larger", "tiny")),
    ),
    Row(
        "validation",
        "a step beside a background validation, {settings.rollout_instances.0} / "
        "{settings.rollout_instances.1} instances",
        "{figures.instances1_step_seconds_during_validation:.3f} s / "
        "{figures.instances2_step_seconds_during_validation:.3f} s",
        "other steps: {baseline.instances1_step_seconds_no_validation_running:.3f} s / "
        "{baseline.instances2_step_seconds_no_validation_running:.3f} s",
        "{ratios.instances1_no_validation_over_during (same run):.2f}× / "
        "{ratios.instances2_no_validation_over_during (same run):.2f}×",
        "≥ 0.9×",
        tuple(f"instances{n}_no_validation_over_during (same run) >= 0.9" for n in (1, 2)),
    ),
    Row(
        "rewards",
        "the default job, rewards from a gRPC verifier taking {settings.verifier_delay_ms_per_sample:.0f} ms a sample",
        "{figures.remote_steps_per_second:.2f} steps/s",
        "the built-in reward: {baseline.instant_steps_per_second:.2f} steps/s",
        "{ratios.remote_over_instant_throughput:.2f}×",
        "≥ 0.9×",
        ("remote_over_instant_throughput >= 0.9",),
    ),
    Row(
        "algorithms",
        "held-out reward after {settings.steps} default-task steps, by estimator",
        "`gae` (PPO, a critic) {figures.gae.held_out.600:.3f}, `rloo` {figures.rloo.held_out.600:.3f}, "
        "`reinforce_pp` {figures.reinforce_pp.held_out.600:.3f}",
        "`grpo` {figures.grpo.held_out.600:.3f}; at step 0 {figures.grpo.held_out.0:.3f}",
        "rise {ratios.gae_rise_over_grpo:.2f}×, {ratios.rloo_rise_over_grpo:.2f}×, "
        "{ratios.reinforce_pp_rise_over_grpo:.2f}× GRPO's",
        "`gae` rises ≥ 0.3",
        ("PPO + critic raises the held-out reward by >= 0.3",),
    ),
)

QUALITY_FIGURES = (
    "{figures.decoupled_eta4_final_held_out_by_seed:.3f}",
    "η = 0: {figures.decoupled_eta0_final_held_out_by_seed:.3f}",
    "mean gap {ratios.decoupled_eta4_minus_decoupled_eta0_final_mean_of_3_seeds:.3f}",
    "gap within 0.05",
    ("decoupled η=4 final >= decoupled η=0 final - 0.05, mean over 3 seeds (the target)",),
)
QUALITY = (
    Row(
        "async_quality",
        "final held-out reward, `decoupled`, η = 4, {settings.extra_settings:code}, seeds {settings.target_seeds}",
        *QUALITY_FIGURES,
    ),
    Row(
        "async_quality-one-minibatch",
        "the same, {settings.extra_settings:code}, seeds {settings.target_seeds}",
        *QUALITY_FIGURES,
    ),
)
SEED_ZERO_VARIANTS = ("async_quality-minibatches2", "async_quality-minibatches4", "async_quality-cap5")
"""Results of variants of bench.async_quality run at one seed: named on the page, given no row."""

MULTI_TURN = (
    Row(
        "agentic",
        "{settings.turns_per_episode}-turn episodes, slow environment steps, "
        "η = {settings.async_max_staleness} against η = 0",
        "{figures.async_episodes_per_second:.1f} episodes/s",
        "η = 0: {baseline.sync_episodes_per_second:.1f} episodes/s",
        "{ratios.async_over_sync_throughput:.2f}×",
        "≥ 2×",
        ("async_over_sync >= 2.0 (or >= 0.95 of a ceiling below it)",),
    ),
    Row(
        "agentic",
        "a session's second turn, torch engine, the first turn's KV cache kept",
        "{figures.second_turn_prefill_ms_with_reuse:.1f} ms to the first token",
        "full prefill: {baseline.second_turn_prefill_ms_without_reuse:.1f} ms",
        "{ratios.prefill_with_over_without_reuse:.2f}×",
    ),
    Row(
        "gateway",
        "{settings.sessions} concurrent {settings.turns}-turn sessions through the OpenAI gateway",
        "{figures.gateway_tokens_per_second:s3} tok/s",
        "through the gRPC contract: {baseline.contract_tokens_per_second:s4} tok/s",
        "{ratios.gateway_over_contract_tokens_per_second:.2f}×",
        "≥ 0.8×",
        ("gateway_over_contract_tokens_per_second >= 0.8",),
    ),
    Row(
        "gateway",
        "the manager's relay beside those sessions",
        "{figures.relay_beside_gateway_sessions_tokens_per_second_median:s4} tok/s",
        "beside the contract's: {baseline.relay_beside_contract_sessions_tokens_per_second_median:s4} tok/s",
        "{ratios.relay_beside_gateway_over_beside_contract:.3f}×",
        "≥ 0.9×",
        ("relay_beside_gateway_over_beside_contract >= 0.9",),
    ),
    Row(
        "soak",
        "resident memory over {figures.sessions:,} agent sessions via the gateway",
        "manager {figures.manager_resident_mib_end:.1f} MiB, gateway {figures.gateway_resident_mib_end:.1f} MiB",
        "after {baseline.baseline_sessions:,}: {baseline.manager_resident_mib_at_baseline:.1f}, "
        "{baseline.gateway_resident_mib_at_baseline:.1f} MiB",
        "{ratios.manager_growth:+%2} %, {ratios.gateway_growth:+%2} %",
        "< 2 % each, no agent failed",
        ("manager_growth < 0.02", "gateway_growth < 0.02", "agents_failed == 0"),
    ),
)

CHAOS_RUNS = {"chaos": "faults during the default job", "chaos-multi-turn": "faults during {settings.job:code}"}
CHAOS = tuple(
    Row(
        name,
        measures,
        "{figures.faults_survived} survived; samples {figures.samples_lost} lost, "
        "{figures.samples_duplicated} duplicated; {figures.groups_short} groups short",
        "median step {baseline.median_step_seconds:.2f} s",
        "—",
        "≥ 100 survived, none lost or duplicated, cuts rejoined",
        ("faults_survived", "samples_lost", "samples_duplicated", "cuts_not_rejoined"),
    )
    for name, measures in CHAOS_RUNS.items()
)
FAULTS = {
    "kill_rollout": "instance SIGKILL",
    "term_rollout": "instance SIGTERM",
    "stop_rollout": "instance SIGSTOP",
    "kill_weights_mid_push": "weights killed mid-push",
    "kill_manager": "manager killed",
    "cut_network": "link cut",
    "broken_engine": "broken engine",
}

FUZZ = (
    Row(
        "fuzz",
        "requests generated from the contracts, to {rpcs:len} RPCs",
        "{requests:,} requests: {crashes} crashes, {hangs} hangs, {unanswered} unanswered, "
        "{without_message} without a message",
        target="0 of each",
        judged_by=tuple(KEPT_TARGETS["fuzz"]),
    ),
    Row(
        "fuzz",
        "HTTP requests to the OpenAI gateway",
        "{requests:,} requests: {server_errors} answers of 5xx, "
        "{hangs} hangs, {strangers_served} served without their session's key",
        target="0 of each",
        judged_by=tuple(KEPT_TARGETS["fuzz.gateway"]),
        section="gateway",
    ),
)

GPU = (
    Row(
        "gpu",
        "the torch engine against HF, {parity.shape:code} shape, fp32, greedy",
        "{parity.float32.greedy_equal_alone} of {parity.prompts} sequences equal; log-probabilities within "
        "{parity.float32.max_logprob_difference:e1}",
        target="parity holds",
        judged_by=("parity.holds",),
    ),
    Row(
        "gpu",
        "a GRPO step of {sizes.samples} samples × {sizes.tokens} tokens, bf16, 0.5B / 1.5B",
        "{train_step.qwen2.5-0.5b.step_seconds:.2f} s / {train_step.qwen2.5-1.5b.step_seconds:.2f} s, "
        "{train_step.qwen2.5-0.5b.peak_memory_gib:.1f} / {train_step.qwen2.5-1.5b.peak_memory_gib:.1f} GiB",
    ),
    Row(
        "gpu",
        "weights stored to served, 0.5B / 1.5B",
        "{weight_path.qwen2.5-0.5b.stored_to_served_seconds:.2f} s / "
        "{weight_path.qwen2.5-1.5b.stored_to_served_seconds:.2f} s",
        "copy to host and socket: {weight_path.qwen2.5-0.5b.baseline.seconds:.2f} s / "
        "{weight_path.qwen2.5-1.5b.baseline.seconds:.2f} s",
        "{weight_path.qwen2.5-0.5b.ratio_to_baseline:.2f}× / {weight_path.qwen2.5-1.5b.ratio_to_baseline:.2f}×",
    ),
    Row(
        "gpu",
        "a {short_job.steps}-step job of the default task",
        "reward {short_job.reward_first:.3f} → {short_job.reward_last:.3f}",
        target="the reward rises",
        judged_by=("short_job.rises",),
    ),
)

SCALE = (
    Row(
        "scale",
        "1,000 simulated instances, burst",
        "{figures.1000_burst_of_ideal:.3f} of ideal",
        "sim ÷ real: {ratios.simulated_over_real_min:.2f}–{ratios.simulated_over_real_max:.2f}",
        "—",
        "≥ 0.9; 0 stale, lost, regenerated",
        (
            "1000 instances, burst: >= 0.9 of ideal",
            "0 staleness violations",
            "0 tokens regenerated",
            "0 samples lost or duplicated",
            "simulator within 10 % of real at 1-3 instances",
        ),
    ),
    Row(
        "cost",
        "$ per 1,000 steps, spot at 0.3× reserved, burst",
        "{figures.burst_spot_dollars_per_1000_steps:.1f} $",
        "all reserved: {baseline.reserved_dollars_per_1000_steps:.1f} $",
        "{ratios.burst_spot_over_reserved:.2f}×",
        "≥ 50 % cheaper",
        ("burst >= 50% cheaper at ratio 0.3", "poisson >= 50% cheaper at ratio 0.3"),
    ),
    Row(
        "capacity",
        "a manager and {settings.counts.2} real instances",
        "{figures.runs.500.instances_held} held, {figures.runs.500.relay_tokens_per_second:s3} tok/s",
        "{settings.counts.0}: {baseline.runs.50.relay_tokens_per_second:s3} tok/s",
        "—",
        "all held, none lost",
        ("500 instances held through the idle window and the step", "0 samples lost or duplicated"),
    ),
    Row(
        "relay_shards",
        "a manager core's token ceiling, {settings.relay_shards} shards",
        "{figures.reference.manager_core_ceiling_tokens_per_second:s3} tok/s",
        "relaying: {baseline.reference.manager_core_ceiling_tokens_per_second:s3} tok/s",
        "{ratios.manager_ceiling_over_single_relay_reference:.1f}×",
        "≥ 10×, none lost",
        ("ceiling >= 10x the single relay, reference lengths", "0 samples lost or duplicated"),
    ),
)

ROWS = SERVING + WEIGHT_PLANE + ASYNC + QUALITY + MULTI_TURN + SCALE + CHAOS + FUZZ + GPU

GPU_SECTIONS_ALONE = ("gpu-weight-path", "gpu-short-job")
"""Results of bench.gpu run for one section alone: named on the page, given no row."""
