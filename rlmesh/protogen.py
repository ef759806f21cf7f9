"""Generates the Python code and typed stubs of the contracts into gen/ (`make protos`); the
generated code is built, never committed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(protos: Path = ROOT / "protos", out: Path = ROOT / "gen") -> list[Path]:
    sources = sorted(protos.rglob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {protos}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    bin_dir = Path(sys.executable).parent
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{protos}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out}",
        *map(str, sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sources


if __name__ == "__main__":
    generated = generate()
    print(f"generated code for {len(generated)} contracts into gen/")
