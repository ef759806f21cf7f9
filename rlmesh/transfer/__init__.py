"""Data planes that carry weight payloads from the weights service into rollout instances;
gRPC carries only control (begin, commit) whatever the backend."""
