"""The four rlmesh services; each meets the others only through the protobuf contracts in `protos/`,
and none imports another (what two share lives in `rlmesh/`).

- `manager`: the mesh's control plane: instance registry, scheduler, group assembly, sessions, the OpenAI gateway.
- `rollout`: one inference engine instance (torch, vLLM or synthetic) in the elastic pool.
- `trainer`: the training loop, the sharded policy and critic, episodes, checkpoints and metrics.
- `weights`: holds the latest weight version in host memory and pushes it to every rollout instance.
"""
