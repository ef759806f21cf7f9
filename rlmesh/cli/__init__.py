"""The `rlmesh` command line.

- `main`: the `rlmesh` command and its subcommands: `up`, `scale`, a service by name, `init-model`, `fork-server`.
- `mesh_commands`: the commands that look after a running mesh: `status`, `health`, `drain`, `certs`, `secrets`.
- `status`: `rlmesh status`, a live terminal view of a running mesh from the services' status RPCs.
"""
