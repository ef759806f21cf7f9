"""The mesh's gRPC plumbing, shared by every service and tool.

- `authz`: the mesh's roles and, for every RPC of every contract, the roles allowed to call it.
- `channels`: the client side: channel options, deadlines, request ids, this process's TLS and secret.
- `credentials`: bearer secrets, one per role, the verifiers file of their digests, user-service tokens.
- `prometheus`: a service's Prometheus `/metrics`, served on its own port from its event loop.
- `servers`: the server side: reflection, health, graceful drain, authorization, domain errors as statuses.
- `tls`: a local certificate authority for mutual TLS (`rlmesh certs`, `rlmesh up --tls`).
"""
