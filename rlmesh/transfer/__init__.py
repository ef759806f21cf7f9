"""Data planes that carry weight payloads from the weights service into rollout instances;
gRPC carries only control (begin, commit) whatever the backend.

- `auth`: proof that weight bytes come from the push session that began them (challenge, MAC).
- `base`: the sender interface every backend implements, and the receive buffer they fill.
- `codecs`: per-link compression of payload buckets (zstd byte planes, delta, int8, fp8, sparse).
- `grpc_stream`: the plain gRPC backend, for links where no transfer engine or TCP port is reachable.
- `mooncake`: the Mooncake transfer engine backend (TCP here, RDMA on clusters).
- `payload`: a weight version as one flat byte payload plus its manifest (names, shapes, crc32s).
- `receiver`: a tensor-parallel rank's receiving end: its buffer, decoding and per-bucket checks.
- `shards`: a trainer rank's FSDP shards as a flat payload, through shared memory on one host or in chunks.
- `tcp`: the TCP backend: framed buckets received straight into the rank's buffer.
"""
