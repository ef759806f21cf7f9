"""Reference pages generated from the code and the contracts, so that they cannot drift; a test
checks each committed page against what its generator prints.

- `codemap`: the code map (`docs/code-map.md`): every package with its modules, from these docstrings.
- `configuration`: the job file's reference (`docs/reference/configuration.md`), from the settings
  models' field docstrings.
- `contracts`: the contracts' services, RPCs, messages and enums, from the comments in protos/.
- `extensions`: the Python extension points (reward function, environment, algorithm parts), from
  their docstrings.
"""
