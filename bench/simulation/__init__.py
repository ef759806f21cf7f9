"""The scale simulator: the manager's own domain driven under a virtual clock by simulated
instances, fleet traces and a simulated trainer (bench.scale, bench.cost).

- `fleet`: simulated rollout instances: the synthetic engine's decode model and lengths, versions, drains, crashes.
- `scenarios`: the reference fleet the benchmarks run, and the small meshes the simulator is checked against.
- `traces`: when instances are preempted (with a notice or none) and join: Poisson, a burst, a growing fleet.
- `trainer`: the simulated trainer: submits ahead within the staleness bound, trains for a time per token, publishes.
- `validation`: the same synchronous steps on a real manager with synthetic rollout processes and in the simulator.
- `world`: the simulation itself: ticks of the event loop, the manager's calls timed, the autoscaler, the outcome.
"""
