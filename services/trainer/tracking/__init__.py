"""Where a run's figures go: metrics.jsonl, TensorBoard and the reward plot, and the experiment
trackers a job enables.

- `metrics`: Training metrics, fanned out to the trackers.
- `tracker`: What a tracker is handed (`Tracker`), the held-out sample record, starting the trackers.
- `wandb_tracker`: Weights & Biases.
- `mlflow_tracker`: MLflow.
"""
