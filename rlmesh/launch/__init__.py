"""`rlmesh up`'s launcher, a module per job, and the autoscaler's targets.

- `autoscale`: follows the manager's recommended rollout count, with hysteresis, within bounds, for a scale target.
- `kubernetes_scale`: the autoscaler's Kubernetes target: a Deployment's replicas through its scale subresource.
- `console`: what `rlmesh up` prints: the mesh, the progress bar, the supervisor's events, the summary.
- `netns`: network namespaces and veth pairs for rollout instances, and sweeping up leftovers.
- `plan`: what a run starts: the job plus output folder, certificates, secrets, addresses.
- `ports`: free ports, the ports a mesh takes from its base, each service's metrics port.
- `processes`: spawning service processes with their log files, waiting until they serve, stopping them.
- `run`: the whole `rlmesh up` run: start in order, supervise, scale, show progress, stop.
- `scale`: the scale file `rlmesh scale` writes, and which instances to drain or start for a count.
- `services`: what each service is started with: its module, address and environment settings.
- `starter`: starts services forked from the fork server, or by exec, and runs the task check first.
- `state`: mesh.json, what a running `rlmesh up` tells `rlmesh scale`, `status` and the chaos suite.
- `supervisor`: restarts exited services with backoff, keeps the rollout count, keeps mesh.json current.
"""
