"""Where a run's figures go: metrics.jsonl, TensorBoard and the reward plot.

- `metrics`: Training metrics.
"""
