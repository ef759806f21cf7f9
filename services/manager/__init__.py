"""The manager service: the mesh's control plane. The gRPC edge and what runs beside it sit here;
the state they act on is plain Python in `domain/`.

- `__main__`: `python -m services.manager --config manager.toml`.
- `config`: the manager's config: the job's `[manager]` settings plus its socket, journal and weights address.
- `dispatcher`: runs sample requests on rollout instances and feeds their tokens back into the state.
- `domain`: the manager's state and rules: registry, requests, scheduling, groups, sessions (no gRPC).
- `gateway`: the OpenAI-compatible gateway process that agent harnesses call.
- `instance_stream`: one GenerateMany stream to one rollout instance incarnation, batched both ways.
- `journal`: the SQLite journal a restarted manager resumes from, written once per flush.
- `leases`: the watch beside the servicer: expired leases, quarantines, session deadlines, stragglers.
- `main`: runs the manager until SIGTERM.
- `relay`: a relay shard, a process of its own holding training requests' streams and tokens.
- `relays`: the manager's side of its relay shards: attempts out, progress into the ledger.
- `replies`: the state as the contract carries it: instances, turns, the stage balance, groups.
- `server`: the ManagerService servicer: checks each call, has the state and dispatcher act, replies.
- `session_feed`: newly opened sessions fanned out to watchers (the gateway), each with a bounded queue.
- `stored_versions`: asks the weights service what it holds before a version is published.
- `turns`: runs one session turn for RunTurn and StreamTurn, journaled before its reply.
"""
