"""What the trainer's ranks run with torch: the sharded policy and critic, their steps, checkpoints and weight hand-off.

- `batching`: Turns rollout groups into padded training tensors and scores policy log-probabilities.
- `checkpoint`: Resumable sharded checkpoints.
- `child_process`: Rank 0's talk with the processes it starts (the reference worker, the episode process).
- `commands`: How the trainer's ranks move together.
- `critic`: The critic of PPO with a critic (advantage_estimator `gae`).
- `distributed`: The trainer's process group.
- `evaluation`: Held-out generation with the trainer's own policy.
- `handoff`: One rank's hand-off of its FSDP shards of a weight version to the weights service, without ever assembling a full tensor.
- `optimizing`: The optimizer step of a sharded model whose gradients were summed, unnormalised, over a mini-batch's micro-batches and the ranks' shares (the policy's and the critic's alike), and the refusal of a step whose loss or gradient is not finite.
- `policy`: The policy sharded with FSDP2 over the trainer's ranks, and what every rank does with it.
- `reference`: The frozen reference policy in a process of its own (placement.
"""
