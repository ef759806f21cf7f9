"""The settings of each service that a job sets, one module per service. A service's config model
(`services/<service>/config.py`) extends these with the wiring `rlmesh up` fills in (addresses,
ports, folders), and the job (`rlmesh/job.py`) embeds the same models, so a field is declared once
and every setting a service has can be set from a job file.

- `handover`: what each service's config takes from a job: its settings whole, plus the wiring.
- `manager`: the manager's settings (`[manager]`, and `algorithm.max_staleness`) and its relay shards' (`[relay]`).
- `rollout`: a rollout instance's settings (`[rollout]`): engine, weight receiver, deadlines.
- `tracking`: the experiment trackers a job reports to (`[tracking]`): Weights & Biases, MLflow.
- `trainer`: the trainer's settings (`[algorithm]` and `[trainer]`).
- `weights`: the weights service's settings (`[weights]`): data plane, compression, pace, deadlines.
"""
