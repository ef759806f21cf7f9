"""`python -m bench.gpu --device cuda|cpu`: every section of the GPU check in one go, a table at the
end, figures in a JSON file and a log beside it. Exit 1 when parity fails, the short job's reward
does not rise, the critic job's critic logs no finite figures, or a section fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import RESULTS
from bench.gpu.engine_steps import measure_engine_steps
from bench.gpu.models import write_models
from bench.gpu.parity import check_parity
from bench.gpu.short_job import run_short_job
from bench.gpu.train_step import measure_grpo_step
from bench.gpu.weight_path import measure

log = logging.getLogger("gpu-check")

SECTIONS = ("parity", "engine_steps", "train_step", "weight_path", "short_job", "critic_job")
CRITIC_JOB = ("algorithm.advantage_estimator=gae",)
"""The critic job's settings: the default job trained by PPO with a critic."""

SIZES = {
    # samples, tokens per sample, samples per micro-batch, parity prompts and tokens, decode batches
    "cuda": {
        "samples": 64,
        "tokens": 512,
        "micro_batch_samples": 8,
        "parity_prompts": 6,
        "parity_tokens": 32,
        "decode_batches": [1, 16, 64],
        "pushes": 3,
        "step_batches": [1, 64],
        "step_tokens": 64,
        "critic_job_steps": 30,
    },
    "cpu": {
        "samples": 8,
        "tokens": 64,
        "micro_batch_samples": 4,
        "parity_prompts": 3,
        "parity_tokens": 12,
        "decode_batches": [1, 4, 8],
        "pushes": 2,
        "step_batches": [1, 8],
        "step_tokens": 16,
        "critic_job_steps": 8,
    },
}


def machine(device: str) -> dict:
    import grpc
    import transformers

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        found |= {
            "gpu": properties.name,
            "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
        }
    return found


def section(results: dict, name: str, run: Callable[[], dict]) -> None:
    """Runs one section; a failure is recorded with its traceback and the check goes on."""
    started = time.perf_counter()
    log.info("section %s: start", name)
    try:
        results[name] = run()
    except Exception as exc:  # noqa: BLE001 - every section's outcome is reported
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log.error("section %s failed:\n%s", name, traceback.format_exc())
    results[name]["section_seconds"] = round(time.perf_counter() - started, 2)
    log.info("section %s: %s", name, json.dumps(results[name], default=str))


def failures(results: dict) -> list[str]:
    failed = [name for name, figures in results.items() if isinstance(figures, dict) and "error" in figures]
    if "error" not in results.get("parity", {"error": ""}) and not results["parity"]["holds"]:
        failed.append("parity")
    job = results.get("short_job", {"error": ""})
    if "error" not in job and not (job["completed"] and job["rises"]):
        failed.append("short_job")
    critic = results.get("critic_job", {"error": ""})
    if "error" not in critic and not (
        critic["completed"] and critic.get("critic_finite") and critic.get("critic_steps") == critic["steps"]
    ):
        failed.append("critic_job")
    return failed


def table(results: dict) -> str:
    rows = [
        f"GPU check on {results['machine'].get('gpu', 'CPU')} ({results['device']}), "
        f"torch {results['machine']['torch']}"
    ]
    parity = results.get("parity", {})
    if "float32" in parity:
        rows.append(
            f"parity ({parity['shape']}): greedy equal alone fp32 "
            f"{parity['float32']['greedy_equal_alone']}/{parity['prompts']}, "
            f"bf16 {parity['bfloat16']['greedy_equal_alone']}/{parity['prompts']}; "
            f"max |dlogprob| fp32 {parity['float32']['max_logprob_difference']:.2e}, "
            f"bf16 {parity['bfloat16']['max_logprob_difference']:.2e}; holds {parity['holds']}"
        )
    steps = results.get("engine_steps", {})
    for batch in sizes_of(steps):
        rows.append(
            f"decode step in-process, batch {batch}: engine {steps[batch]['engine_step_ms']:.1f} ms "
            f"({steps[batch]['engine_tokens_per_second']:.0f} tok/s), HF loop {steps[batch]['hf_step_ms']:.1f} ms"
        )
    for name, figures in results.get("train_step", {}).items():
        if isinstance(figures, dict) and "step_seconds" in figures:
            rows.append(
                f"GRPO step {name}: {figures['step_seconds']:.3f} s, peak {figures['peak_memory_gib']:.1f} GiB, "
                f"{figures.get('tokens_per_second', 0):.0f} tok/s"
            )
    for name, figures in results.get("weight_path", {}).items():
        if isinstance(figures, dict) and "stored_to_served_seconds" in figures:
            rows.append(
                f"weights {name}: {figures['payload_bytes'] / 1e9:.2f} GB stored->served "
                f"{figures['stored_to_served_seconds']:.3f} s, baseline (D2H + socket) "
                f"{figures['baseline']['seconds']:.3f} s, ratio {figures['ratio_to_baseline']:.2f}"
            )
            if "decode_tokens_per_second" in figures:
                rates = ", ".join(f"batch {b}: {r:.0f}" for b, r in figures["decode_tokens_per_second"].items())
                during = figures["decode_during_push"]
                rows.append(
                    f"decode tok/s {name}: {rates}; batch {during['batch']} during push / without: "
                    f"{during['ratio']:.2f}"
                )
    job = results.get("short_job", {})
    if "reward_first" in job:
        rows.append(
            f"short job: {job['steps']} steps, reward {job['reward_first']:.3f} -> {job['reward_last']:.3f}, "
            f"median step {job['median_step_seconds']:.3f} s, rises {job['rises']}"
        )
    critic = results.get("critic_job", {})
    if "critic" in critic:
        rows.append(
            f"critic job (PPO + critic): {critic['steps']} steps, reward {critic['reward_first']:.3f} -> "
            f"{critic['reward_last']:.3f}, median step {critic['median_step_seconds']:.3f} s; last step's value loss "
            f"{critic['critic']['critic/value_loss']:.4f}, explained variance "
            f"{critic['critic']['critic/explained_variance']:.3f}, finite {critic['critic_finite']}"
        )
    rows.append(f"total {results['total_seconds']:.0f} s; failed: {results['failed'] or 'none'}")
    return "\n".join(rows)


def sizes_of(figures: dict) -> list[str]:
    """The batch sizes a section measured (its keys that are numbers)."""
    return [key for key in figures if key.isdigit()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON results (default bench/results/gpu.json, or gpu-cpu.json on the CPU)",
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="model folders and run outputs (default: a temporary folder)"
    )
    parser.add_argument("--job-steps", type=int, default=30)
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)"
    )
    args = parser.parse_args(argv)
    chosen = args.sections.split(",")
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    out = args.out or RESULTS / ("gpu.json" if args.device == "cuda" else "gpu-cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlmesh-gpu-"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(out.with_suffix(".log"), mode="w")],
    )
    sizes = SIZES[args.device]
    started = time.perf_counter()
    results: dict = {
        "device": args.device,
        "machine": machine(args.device),
        "sizes": sizes,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    section(
        results,
        "models",
        lambda: {name: str(path) for name, path in write_models(work / "models", args.device).items()},
    )
    folders = {name: Path(path) for name, path in results["models"].items() if name != "section_seconds"}
    first = next(iter(folders), None)

    def parity() -> dict:
        return {
            "shape": first,
            **check_parity(folders[first], args.device, sizes["parity_prompts"], sizes["parity_tokens"]),
        }

    def train_steps() -> dict:
        return {
            name: measure_grpo_step(
                folder, args.device, sizes["samples"], sizes["tokens"], sizes["micro_batch_samples"]
            )
            for name, folder in folders.items()
        }

    def weight_paths() -> dict:
        # On the CPU one small shape is enough to keep the path exercised between GPU runs.
        shown = folders if args.device == "cuda" else {first: folders[first]}
        return {
            name: asyncio.run(
                measure(
                    folder,
                    args.device,
                    sizes["pushes"],
                    sizes["decode_batches"] if name == first else None,
                    quick=args.device == "cpu",
                )
            )
            for name, folder in shown.items()
        }

    runs = {
        "parity": parity,
        "engine_steps": lambda: measure_engine_steps(
            folders[first], args.device, sizes["step_batches"], sizes["step_tokens"]
        ),
        "train_step": train_steps,
        "weight_path": weight_paths,
        "short_job": lambda: run_short_job(args.device, args.job_steps, work / "short-job"),
        "critic_job": lambda: run_short_job(args.device, sizes["critic_job_steps"], work / "critic-job", CRITIC_JOB),
    }
    for name in SECTIONS:
        if name in chosen:
            section(results, name, runs[name])
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    results["failed"] = failures(results)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(table(results), flush=True)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
