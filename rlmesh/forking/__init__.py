"""Fork servers: processes that import the heavy modules once and fork services and helpers from there.

- `forkserver`: A fork server for the mesh's services.
- `helpers`: Helper processes (`python -m module`) forked for this process by the warm fork server named in RLMESH_FORK_SERVER, past the imports that cost an exec'd one 6 to 10 CPU-seconds; None where it cannot fork one, and the caller execs it as before.
- `warm_forkserver`: The warm fork server (`rlmesh fork-server`).
"""
