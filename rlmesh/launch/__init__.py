"""`rlmesh up`'s launcher, a module per job: the plan (plan), ports (ports), network namespaces
(netns), process spawning (processes), each service's settings (services), the supervisor
(supervisor) with the scale file (scale) and the autoscaler (autoscale), mesh.json (state), the
console (console), and the run that ties them together (run)."""
