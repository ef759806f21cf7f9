"""The `rlmesh` commands that run things: `up` (a job on the whole mesh, its flags applied to the
job), `fork-server`, `init-model` and `scale`; main.py parses the command line and calls them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

FLAG_FIELDS = {
    "steps": "algorithm.steps",
    "max_staleness": "algorithm.max_staleness",
    "autoscale": "mesh.autoscale",
    "trainer_ranks": "mesh.trainer_ranks",
    "rollout_tp": "rollout.engine.tensor_parallel_size",
    "rollout_netns": "mesh.rollout_netns",
    "relay_shards": "mesh.relay_shards",
    "transfer_backend": "weights.backend",
    "compression": "weights.compression",
    "engine": "rollout.engine.kind",
    "update_mode": "rollout.engine.update_mode",
    "host": "mesh.host",
    "base_port": "mesh.base_port",
    "tls": "mesh.tls",
    "tls_dir": "mesh.tls_dir",
    "insecure": "mesh.insecure",
    "secrets_dir": "mesh.secrets_dir",
    "model_dir": "model.path",
    "output_dir": "output.dir",
}
"""`rlmesh up` flags and the job fields they override."""
PATH_FLAGS = ("model_dir", "output_dir", "tls_dir", "secrets_dir")
"""Flags naming a folder: relative to the working directory, as a shell user means them (a job
file's own relative paths are its folder's)."""


def _builtin_builder(name: str):
    """The function that creates the built-in model `name` in a folder."""
    # Imported only here: the builders import torch and transformers (seconds of CPU).
    if name == "tiny-chat":
        from rlmesh.models.chat_tiny import create_chat_model

        return create_chat_model
    from rlmesh.models.qwen2_tiny import create_default_model, create_feedback_model

    return create_feedback_model if name == "tiny-feedback" else create_default_model


def _ensure_builtin_model(name: str) -> Path:
    from rlmesh.job import DEFAULT_MODELS
    from rlmesh.models.builtin import ensure_model

    return ensure_model(DEFAULT_MODELS[name].resolve(), lambda folder: _builtin_builder(name)(folder), name)


def overrides(args: argparse.Namespace) -> dict[str, object]:
    from rlmesh.config import ConfigError
    from rlmesh.job import parse_value

    overrides: dict[str, object] = {
        field: getattr(args, flag) for flag, field in FLAG_FIELDS.items() if getattr(args, flag) is not None
    }
    for flag in PATH_FLAGS:
        if getattr(args, flag) is not None:
            overrides[FLAG_FIELDS[flag]] = str(Path(getattr(args, flag)).resolve())
    if args.rollout_instances is not None:
        overrides["mesh.rollout_instances"], overrides["mesh.max_rollout_instances"] = args.rollout_instances
    if args.tls_dir is not None:
        overrides["mesh.tls"] = True
    for assignment in args.set or []:
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {assignment!r}: write it FIELD=VALUE, e.g. algorithm.learning_rate=1e-4")
        overrides[key.strip()] = parse_value(value.strip())
    return overrides


def prepare_job(args: argparse.Namespace):
    """The job of `--job` (or the default job) with the flags applied, its network namespaces
    possible and its model folder ready (its tasks are checked against the model's tokenizer
    once the fork server can do it: `rlmesh.tasks.check`). Raises ConfigError."""
    from rlmesh.config import ConfigError
    from rlmesh.job import load_job
    from rlmesh.launch.netns import netns_problem
    from rlmesh.models.families import check_model_dir

    job, base = load_job(args.job, overrides(args))
    if job.mesh.rollout_netns and (problem := netns_problem()):
        raise ConfigError(
            f"mesh.rollout_netns = {job.mesh.rollout_netns} runs rollout instances in network namespaces, "
            f"which this process cannot create: {problem}"
        )
    model_dir = Path(job.model.path) if job.model.path else _ensure_builtin_model(job.model.builtin)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} is not a HF-format model folder (no config.json)")
    check_model_dir(model_dir)
    return job, base, model_dir


def up(args: argparse.Namespace) -> int:
    # Every process this one starts is a fork followed at once by an exec, or a fork of the fork
    # server, which imports gRPC but never uses it: gRPC's fork handlers have nothing to protect,
    # and they log a line per restarted service when they skip.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from rlmesh.config import ConfigError
    from rlmesh.launch.netns import plan_netns
    from rlmesh.launch.plan import LaunchPlan
    from rlmesh.launch.run import run_mesh
    from rlmesh.logging import configure_logging
    from rlmesh.settings.handover import hand_settings_to_services, trainer_settings
    from rlmesh.tasks.check import CHECK_FAILED

    configure_logging("warning")
    try:
        job, base, model_dir = prepare_job(args)
        mesh = job.mesh
        if job.rollout.engine.kind == "vllm":
            import torch

            from rlmesh.launch.services import VLLM_PYTHON
            from rlmesh.models.engine_fit import vllm_cpu_refusal

            if not VLLM_PYTHON.exists():
                raise ConfigError(f"rollout.engine.kind = vllm needs {VLLM_PYTHON}: run `make setup-vllm` first")
            # vLLM runs on a GPU where one is visible; on CPU its attention takes some head sizes only.
            if not torch.cuda.is_available() and (refusal := vllm_cpu_refusal(model_dir)):
                raise ConfigError(f"rollout.engine.kind = vllm: {refusal}")
        if missing := job.missing_file() or job.missing_gpu() or job.tracking.missing_package():
            raise ConfigError(missing)
        netns = None
        output_dir = Path(job.output.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        created = not output_dir.exists()
        output_dir.mkdir(parents=True, exist_ok=True)
        if mesh.rollout_netns:
            try:
                netns = plan_netns(output_dir, mesh.rollout_netns)
            except RuntimeError as exc:
                raise ConfigError(f"mesh.rollout_netns: {exc}") from exc
        tls_dir = None
        if mesh.tls:
            from rlmesh.rpc.tls import create_certificates

            tls_dir = Path(mesh.tls_dir).resolve() if mesh.tls_dir else output_dir / "tls"
            create_certificates(tls_dir, [mesh.host, *(netns.hosts if netns is not None else [])])
        secrets_dir = None
        if not mesh.insecure:
            from rlmesh.rpc.credentials import create_secrets

            secrets_dir = create_secrets(
                Path(mesh.secrets_dir).resolve() if mesh.secrets_dir else output_dir / "secrets"
            )
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"rlmesh up: {exc}", file=sys.stderr)
        return 2
    (output_dir / "job.json").write_text(json.dumps(job.model_dump(mode="json"), indent=2))
    trainer_config = output_dir / "trainer.json"
    trainer_config.write_text(json.dumps(trainer_settings(job, base, model_dir, output_dir), indent=2))
    plan = LaunchPlan(
        job=job,
        output_dir=output_dir,
        model_dir=model_dir,
        trainer_config=trainer_config,
        tls_dir=tls_dir,
        secrets_dir=secrets_dir,
        netns=netns,
        job_dir=base,
        warm_fork_server=Path(args.fork_server) if args.fork_server else None,
    )
    handed = hand_settings_to_services(job, output_dir)
    try:
        code = asyncio.run(run_mesh(plan))
    finally:
        for variable in handed:
            os.environ.pop(variable, None)
    if code == 130:
        print("\ninterrupted: every process of the mesh was stopped", file=sys.stderr)
    if code == CHECK_FAILED and created:
        # A job refused before any service started leaves no run folder behind.
        shutil.rmtree(output_dir, ignore_errors=True)
    return code


def fork_server(args: argparse.Namespace) -> int:
    from rlmesh.forking.warm_forkserver import warm_environment

    socket_path = Path(args.socket).resolve()
    if not socket_path.parent.is_dir():
        print(f"rlmesh fork-server: --socket {args.socket}: no folder {socket_path.parent}", file=sys.stderr)
        return 2
    # sockaddr_un holds 108 bytes.
    if len(str(socket_path).encode()) > 107:
        print(f"rlmesh fork-server: --socket {args.socket}: a Unix socket path is at most 107 bytes", file=sys.stderr)
        return 2
    os.execve(
        sys.executable,
        [sys.executable, "-m", "rlmesh.forking.warm_forkserver", "--socket", str(socket_path)],
        warm_environment(dict(os.environ)),
    )


def init_model(args: argparse.Namespace) -> int:
    from rlmesh.logging import configure_logging

    configure_logging("info")
    if args.warmup_iterations is not None:
        if args.kind != "tiny-chat" or args.model_dir is None:
            print(
                "error: --warmup-iterations applies to --kind tiny-chat written to a --model-dir of your own",
                file=sys.stderr,
            )
            return 2
        from rlmesh.models.chat_tiny import ChatModelSpec, create_chat_model

        create_chat_model(Path(args.model_dir), ChatModelSpec(warmup_iterations=args.warmup_iterations))
    elif args.model_dir is None:
        _ensure_builtin_model(args.kind)
    else:
        _builtin_builder(args.kind)(Path(args.model_dir))
    return 0


def scale(args: argparse.Namespace) -> int:
    from rlmesh.launch.scale import request_scale
    from rlmesh.launch.state import STATE_FILE, find_running_mesh

    run = Path(args.run) if args.run else find_running_mesh(Path("runs"))
    if run is None or not (run / STATE_FILE).is_file():
        where = args.run or "runs/"
        print(
            f"rlmesh scale: no running mesh found in {where} (rlmesh up writes {STATE_FILE} in its output folder)",
            file=sys.stderr,
        )
        return 2
    state = json.loads((run / STATE_FILE).read_text())
    bounds = state["rollout_instances"]
    if not bounds["min"] <= args.rollout_instances <= bounds["max"]:
        print(
            f"rlmesh scale: this mesh runs {bounds['min']} to {bounds['max']} rollout instances "
            f"(rlmesh up --rollout-instances MIN:MAX); {args.rollout_instances} is outside",
            file=sys.stderr,
        )
        return 2
    request_scale(run, args.rollout_instances)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            current = json.loads((run / STATE_FILE).read_text())["rollout_instances"]
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        # Done once the new instances run and the drained ones have handed their work back and left.
        if (
            current["target"] == args.rollout_instances
            and len(current["running"]) == args.rollout_instances
            and not current["leaving"]
        ):
            print(f"rollout instances: {len(current['running'])} ({', '.join(r['name'] for r in current['running'])})")
            return 0
    print(
        f"rlmesh scale: the mesh in {run} did not reach {args.rollout_instances} instances in {args.timeout:.0f} s",
        file=sys.stderr,
    )
    return 1
