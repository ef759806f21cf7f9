"""What the trainer's ranks run with torch: the sharded policy and critic, their steps, checkpoints
and weight hand-off. Every rank runs the same commands in the same order.

- `batching`: rollout groups turned into padded training tensors; policy log-probabilities scored.
- `checkpoint`: resumable sharded checkpoints, loadable on any number of ranks, and the HF export.
- `child_process`: rank 0's pickled messages with the processes it starts (reference worker, episode process).
- `commands`: the commands rank 0 broadcasts and every rank runs, keeping their collectives matched.
- `critic`: PPO's value model (`gae`), sharded and stepped beside the policy.
- `distributed`: the trainer's process group (torchrun or one rank) and each rank's torch thread.
- `evaluation`: held-out generation with the trainer's own policy.
- `handoff`: a rank's FSDP shards packed and uploaded to the weights service without a full tensor.
- `optimizing`: the optimizer step over summed gradients, refused when the loss or gradient is not finite.
- `policy`: the policy sharded with FSDP2, and what every rank does with it.
- `reference`: the frozen reference policy in a process of its own (`ref_logp` placed apart from `train`).
"""
