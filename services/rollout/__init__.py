"""The rollout service: one inference engine instance in the elastic pool.

- `__main__`: `python -m services.rollout --config rollout.toml`.
- `config`: the instance's config: the job's `[rollout]` settings plus its socket, id and model folder.
- `engine`: the engine contract every backend implements (torch, vLLM, synthetic).
- `main`: runs the instance: load the engine, serve, join the manager's pool, drain on SIGTERM.
- `membership`: keeps the instance in the manager's pool: register, heartbeat the lease, re-register, deregister.
- `server`: the RolloutService servicer: validates requests and hands them to the engine and the weight updater.
- `synthetic_engine`: an engine without a model, emitting tokens at a set rate, for benchmarks at scale.
- `torch`: the default engine on torch: CPU or one GPU, optionally tensor-parallel over worker processes.
- `vllm_engine`: the engine on vLLM's async engine, with weight reload from pushed payloads (vLLM venv).
- `weight_update`: the rollout side of a weight push: check, route to ranks, verify, switch between steps.
"""
