"""The weights service: holds the latest version in host memory and pushes it to every instance.

- `__main__`: `python -m services.weights --config weights.toml`.
- `config`: the service's config: the job's `[weights]` settings plus its socket and the manager's address.
- `encoding`: a rank payload encoded for one link mode, bucket by bucket, shared by every push that needs it.
- `main`: runs the service until SIGTERM.
- `pusher`: pushes the latest version to every instance behind it, each rank its own payload, with retries.
- `server`: the WeightsService servicer: receives uploads into the store, reports push state.
- `store`: the host-memory store of weight versions, complete and verified before they are the latest.
"""
