"""The manager's domain: plain Python, testable without gRPC, driven from one event loop; the gRPC
edge (`server.py`) and the journal sit above it and reach it through `state`.

- `admission`: which submissions are accepted, and when a sample may start (staleness gate, capacity rule).
- `breaker`: the circuit breaker: failing instances get no work for a while; a sample failing everywhere ends its batch.
- `conversations`: a session's conversation as a harness sees it, and matching a request's messages against it.
- `delivery`: batches of groups in stream order, the micro-batches readers take and resume, acknowledgement.
- `dispatch_policy`: which instance each queued request goes to (`balanced`, `round_robin`).
- `journaled`: how the journal learns what changed: journaled fields and collections mark a change tracker.
- `records`: the records the manager keeps (instances, sample requests, batches, sessions and their segments).
- `registry`: the instance registry: incarnations, leases, served versions, measured throughput.
- `request_table`: every sample request with its tokens so far, the queue, and each request's life.
- `scheduling`: dispatching queued requests through the policy, failing batches whose version is gone, migration.
- `sessions`: multi-turn sessions: one token stream each, turns run as requests, limits and deadlines.
- `stage_balance`: balance between training and rollout (after PolyRL / RLBoost): generation window, instance count.
- `state`: the facade over the modules above that the server and the journal use.
- `trajectories`: sessions as the contract carries them (SessionTrajectory, Segment) and as the journal keeps them.
"""
