#!/usr/bin/env bash
# Makes rlmesh runnable on the GPU machine (Python 3.12 with torch, no network) from what a device
# call carries: the wheels of scripts/gpu-wheels.sh in .whl/ and the generated code in gen/
# (carry=[".whl", "gen"]). From the repository root, at the start of the check:
#
#   source scripts/gpu-env.sh        # this shell gets PYTHONPATH and PATH
#   bash scripts/gpu-env.sh          # or only install and check
#
# It installs the wheels into /tmp/site (pip --no-index --no-deps --target), exports
# PYTHONPATH=/tmp/site:<repo root> (so `import rlmesh`, its generated modules in gen/rlmesh, and
# `import services` work from any folder, and in every process rlmesh spawns: they inherit the
# environment and run as `sys.executable -m services.X`), puts an `rlmesh` command in /tmp/bin
# (python3 -m rlmesh.cli.main) first on PATH, and checks the imports.

_gpu_env() {
  local root site=/tmp/site bin=/tmp/bin py
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
  py=$(command -v python3) || { echo "gpu-env: no python3" >&2; return 1; }
  if ! compgen -G "$root/.whl/*.whl" >/dev/null; then
    echo "gpu-env: no wheels in $root/.whl (run scripts/gpu-wheels.sh here; carry .whl)" >&2; return 1
  fi
  if [ ! -d "$root/gen/rlmesh" ]; then
    echo "gpu-env: no $root/gen/rlmesh (make protos here; carry gen)" >&2; return 1
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$root"/.whl/*.whl || { echo "gpu-env: pip install failed" >&2; return 1; }

  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p "$bin"
  printf '#!/bin/sh\nexec "%s" -m rlmesh.cli.main "$@"\n' "$py" > "$bin/rlmesh"
  chmod +x "$bin/rlmesh"
  case ":$PATH:" in *":$bin:"*) ;; *) export PATH="$bin:$PATH" ;; esac
  export PYTHONUNBUFFERED=1

  # Each module the services import that comes from outside the repository, with where it was found.
  "$py" - <<'EOF' || { echo "gpu-env: imports failed" >&2; return 1; }
import importlib, importlib.metadata as md, sys
mods = ["grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "google.protobuf",
        "structlog", "pydantic", "zstandard", "isal.isal_zlib", "cryptography.hazmat.primitives.poly1305",
        "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "torch",
        "prometheus_client", "rich", "tqdm", "matplotlib", "pyarrow", "math_verify", "datasets",
        "rlmesh.cli.main", "rlmesh.launch.run", "rlmesh.common.v1.common_pb2_grpc",
        "rlmesh.manager.v1.manager_pb2_grpc", "rlmesh.weights.v1.weights_pb2_grpc",
        "rlmesh.rollout.v1.rollout_pb2_grpc", "rlmesh.trainer.v1.trainer_pb2_grpc",
        "rlmesh.reward.v1.reward_pb2_grpc", "services.manager.main", "services.weights.main",
        "services.rollout.main", "services.trainer.main"]
dists = {"grpc": "grpcio", "google.protobuf": "protobuf", "huggingface_hub": "huggingface-hub",
         "prometheus_client": "prometheus-client", "math_verify": "math-verify", "isal.isal_zlib": "isal",
         "cryptography.hazmat.primitives.poly1305": "cryptography", "grpc_health.v1.health": "grpcio-health-checking",
         "grpc_reflection.v1alpha.reflection": "grpcio-reflection"}
optional = {"math_verify", "datasets", "pyarrow", "matplotlib"}  # math tasks, dataset files, plots
failed = []
for name in mods:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        if name not in optional:
            failed.append(name)
        print(f"  {'WARN' if name in optional else 'FAIL'} {name}: {type(exc).__name__}: {exc}")
        continue
    if not name.startswith(("rlmesh", "services")):
        dist = dists.get(name, name.split(".")[0])
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = getattr(module, "__version__", "?")
        print(f"  ok   {name:40} {version:16} {getattr(module, '__file__', '')}")
if "torch" not in failed:
    import torch
    print(f"  python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}"
          f" ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'})")
for dist in ("pytest", "pytest-timeout", "hypothesis", "tensorboard", "regex", "typer", "fsspec", "pandas"):
    try:
        print(f"  have {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  have no {dist}")
sys.exit(1 if failed else 0)
EOF
  echo "gpu-env: PYTHONPATH=$PYTHONPATH; $(command -v rlmesh) -> $py -m rlmesh.cli.main"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  _gpu_env; _gpu_env_rc=$?; unset -f _gpu_env; return $_gpu_env_rc
else
  _gpu_env
fi
