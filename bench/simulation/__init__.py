"""The scale simulator: the manager's own domain driven under a virtual clock by simulated
instances, fleet traces and a simulated trainer (bench.scale, bench.cost).

- `calibration`: what a real `rlmesh up` run tells the simulator (trainer, lengths, weight plane); torch's speed.
- `fleet`: simulated rollout instances: the synthetic engine's decode model and lengths, versions, drains, crashes.
- `scenarios`: the reference fleet the benchmarks run, and the real meshes of 1 to 3 instances it is checked against.
- `traces`: when instances are preempted (with a notice or none) and join: Poisson, a burst, a growing fleet.
- `trainer`: the simulated trainer: submits ahead within the staleness bound, trains for a time per token, publishes.
- `validation`: real `rlmesh up` runs (torch and synthetic engines, 1 to 3 instances) against their simulations.
- `world`: the simulation itself: ticks of the event loop, the manager's calls timed, the autoscaler, the outcome.
"""
