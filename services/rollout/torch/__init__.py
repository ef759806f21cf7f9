"""The torch engine: the default rollout engine, on CPU or one GPU, optionally over tensor-parallel
worker processes.

- `device`: where and in which dtype the engine runs (`engine.device`, `engine.dtype`), checked at start.
- `engine`: the engine itself: continuous batching over one KV cache, on a thread of its own.
- `prefix_cache`: which finished turns' KV caches the ranks keep for a session's next turn, within a bound.
- `rank`: what each tensor-parallel rank holds: two model copies, its KV cache share, the weight receiver.
- `running`: the running sequences: each request's decoding state, in the KV cache's row order.
- `sampling`: sampling one token per running sequence on the logits' device.
- `tp_group`: rank 0's side of a tensor-parallel engine: the worker processes and their lockstep program.
- `tp_model`: one rank's share of a HF causal LM, its partial outputs meeting through gloo.
- `tp_worker`: a tensor-parallel worker process (rank >= 1) replaying rank 0's step program.
"""
