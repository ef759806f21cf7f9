"""The mesh's gRPC plumbing, shared by every service and tool.

- `authz`: Who may call what.
- `channels`: The client side of the mesh's gRPC.
- `credentials`: Bearer secrets, one per role.
- `prometheus`: Prometheus `/metrics` of a service.
- `servers`: The server side of the mesh's gRPC.
- `tls`: A local certificate authority for mutual TLS.
"""
