"""The `rlmesh` command line.

- `configref`: The job file's reference, generated from the models' field docstrings so that it cannot drift.
- `main`: The `rlmesh` command.
- `mesh_commands`: The commands that look after a running mesh and its credentials.
- `status`: `rlmesh status`.
"""
