"""The torch engine: the default rollout engine, on CPU or one GPU, optionally over tensor-parallel worker processes.

- `device`: Where and in which dtype the torch engine runs (`engine.device`, `engine.dtype`), checked with a message naming what is wrong.
- `engine`: The default engine.
- `prefix_cache`: The torch engine's side of the per-session prefix cache.
- `rank`: What every tensor-parallel rank holds, in the rollout process (rank 0) and in worker processes alike.
- `running`: The torch engine's running sequences.
- `sampling`: The torch engine's sampling of one token per running sequence, on the device the logits are on.
- `tp_group`: Rank 0's side of a tensor-parallel engine.
- `tp_model`: One tensor-parallel rank's model.
- `tp_worker`: A tensor-parallel worker process (rank >= 1), started by rank 0's engine.
"""
