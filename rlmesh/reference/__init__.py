"""Reference pages generated from the code and the contracts, so that they cannot drift; a test
checks each committed page against what its generator prints.

- `contracts`: the contracts' services, RPCs, messages and enums, from the comments in protos/.
- `extensions`: the Python extension points (reward function, environment, algorithm parts), from
  their docstrings.
"""
