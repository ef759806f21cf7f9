"""The manager's domain: plain Python, testable without gRPC; the gRPC edge (server.py) and the journal sit above it.

- `admission`: Admission.
- `breaker`: The circuit breaker.
- `conversations`: A session's conversation as a harness sees it.
- `delivery`: Delivery.
- `dispatch_policy`: Dispatch policies.
- `journaled`: How the journal learns what changed.
- `ledger`: The request ledger.
- `records`: What the manager keeps.
- `registry`: The instance registry.
- `scheduling`: Scheduling.
- `sessions`: Multi-turn sessions.
- `stage_balance`: Inter-stage balance between training and rollout, after PolyRL / RLBoost.
- `state`: The manager's domain state.
- `trajectories`: Sessions as the contract carries them (SessionTrajectory, Segment).
"""
