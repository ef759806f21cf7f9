"""The settings of each service that a job sets, one module per service. A service's config model
(`services/<service>/config.py`) extends these with the wiring `rlmesh up` fills in (addresses,
ports, folders), and the job (`rlmesh/job.py`) embeds the same models, so a field is declared once
and every setting a service has can be set from a job file."""
