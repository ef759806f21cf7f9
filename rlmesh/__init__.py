"""rlmesh: reinforcement learning of LLM policies on a mesh of gRPC services; this package holds what
the services and tools share. Generated contract code (`make protos`) is written under `gen/rlmesh/`
and joins this package here.

- `atomic_file`: `write_atomically`, the one way files that others read (secrets, certificates, mesh.json) are written.
- `chat`: chat on a session's token stream: turns, stop strings, tool calls, the gateway's URL.
- `cli`: the `rlmesh` command line (`rlmesh up`, `scale`, `status`, `secrets`, `certs`, ...).
- `config`: a service's typed configuration: a TOML file plus environment overrides, validated at start.
- `entrypoint`: the start every service process shares: config, logging, run until SIGTERM.
- `environments`: the environments multi-turn tasks run episodes in (Python, a remote service, verifiers).
- `errors`: domain errors services raise and the gRPC layer maps to status codes.
- `forking`: fork servers that import the heavy modules once and fork services and helpers.
- `job`: the job file (`job.toml`): model, tasks, algorithm, mesh shape and outputs, typed.
- `launch`: `rlmesh up`'s launcher: plan, processes, supervisor, scaling and console.
- `lifecycle`: what the mesh's processes share about lifetime, CPU class and freed memory.
- `logging`: structlog setup: JSON lines for services, console output on a terminal, rate limits.
- `micro_batch`: the one rule rollout groups are packed into micro-batches by (manager and trainer).
- `models`: model families, the built-in tiny models, weight loading and tensor-parallel layouts.
- `protogen`: generates the contracts' Python code and stubs into `gen/` (`make protos`).
- `reference`: generators of the reference pages (contracts, extension points) in `docs/reference/`.
- `rewards`: reward functions: built-in, a Python callable, a remote verifier, and the guard around them.
- `rpc`: the mesh's gRPC plumbing: channels, servers, authorization, secrets, TLS, `/metrics`.
- `sampling`: the checks every sampling request must pass, shared by manager and rollout.
- `settings`: the settings a job sets for each service, one model per service.
- `tasks`: verifiable tasks: prompt sources, rendering, scoring and the job's task mixture.
- `transfer`: the data planes that carry weight payloads to rollout instances (gRPC, TCP, Mooncake).
"""

from pathlib import Path

# Generated modules (rlmesh.<service>.v1.*_pb2) are built, not committed, so they live outside the
# source tree; extending the package path lets them import as the contracts' proto packages say.
__path__.append(str(Path(__file__).resolve().parent.parent / "gen" / "rlmesh"))
