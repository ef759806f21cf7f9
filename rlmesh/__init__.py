"""rlmesh: reinforcement learning of LLM policies on a mesh of gRPC services.

Generated contract code (`make protos`) is written under `gen/rlmesh/` and joins this package here.
"""

from pathlib import Path

# Generated modules (rlmesh.<service>.v1.*_pb2) are built, not committed, so they live outside the
# source tree; extending the package path lets them import as the contracts' proto packages say.
__path__.append(str(Path(__file__).resolve().parent.parent / "gen" / "rlmesh"))
