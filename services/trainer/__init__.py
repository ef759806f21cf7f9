"""The trainer service: the policy, the RL algorithm, checkpoints and metrics."""
