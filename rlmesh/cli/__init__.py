"""The `rlmesh` command line.

- `main`: the `rlmesh` command: parses its subcommands and runs the one asked for (a service by name too).
- `run_commands`: the commands that run things: `up` (flags applied to the job), `fork-server`, `init-model`, `scale`.
- `mesh_commands`: the commands that look after a running mesh: `status`, `health`, `drain`, `certs`, `secrets`.
- `status`: `rlmesh status`, a live terminal view of a running mesh from the services' status RPCs.
"""
