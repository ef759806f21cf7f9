"""Fork servers: processes that import the heavy modules once and fork services and helpers from there.

- `forkserver`: a run's fork server: imports torch, transformers and gRPC once, forks each service start.
- `helpers`: helper processes (`python -m module`) forked by the warm fork server, or None to exec them.
- `warm_forkserver`: `rlmesh fork-server`, a long-lived process that forks each run's fork server warm.
"""
